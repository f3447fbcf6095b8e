"""B1: the cost of one optimizer micro-step under gradient accumulation.

On a ~33.6M-parameter float32 tree with Adam and a window of 4 micro-batches,
params and optimizer state donated to ``jax.jit``, this times side by side:

* ``floor``: a jitted tree add ``acc + g`` with ``acc`` donated (read the
  gradient, read the accumulator, write the accumulator): the least a
  non-closing micro-step can cost;
* ``fused``: ``oa.apply_gradients(oa.chain(oa.accumulate(4), adam), ...)``;
* ``fused+noise_scale``: the same with ``accumulate(4,
  noise_scale_decay=0.9)`` (the fused micro-step with the gradient noise
  scale: one sum of squares per leaf more);
* ``plain``: the ``tx.update`` + ``optax.apply_updates`` protocol on the same
  chain, jitted together;
* ``MultiSteps``: ``optax.MultiSteps(adam, 4)``, the same protocol;
* ``oa.MultiSteps(fused)``, ``oa.MultiSteps(plain)``: the drop-in
  ``oa.MultiSteps(adam, 4)`` through ``oa.apply_gradients`` and through the
  plain protocol (the one-line migration from ``MultiSteps``).

Each of the last five is timed on a *non-closing* micro-step (the state's
``mini_step`` is 1: mid-window, the accumulator is read and written; at 0 it
is only overwritten) and on a *closing* one (``mini_step`` is 3), each in its
own loop fed its own outputs back (donation): between two timed calls,
outside the timing, the fed-back state's ``mini_step`` is reset to the
variant's value (a scalar replacement). As a cross-check that does not touch
the state at all, a whole window of 4 calls is timed too (reported per call).
The last column counts the ``copy`` instructions of params-sized leaves in
the optimized HLO (``compiled.as_text()``).

Figures are medians over interleaved rounds (each timed call followed by a
short pause, so that one call's deferred frees are not charged to the next),
as ratios to ``floor``. The compiled steps' ``memory_analysis()`` gives
argument/output/alias/temp bytes (on CPU the peak leaves the temporaries out,
so they are shown on their own).

Run: ``python benchmarks/bench_step.py [--tiny]``.
"""

from __future__ import annotations

import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
import _pipeline  # noqa: E402

import optaxaccum as oa  # noqa: E402

K = 4
LEARNING_RATE = 1e-3
# 4 x 2048 x 4096 = 33,554,432 float32 parameters (128 MiB per tree).
FULL_SHAPES = {f"w{i}": (2048, 4096) for i in range(4)}
TINY_SHAPES = {"w0": (64, 128), "w1": (32, 32), "b": (128,)}
_STATE_TYPES = (oa.AccumulateState, optax.MultiStepsState, oa.MultiStepsState)
# The kinds of step compared, as named in the rows.
KINDS = (
    "fused",
    "fused+noise_scale",
    "plain",
    "MultiSteps",
    "oa.MultiSteps(fused)",
    "oa.MultiSteps(plain)",
)
# Temporary bytes below this are scalars (flags, counters), not tree data.
SCALARS = 1024


def _tree(shapes, seed):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {
        name: 0.01 * jax.random.normal(key, shape, jnp.float32)
        for key, (name, shape) in zip(keys, sorted(shapes.items()), strict=True)
    }


def _with_mini_step(state, mini_step):
    """``state`` with the ``mini_step`` of its accumulation state replaced."""

    def fix(s):
        if isinstance(s, _STATE_TYPES):
            return s._replace(mini_step=jnp.asarray(mini_step, jnp.int32))
        return s

    return jax.tree.map(
        fix, state, is_leaf=lambda s: isinstance(s, _STATE_TYPES)
    )


def _mini_step(state):
    leaves = jax.tree.leaves(
        state, is_leaf=lambda s: isinstance(s, _STATE_TYPES)
    )
    return int(next(s for s in leaves if isinstance(s, _STATE_TYPES)).mini_step)


def _tree_copies(compiled, shapes):
    """How many ``copy`` instructions of a params leaf the program holds."""
    dims = {",".join(map(str, shape)) for shape in shapes.values()}
    found = re.findall(r"= f32\[([\d,]*)\]\S* copy\(", compiled.as_text())
    return sum(d in dims for d in found)


class _Loop:
    """A donated ``(params, opt_state)`` loop around one compiled step."""

    def __init__(self, compiled, grads, opt_state, params, mini_step):
        self.compiled = compiled
        self.grads = grads
        self.state = opt_state
        self.params = params
        self.mini_step = mini_step

    def args(self):
        return self.params, self.state, self.grads

    def prepare(self):
        if self.mini_step is not None:
            self.state = _with_mini_step(self.state, self.mini_step)
        return self.args()

    def keep(self, out):
        self.params, self.state = out

    def timed(self):
        return _common.Timed(self.compiled, self.prepare, self.keep)

    def window(self):
        """Times ``K`` consecutive calls (one whole window), no resets."""

        def call(params, opt_state, grads):
            for _ in range(K):
                params, opt_state = self.compiled(params, opt_state, grads)
            return params, opt_state

        return _common.Timed(call, self.args, self.keep)


def main(tiny: bool = False, rounds: int | None = None) -> dict:
    """Runs B1; returns the results (see ``run_all.py`` for the format)."""
    shapes = TINY_SHAPES if tiny else FULL_SHAPES
    if rounds is None:
        rounds = 3 if tiny else 15
    n_params = sum(math.prod(s) for s in shapes.values())
    tree_bytes = 4 * n_params

    def params():
        return _tree(shapes, 0)

    grads = _tree(shapes, 1)
    adam = optax.adam(LEARNING_RATE)
    ours = oa.chain(oa.accumulate(K), adam)
    noisy = oa.chain(oa.accumulate(K, noise_scale_decay=0.9), adam)
    multi = optax.MultiSteps(adam, K)
    drop_in = oa.MultiSteps(adam, K)

    def compile_step(fn, *args, donate):
        # As a user compiles it: no compiler option.
        jitted = jax.jit(fn, donate_argnums=donate)
        return jitted.lower(*args).compile()

    p0 = params()
    compiled = {
        "fused": compile_step(
            _pipeline.fused_step(ours), p0, ours.init(p0), grads, donate=(0, 1)
        ),
        "fused+noise_scale": compile_step(
            _pipeline.fused_step(noisy),
            p0,
            noisy.init(p0),
            grads,
            donate=(0, 1),
        ),
        "plain": compile_step(
            _pipeline.plain_step(ours), p0, ours.init(p0), grads, donate=(0, 1)
        ),
        "MultiSteps": compile_step(
            _pipeline.plain_step(multi),
            p0,
            multi.init(p0),
            grads,
            donate=(0, 1),
        ),
        "oa.MultiSteps(fused)": compile_step(
            _pipeline.fused_step(drop_in),
            p0,
            drop_in.init(p0),
            grads,
            donate=(0, 1),
        ),
        "oa.MultiSteps(plain)": compile_step(
            _pipeline.plain_step(drop_in),
            p0,
            drop_in.init(p0),
            grads,
            donate=(0, 1),
        ),
    }
    compiled_adam = compile_step(
        _pipeline.fused_step(adam), p0, adam.init(p0), grads, donate=(0, 1)
    )
    # Beside the headline: the same fused step with the options of a
    # conditional's in-place pass-through (none are needed).
    with_options = (
        jax.jit(
            _pipeline.fused_step(ours),
            donate_argnums=(0, 1),
            compiler_options=oa.fold_compiler_options(),
        )
        .lower(p0, ours.init(p0), grads)
        .compile()
    )
    inits = {
        "fused": ours.init,
        "fused+noise_scale": noisy.init,
        "plain": ours.init,
        "MultiSteps": multi.init,
        "oa.MultiSteps(fused)": drop_in.init,
        "oa.MultiSteps(plain)": drop_in.init,
    }
    del p0

    variants: dict[str, _common.Timed] = {}
    variants["floor"], floor = _common.floor_add(params(), grads)
    # Reference for the closing step: one Adam step on the tree, no
    # accumulation. A closing step does this plus the accumulator pass.
    p = params()
    variants["Adam step alone"] = _Loop(
        compiled_adam, grads, adam.init(p), p, None
    ).timed()
    loops = {}
    for kind, comp in compiled.items():
        for phase, m in (("non-closing", 1), ("closing", K - 1)):
            p = params()
            loop = _Loop(comp, grads, _with_mini_step(inits[kind](p), m), p, m)
            loops[kind, phase] = loop
            variants[f"{kind} {phase}"] = loop.timed()
        p = params()
        loop = _Loop(comp, grads, inits[kind](p), p, None)
        loops[kind, "window"] = loop
        variants[f"{kind} window/{K}"] = loop.window()

    # Sanity: each loop does what its name says (one untimed call each).
    for (kind, phase), loop in loops.items():
        if phase == "window":
            continue
        before = jax.tree.map(lambda x: x.copy(), loop.params)
        variants[f"{kind} {phase}"].run_once()
        moved = any(
            bool(jnp.any(a != b))
            for a, b in zip(
                jax.tree.leaves(before),
                jax.tree.leaves(loop.params),
                strict=True,
            )
        )
        mini_step = (loop.mini_step + 1) % K
        if moved != (phase == "closing") or _mini_step(loop.state) != mini_step:
            raise RuntimeError(f"{kind} {phase}: step did not behave as named")
        del before

    seconds = _common.time_interleaved(
        variants, rounds=rounds, warmup=2, settle_s=0.0 if tiny else 0.05
    )
    per_call = {
        name: (t / K if name.endswith(f"window/{K}") else t)
        for name, t in seconds.items()
    }
    t_floor = per_call["floor"]
    ratios = {name: t / t_floor for name, t in per_call.items()}

    mem = {
        "floor": _common.memory_stats(floor),
        "Adam": _common.memory_stats(compiled_adam),
    }
    mem.update({k: _common.memory_stats(c) for k, c in compiled.items()})
    copies = {
        "floor": _tree_copies(floor, shapes),
        "Adam": _tree_copies(compiled_adam, shapes),
    }
    copies.update({k: _tree_copies(c, shapes) for k, c in compiled.items()})

    rows = []
    for name, t in per_call.items():
        m = mem[name.split()[0]]
        rows.append(
            [
                name,
                f"{1e3 * t:.2f}",
                f"{ratios[name]:.2f}x",
                _common.format_bytes(m["argument"]),
                _common.format_bytes(m["output"]),
                _common.format_bytes(m["alias"]),
                _common.format_bytes(m["temp"]),
                str(copies[name.split()[0]]),
            ]
        )
    headers = [
        "variant",
        "ms/call",
        "vs floor",
        "args",
        "out",
        "alias",
        "temp",
        "leaf copies in HLO",
    ]

    ms_open = per_call["MultiSteps non-closing"]
    speedups = {
        n: ms_open / t
        for n, t in per_call.items()
        if n.split()[0] in ("fused", "plain") and "window" not in n
    }
    targets = [
        _common.target(
            "fused non-closing <= 1.2x floor",
            ratios["fused non-closing"],
            ratios["fused non-closing"] <= 1.2,
        ),
        _common.target(
            "fused step: no tree-sized temporary "
            f"(temp < {_common.format_bytes(SCALARS)}: scalars)",
            _common.format_bytes(mem["fused"]["temp"]),
            mem["fused"]["temp"] < SCALARS,
        ),
        _common.target(
            "fused step compiled with oa.fold_compiler_options(): temp "
            "(reported)",
            _common.format_bytes(_common.memory_stats(with_options)["temp"]),
            True,
        ),
        _common.target(
            "fused+noise_scale non-closing <= 1.1x fused non-closing",
            per_call["fused+noise_scale non-closing"]
            / per_call["fused non-closing"],
            per_call["fused+noise_scale non-closing"]
            <= 1.1 * per_call["fused non-closing"],
        ),
        _common.target(
            "fused+noise_scale closing vs fused closing (reported)",
            per_call["fused+noise_scale closing"] / per_call["fused closing"],
            True,
        ),
        _common.target(
            "fused closing <= 4x floor",
            ratios["fused closing"],
            ratios["fused closing"] <= 4.0,
        ),
        _common.target(
            "plain non-closing <= 8x floor",
            ratios["plain non-closing"],
            ratios["plain non-closing"] <= 8.0,
        ),
        _common.target(
            "plain step temp <= one tree "
            f"({_common.format_bytes(tree_bytes)}) + scalars",
            _common.format_bytes(mem["plain"]["temp"]),
            mem["plain"]["temp"] < tree_bytes + SCALARS,
        ),
        _common.target(
            "every fused/plain step >= 2.5x faster than MultiSteps non-closing",
            ", ".join(f"{n} {v:.2f}x" for n, v in speedups.items()),
            min(speedups.values()) >= 2.5,
        ),
        _common.target(
            "oa.MultiSteps(fused) non-closing <= 1.2x floor",
            ratios["oa.MultiSteps(fused) non-closing"],
            ratios["oa.MultiSteps(fused) non-closing"] <= 1.2,
        ),
        _common.target(
            "oa.MultiSteps(fused): no tree-sized temporary",
            _common.format_bytes(mem["oa.MultiSteps(fused)"]["temp"]),
            mem["oa.MultiSteps(fused)"]["temp"] < SCALARS,
        ),
        _common.target(
            "oa.MultiSteps(plain) non-closing >= 1.5x faster than "
            "MultiSteps non-closing",
            ms_open / per_call["oa.MultiSteps(plain) non-closing"],
            ms_open / per_call["oa.MultiSteps(plain) non-closing"] >= 1.5,
        ),
    ]
    info = _pipeline.device_info()
    piped = _pipeline.measure(shapes, calls=5 if tiny else 10, rounds=3)
    piped_ratios = {
        n: v["seconds"] / piped["floor"]["seconds"] for n, v in piped.items()
    }
    return {
        "name": "B1",
        "title": (
            f"B1: micro-step cost, {n_params:,} float32 params, Adam, "
            f"k={K}, donated; median of {rounds} interleaved rounds; "
            f"{info['backend']} ({info['device_kind']})"
        ),
        "device": info,
        "pipelined": piped_ratios,
        "headers": headers,
        "rows": rows,
        "ratios": {f"B1 {n}": r for n, r in ratios.items() if n != "floor"},
        "ratio_label": "time / floor (tree add)",
        "targets": targets,
        "seconds": per_call,
        "memory": mem,
        "tree_copies": copies,
        "notes": [
            "Limit of the closing step: it is an Adam step plus the "
            "accumulator pass, so it cannot beat 'Adam step alone' + floor = "
            f"{ratios['Adam step alone'] + 1:.2f}x the floor; fused closing "
            f"measured {ratios['fused closing']:.2f}x "
            f"({ratios['fused closing'] / (ratios['Adam step alone'] + 1):.2f}"
            " of that limit).",
            "non-closing: mini_step 1 (mid-window); closing: mini_step "
            f"{K - 1}; window/{K}: {K} consecutive calls from mini_step 0, "
            "time per call.",
            "Steps take their donated arguments in the order of their "
            "outputs, `step(params, opt_state, grads) -> (params, "
            "opt_state)` with `donate_argnums=(0, 1)`: JAX pairs donated "
            "buffers with same-shaped outputs in order, and another order "
            "makes XLA copy every leaf on every call.",
            "On CPU a tree-sized temporary also costs page faults on every "
            "call (the allocator hands large buffers back to the system), "
            "which adds to the time of the steps that have one.",
            "Pipelined (calls back to back, each fed the previous outputs, "
            "one sync; non-closing: every_k = 2**30, closing: every_k = 1), "
            "vs its own floor: "
            + ", ".join(f"{n} {r:.2f}x" for n, r in piped_ratios.items())
            + ". The targets above judge the per-call figures (on CPU a "
            "call's time is its own work); on a GPU a per-call timing is "
            "launch latency: judge the pipelined figures there "
            "(`make bench-gpu`).",
        ],
    }


if __name__ == "__main__":
    _common.print_result(main(tiny="--tiny" in sys.argv[1:]))
