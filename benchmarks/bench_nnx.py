"""B1-nnx: the micro-step cost of ``flax.nnx`` optimizers under accumulation.

The B1 measurement (``bench_step.py``) for ``flax.nnx`` users: an
``nnx.Module`` holding a ~16.8M-parameter float32 tree, Adam, a window of 4,
each step an ``nnx.jit`` with the model and the optimizer donated,
``step(model, opt, grads)`` calling ``opt.update(model, grads)``. Side by
side in one run:

* ``floor``: a jitted tree add ``acc + g`` with ``acc`` donated, the least a
  non-closing micro-step can cost;
* ``oa nnx.Optimizer``: ``optaxaccum.flax.nnx.Optimizer(model,
  oa.chain(oa.accumulate(4), adam))``, the fused path;
* ``nnx.Optimizer + oa.chain``: flax's stock ``nnx.Optimizer`` with the same
  chain (the plain ``update`` + ``apply_updates`` protocol);
* ``nnx.Optimizer(MultiSteps)``: the stock optimizer holding
  ``optax.MultiSteps(adam, 4)``;
* ``nnx.jit no-op``: an ``nnx.jit`` step on the same model and optimizer
  that computes nothing, the overhead every nnx step pays.

Each optimizer is timed on a non-closing micro-step (``mini_step`` 1) and a
closing one (``mini_step`` 3), in its own loop, its state's ``mini_step``
reset before each timed call, outside the timing. The timed call includes
``nnx.jit``'s own Python overhead (what a user pays). Figures are medians of
interleaved rounds, as ratios to the floor; temp bytes come from the
compiled step's ``memory_analysis()``.

Run: ``python benchmarks/bench_nnx.py [--tiny]``.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
import _pipeline  # noqa: E402

import optaxaccum as oa  # noqa: E402
from optaxaccum.flax import nnx as oa_nnx  # noqa: E402

K = 4
LEARNING_RATE = 1e-3
# The memory figures come from the lowered step compiled as a user's
# nnx.jit compiles it: with no compiler option.
_OPTIONS = None
# 4 x 1024 x 4096 = 16,777,216 float32 parameters (64 MiB per tree): half of
# B1's tree, so that three models with their Adam states fit a shared host.
FULL_SHAPES = {f"w{i}": (1024, 4096) for i in range(4)}
TINY_SHAPES = {"w0": (64, 128), "w1": (32, 32), "b": (128,)}


class Weights(nnx.Module):
    """A bag of ``nnx.Param`` leaves: the tree the optimizers update."""

    def __init__(self, shapes, seed):
        keys = jax.random.split(jax.random.key(seed), len(shapes))
        for key, (name, shape) in zip(keys, sorted(shapes.items())):
            value = 0.01 * jax.random.normal(key, shape, jnp.float32)
            setattr(self, name, nnx.Param(value))


def _update(model, opt, grads):
    # ``grads`` arrive as plain arrays (not an nnx graph argument, so that
    # nnx.jit does not return, i.e. copy, them): make them Params again,
    # as nnx.grad would give them.
    opt.update(model, jax.tree.map(nnx.Param, grads))
    return opt.step[...]  # an output of the same executable: wait on it


def _noop(model, opt, grads):
    del model, grads
    return opt.step[...]


def _accumulate_state(opt):
    """The optimizer's ``AccumulateState``/``MultiStepsState`` (Variables)."""
    state = opt.opt_state
    return state if hasattr(state, "mini_step") else state[0]


def _loop(step, model, opt, grads, mini_step):
    """A timed call of ``step`` from the given ``mini_step``."""

    def prepare():
        _accumulate_state(opt).mini_step[...] = jnp.int32(mini_step)
        return model, opt, grads

    return _common.Timed(step, prepare)


def _scalar_temp(shapes, make) -> int:
    """Temporary bytes of the step on leaves of one element each."""
    ones = {name: (1,) for name in shapes}
    model = Weights(ones, 0)
    grads = nnx.as_pure(nnx.state(Weights(ones, 1), nnx.Param))
    step = nnx.jit(_update, donate_argnums=(0, 1))
    compiled = step.lower(model, make(model), grads).compile(_OPTIONS)
    return compiled.memory_analysis().temp_size_in_bytes


def _pipelined(shapes, grads, calls: int) -> dict[str, float]:
    """Seconds per call of ``calls`` non-closing steps back to back (nnx.jit
    writes each call's outputs into the model and optimizer that the next
    call reads), one sync: device throughput, the figure a GPU is judged
    by (a per-call timing there measures launch latency)."""
    adam = optax.adam(LEARNING_RATE)
    never = _pipeline.NEVER
    makers = {
        "oa nnx.Optimizer": lambda m: oa_nnx.Optimizer(
            m, oa.chain(oa.accumulate(never), adam)
        ),
        "nnx.Optimizer(MultiSteps)": lambda m: nnx.Optimizer(
            m, optax.MultiSteps(adam, never), wrt=nnx.Param
        ),
    }
    _, floor = _common.floor_add(jax.tree.map(jnp.copy, grads), grads)
    out = {
        "floor": _pipeline.pipelined(
            floor,
            (jax.tree.map(jnp.copy, grads), grads),
            lambda o, a: (o, a[1]),
            calls=calls,
            rounds=3,
        )
    }
    for name, make in makers.items():
        model = Weights(shapes, 0)
        opt = make(model)
        step = nnx.jit(_update, donate_argnums=(0, 1))
        jax.block_until_ready(step(model, opt, grads))  # compile, warm up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                last = step(model, opt, grads)
            jax.block_until_ready(last)
            times.append((time.perf_counter() - start) / calls)
        out[name] = statistics.median(times)
    return out


def main(tiny: bool = False, rounds: int | None = None) -> dict:
    """Runs B1-nnx; returns the results (see ``run_all.py`` for the format)."""
    shapes = TINY_SHAPES if tiny else FULL_SHAPES
    if rounds is None:
        rounds = 3 if tiny else 15
    n_params = sum(math.prod(s) for s in shapes.values())
    tree_bytes = 4 * n_params
    adam = optax.adam(LEARNING_RATE)
    makers = {
        "oa nnx.Optimizer": lambda m: oa_nnx.Optimizer(
            m, oa.chain(oa.accumulate(K), adam)
        ),
        "nnx.Optimizer + oa.chain": lambda m: nnx.Optimizer(
            m, oa.chain(oa.accumulate(K), adam), wrt=nnx.Param
        ),
        "nnx.Optimizer(MultiSteps)": lambda m: nnx.Optimizer(
            m, optax.MultiSteps(adam, K), wrt=nnx.Param
        ),
    }
    grads = nnx.as_pure(nnx.state(Weights(shapes, 1), nnx.Param))
    floor, floor_c = _common.floor_add(jax.tree.map(jnp.copy, grads), grads)
    variants = {"floor": floor}
    mem = {"floor": _common.memory_stats(floor_c)}
    noop_model = None
    for name, make in makers.items():
        model = Weights(shapes, 0)
        opt = make(model)
        step = nnx.jit(_update, donate_argnums=(0, 1))
        mem[name] = _common.memory_stats(
            step.lower(model, opt, grads).compile(_OPTIONS)
        )
        for phase, m in (("non-closing", 1), ("closing", K - 1)):
            # One model per optimizer: the phases share it (each call
            # leaves mini_step at m + 1; prepare puts it back).
            variants[f"{name} {phase}"] = _loop(step, model, opt, grads, m)
        if noop_model is None:
            noop_model, noop_opt = model, opt
    # What nnx.jit costs on the same model and optimizer doing nothing: the
    # overhead of the call itself (graph traversal, buffers in and out).
    noop = nnx.jit(_noop, donate_argnums=(0, 1))
    mem["nnx.jit no-op"] = _common.memory_stats(
        noop.lower(noop_model, noop_opt, grads).compile(_OPTIONS)
    )
    variants["nnx.jit no-op"] = _loop(noop, noop_model, noop_opt, grads, 1)
    seconds = _common.time_interleaved(
        variants, rounds=rounds, warmup=2, settle_s=0.0 if tiny else 0.05
    )
    ratios = {n: t / seconds["floor"] for n, t in seconds.items()}
    rows = []
    for name, t in seconds.items():
        m = mem[name if name in mem else name.rsplit(" ", 1)[0]]
        rows.append(
            [
                name,
                f"{1e3 * t:.2f}",
                f"{ratios[name]:.2f}x",
                _common.format_bytes(m["alias"]),
                _common.format_bytes(m["temp"]),
            ]
        )
    ours = "oa nnx.Optimizer non-closing"
    speedups = {
        other: ratios[f"{other} non-closing"] / ratios[ours]
        for other in ("nnx.Optimizer + oa.chain", "nnx.Optimizer(MultiSteps)")
    }
    overhead = ratios["nnx.jit no-op"]
    # The step's scalars (flags, counters) on this backend: its temporaries
    # on leaves of one element each. A leaf-sized temporary would add at
    # least the smallest leaf to them (XLA:GPU keeps a few more scalars
    # than XLA:CPU, so a fixed byte count would not do).
    scalars = _scalar_temp(shapes, makers["oa nnx.Optimizer"])
    bound = scalars + 4 * min(math.prod(s) for s in shapes.values())
    targets = [
        _common.target(
            "oa nnx.Optimizer non-closing <= 1.2x (floor + nnx.jit no-op "
            f"= {1 + overhead:.2f}x)",
            ratios[ours],
            ratios[ours] <= 1.2 * (1 + overhead),
        ),
        _common.target(
            "oa nnx.Optimizer step: no tree-sized temporary (temp < "
            f"{_common.format_bytes(bound)}: its "
            f"{_common.format_bytes(scalars)} on one-element leaves + the "
            "smallest leaf)",
            _common.format_bytes(mem["oa nnx.Optimizer"]["temp"]),
            mem["oa nnx.Optimizer"]["temp"] < bound,
        ),
        _common.target(
            "stock nnx.Optimizer + oa.chain builds the zero-update tree "
            f"(temp >= {_common.format_bytes(tree_bytes)})",
            _common.format_bytes(mem["nnx.Optimizer + oa.chain"]["temp"]),
            mem["nnx.Optimizer + oa.chain"]["temp"] >= tree_bytes,
        ),
        _common.target(
            "non-closing: oa nnx.Optimizer >= 2x faster than both stock",
            ", ".join(f"{n} {v:.2f}x" for n, v in speedups.items()),
            min(speedups.values()) >= 2.0,
        ),
    ]
    info = _pipeline.device_info()
    piped = _pipelined(shapes, grads, calls=5 if tiny else 10)
    piped_ratios = {n: t / piped["floor"] for n, t in piped.items()}
    return {
        "name": "B1-nnx",
        "title": (
            f"B1-nnx: flax.nnx micro-step cost, {n_params:,} float32 params, "
            f"Adam, k={K}, nnx.jit donated; median of {rounds} interleaved "
            f"rounds; {info['backend']} ({info['device_kind']})"
        ),
        "device": info,
        "pipelined": piped_ratios,
        "headers": ["variant", "ms/call", "vs floor", "alias", "temp"],
        "rows": rows,
        "ratios": {f"B1-nnx {n}": r for n, r in ratios.items() if n != "floor"},
        "ratio_label": "time / floor (tree add)",
        "targets": targets,
        "seconds": seconds,
        "memory": mem,
        "notes": [
            "nnx.jit no-op: `nnx.jit(donate_argnums=(0, 1))` of a step that "
            "only reads `opt.step`, on the oa nnx.Optimizer's model and "
            "state: the cost of the nnx.jit call itself, which every nnx "
            "variant pays on top of its computation.",
            "Each nnx step is `nnx.jit(step, donate_argnums=(0, 1))` on "
            "`step(model, opt, grads)`. The gradients come in as plain "
            "arrays and are wrapped in `nnx.Param` inside the step: nnx.jit "
            "returns the state of every graph argument, so a `grads` State "
            "passed in from outside would be copied out on every call (a "
            "params-sized copy that a real step, computing its gradients "
            "inside the jit, does not make). The time includes nnx.jit's "
            "Python overhead, which the floor (`jax.jit` on a dict) does "
            "not pay.",
            "non-closing: mini_step 1; closing: mini_step 3, reset before "
            "each timed call outside the timing.",
            "Pipelined, non-closing (every_k = 2**30; calls back to back, "
            "one sync), vs its own floor: "
            + ", ".join(f"{n} {r:.2f}x" for n, r in piped_ratios.items())
            + ". The targets judge the per-call figures (on CPU a call's "
            "time is its own work); on a GPU read the pipelined ones.",
        ],
    }


if __name__ == "__main__":
    _common.print_result(main(tiny="--tiny" in sys.argv[1:]))
