"""B5: compile time and compile memory on trees of thousands of leaves.

Real models are trees of hundreds to thousands of parameter leaves (an
unscanned 48-layer transformer has ~800). On trees of ``N`` small float32
leaves of mixed shapes (``N`` = 100, 1 000, 3 000; 10 000 with ``--large``)
this compiles one jitted optimizer step, params and optimizer state donated,
for each of

* ``adam``: plain ``optax.adam`` (no gate, no clipping);
* ``optax agc+adam``: ``optax.chain(optax.adaptive_grad_clip(0.01), adam)``,
  ungated: the reference of the goals;
* ``MultiSteps``: ``optax.MultiSteps`` of that chain, ``every_k_schedule=4``;
* ``README fused``: the README's chain, ``oa.chain(oa.accumulate(4),
  oa.dynamic_loss_scale(), oa.agc(0.01), adam)`` (the loss scale checked
  once per window), stepped with ``oa.apply_gradients``;
* ``README plain``: the same chain, ``tx.update`` + ``optax.apply_updates``;
* ``scale per micro-batch fused``: ``oa.chain(oa.dynamic_loss_scale(),
  oa.agc(0.01), oa.accumulate(4), adam)`` (each micro-batch checked), fused;
* ``accumulate fused``: ``oa.chain(oa.accumulate(4), adam)``, fused.

Each compile runs in a fresh subprocess (so that one compile's memory and
caches do not leak into the next): it traces (``jax.jit(...).trace``), lowers
(``.lower()``) and compiles (``.compile()``) the step on abstract arguments
(``jax.ShapeDtypeStruct``, nothing allocated), timing each stage, and reports
the process's own peak resident memory (``VmHWM``; see ``_common.rss_kib``)
and the optimized HLO's op, fusion and conditional counts. The
configurations of one ``N`` run one after the other, in a fresh random order
each round, and are reported as ratios to ``optax agc+adam`` of the same
round (a burst of outside load hits a round's configurations alike); with
several rounds, each figure is the median. Peak RSS includes the ~0.3 GiB
that importing JAX costs.

It also times the compiled step per call at the largest ``N`` of the run
(3 000 tiny leaves: per-leaf overhead dominates): the non-closing fused step
of ``accumulate fused`` and ``README fused`` against a jitted tree add
``acc + g`` with ``acc`` donated, as B1 does.

Run: ``python benchmarks/bench_compile.py [--quick] [--large] [--rounds R]``
(``--quick``: N = 8, 24 for the smoke test; the figures mean nothing).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

K = 4
LEARNING_RATE = 1e-3
CLIP = 0.01
SIZES = (100, 1000, 3000)
LARGE = 10_000
QUICK_SIZES = (8, 24)
REFERENCE = "optax agc+adam"
CONFIGS = (
    "adam",
    "optax agc+adam",
    "MultiSteps",
    "README fused",
    "README plain",
    "scale per micro-batch fused",
    "accumulate fused",
)
# Mixed small shapes, cycled: kernels, biases, scalars, 3-D and 4-D leaves.
SHAPES = ((2, 3), (4,), (3, 2, 2), (), (2, 2, 2, 3), (5, 4), (1,), (3, 1))


def leaf_shapes(n: int) -> dict[str, tuple[int, ...]]:
    """``n`` leaf names and shapes (zero-padded names keep the order)."""
    width = len(str(n))
    return {f"p{i:0{width}d}": SHAPES[i % len(SHAPES)] for i in range(n)}


def make_tree(n: int, seed: int = 0):
    """A dict of ``n`` float32 leaves of mixed shapes, seeded values."""
    import jax
    import jax.numpy as jnp

    shapes = leaf_shapes(n)
    keys = jax.random.split(jax.random.key(seed), n)
    return {
        name: jax.random.normal(k, shape, jnp.float32)
        for k, (name, shape) in zip(keys, shapes.items(), strict=True)
    }


def make_tx(config: str):
    """The transformation and the step kind (fused or plain) of ``config``."""
    import optax

    import optaxaccum as oa

    adam = optax.adam(LEARNING_RATE)
    agc_adam = optax.chain(optax.adaptive_grad_clip(CLIP), adam)
    readme = oa.chain(
        oa.accumulate(K), oa.dynamic_loss_scale(), oa.agc(CLIP), adam
    )
    per_micro_batch = oa.chain(
        oa.dynamic_loss_scale(), oa.agc(CLIP), oa.accumulate(K), adam
    )
    return {
        "adam": (adam, "plain"),
        "optax agc+adam": (agc_adam, "plain"),
        "MultiSteps": (optax.MultiSteps(agc_adam, K), "plain"),
        "README fused": (readme, "fused"),
        "README plain": (readme, "plain"),
        "scale per micro-batch fused": (per_micro_batch, "fused"),
        "accumulate fused": (oa.chain(oa.accumulate(K), adam), "fused"),
    }[config]


def make_step(tx, kind: str):
    """``step(params, opt_state, grads) -> (params, opt_state)``.

    The donated arguments come first, in the order of the outputs (see B1).
    """
    import optax

    import optaxaccum as oa

    if kind == "fused":

        def step(params, opt_state, grads):
            return oa.apply_gradients(tx, grads, opt_state, params)

    else:

        def step(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

    return step


def hlo_counts(text: str) -> dict[str, int]:
    """Instructions, fusions and conditionals of optimized HLO text (read
    with the reader of the compiled-program checks, tools/compiled/hlo.py)."""
    if os.path.dirname(HERE) not in sys.path:
        sys.path.insert(0, os.path.dirname(HERE))
    from tools.compiled import hlo

    module = hlo.Module.parse(text)
    opcodes = [i.opcode for body in module.computations.values() for i in body]

    def count(op: str) -> int:
        return sum(o in (op, f"{op}-start") for o in opcodes)

    # The fused step's loop of 0 or 1 trips is a branch like a conditional.
    loops = sum(
        i.is_gate_loop for body in module.computations.values() for i in body
    )
    return {
        "ops": len(opcodes),
        "fusions": count("fusion"),
        "conditionals": count("conditional") + loops,
    }


def compile_once(config: str, n: int) -> dict:
    """Traces, lowers and compiles ``config``'s step on ``n`` leaves, in this
    process; returns the stage seconds, peak RSS and HLO counts."""
    import jax

    shapes = jax.eval_shape(lambda: make_tree(n))
    tx, kind = make_tx(config)
    opt_state = jax.eval_shape(tx.init, shapes)
    import _common

    rss_before = _common.rss_kib()["peak"]
    jitted = jax.jit(make_step(tx, kind), donate_argnums=(0, 1))
    c0, t0 = time.process_time(), time.perf_counter()
    traced = jitted.trace(shapes, opt_state, shapes)
    c1, t1 = time.process_time(), time.perf_counter()
    lowered = traced.lower()
    c2, t2 = time.process_time(), time.perf_counter()
    compiled = lowered.compile()
    c3, t3 = time.process_time(), time.perf_counter()
    rss = _common.rss_kib()["peak"]
    return {
        "config": config,
        "n": n,
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "total_s": t3 - t0,
        "trace_cpu_s": c1 - c0,
        "lower_cpu_s": c2 - c1,
        "compile_cpu_s": c3 - c2,
        "total_cpu_s": c3 - c0,
        "rss_before_kib": rss_before,
        "peak_rss_kib": rss,
        **hlo_counts(compiled.as_text()),
    }


def compile_in_subprocess(config: str, n: int, timeout: float | None) -> dict:
    """:func:`compile_once` in a fresh Python process."""
    import _common

    res = _common.run_worker(__file__, [config, str(n)], timeout)
    return {"config": config, "n": n, **res} if "error" in res else res


def _median(xs):
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def measure_compiles(sizes, configs, rounds, timeout=None) -> dict:
    """``{(config, n): [result per round]}``, configs shuffled per round."""
    rng = random.Random(0)
    results: dict = {}
    for n in sizes:
        for _ in range(rounds):
            for config in rng.sample(list(configs), len(configs)):
                res = compile_in_subprocess(config, n, timeout)
                results.setdefault((config, n), []).append(res)
                print(
                    f"  B5 N={n} {config}: "
                    + (
                        res.get("error")
                        or f"{res['total_s']:.2f} s, "
                        f"{res['peak_rss_kib'] / 1024:.0f} MiB"
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    return results


def _ratios(
    runs: dict, config: str, n: int, key: str = "total_cpu_s"
) -> float | None:
    """Median over rounds of ``key`` of config / of REFERENCE, same round."""
    mine, ref = runs.get((config, n), []), runs.get((REFERENCE, n), [])
    pairs = [
        a[key] / b[key]
        for a, b in zip(mine, ref, strict=False)
        if "error" not in a and "error" not in b
    ]
    return _median(pairs) if pairs else None


def time_per_call(n: int, rounds: int) -> dict[str, float]:
    """Seconds per call of the non-closing fused steps and the tree add."""
    import _common
    import jax
    from bench_step import _Loop

    grads = make_tree(n, 1)
    floor, _ = _common.floor_add(make_tree(n, 0), grads)
    variants = {"tree add (floor)": floor}
    for config in ("accumulate fused", "README fused"):
        tx, kind = make_tx(config)
        params = make_tree(n, 0)
        step = jax.jit(make_step(tx, kind), donate_argnums=(0, 1))
        loop = _Loop(step, grads, tx.init(params), params, 1)
        loop.prepare()  # mini_step 1: mid-window, the accumulator is read
        variants[f"{config} non-closing"] = loop.timed()
        # The same arguments and outputs, no work: what passing 5 trees of
        # buffers in and 4 out costs by itself.
        noop = jax.jit(lambda p, s, g: (p, s), donate_argnums=(0, 1))
        params = make_tree(n, 0)
        variants[f"{config} identity step"] = _Loop(
            noop, grads, tx.init(params), params, None
        ).timed()
    return _common.time_interleaved(variants, rounds=rounds, warmup=2)


ROW_KEYS = (
    "trace_cpu_s",
    "lower_cpu_s",
    "compile_cpu_s",
    "total_cpu_s",
    "total_s",
)


def _row(runs, config, n):
    ok = [r for r in runs.get((config, n), []) if "error" not in r]
    if not ok:
        err = runs.get((config, n), [{}])[0].get("error", "not run")
        return [str(n), config, err] + ["-"] * (len(HEADERS) - 3)
    med = {key: _median([r[key] for r in ok]) for key in ROW_KEYS}
    cpu_ratio = _ratios(runs, config, n)
    wall_ratio = _ratios(runs, config, n, "total_s")
    last = ok[-1]
    return [
        str(n),
        config,
        *(f"{med[key]:.2f}" for key in ROW_KEYS[:4]),
        "-" if cpu_ratio is None else f"{cpu_ratio:.2f}x",
        f"{med['total_s']:.2f}",
        "-" if wall_ratio is None else f"{wall_ratio:.2f}x",
        f"{_median([r['peak_rss_kib'] for r in ok]) / 1024:.0f}",
        str(last["ops"]),
        str(last["fusions"]),
        str(last["conditionals"]),
    ]


HEADERS = [
    "N",
    "configuration",
    "trace CPU s",
    "lower CPU s",
    "compile CPU s",
    "total CPU s",
    f"vs {REFERENCE} (CPU)",
    "total wall s",
    "vs (wall)",
    "peak RSS MiB",
    "HLO ops",
    "fusions",
    "conditionals",
]


def _targets(runs, sizes, large, seconds):
    def total(config, n):
        ok = [
            r["total_cpu_s"]
            for r in runs.get((config, n), [])
            if "error" not in r
        ]
        return _median(ok) if ok else float("inf")

    targets = []
    big = [n for n in sizes if n >= 1000] or [max(sizes)]
    for config, bound in (("README fused", 1.3), ("README plain", 1.6)):
        vals = [_ratios(runs, config, n) or float("inf") for n in big]
        targets.append(
            _common_target(
                f"{config} compile <= {bound}x {REFERENCE} at N="
                + ", ".join(map(str, big)),
                ", ".join(f"{v:.2f}x" for v in vals),
                all(v <= bound for v in vals),
            )
        )
    below = {
        n: total("README fused", n) / total("MultiSteps", n) for n in sizes
    }
    targets.append(
        _common_target(
            "README fused compile < MultiSteps at every N",
            ", ".join(f"{v:.2f}x" for v in below.values()),
            all(v < 1 for v in below.values()),
        )
    )
    if len(sizes) >= 2:  # growth needs two sizes
        lo, hi = (1000, 3000) if {1000, 3000} <= set(sizes) else sizes[-2:]
        growth = total("README fused", hi) / total("README fused", lo)
        bound = 3.3 * hi / lo / 3
        targets.append(
            _common_target(
                f"README fused time({hi}) / time({lo}) <= {bound:.1f}",
                growth,
                growth <= bound,
            )
        )
    if large:
        res = [
            r for r in runs.get(("README fused", LARGE), []) if "error" not in r
        ]
        targets.append(
            _common_target(
                f"README fused compiles at N={LARGE} (peak RSS)",
                f"{res[0]['peak_rss_kib'] / 1024**2:.2f} GiB"
                if res
                else "failed",
                bool(res),
            )
        )
    floor = seconds["tree add (floor)"]
    for config in ("accumulate fused", "README fused"):
        t = seconds[f"{config} non-closing"]
        ident = seconds.get(f"{config} identity step")
        shown = f"{t / floor:.2f}x" + (
            f" ({t / ident:.2f}x the identity step)" if ident else ""
        )
        targets.append(
            _common_target(
                f"{config} non-closing per call <= 1.5x tree add "
                f"(N={max(sizes)})",
                shown,
                t / floor <= 1.5,
            )
        )
    return targets


def _common_target(what, value, met):
    import _common

    return _common.target(what, value, met)


def main(
    tiny: bool = False,
    large: bool = False,
    rounds: int | None = None,
    timeout: float | None = None,
    sizes: tuple[int, ...] | None = None,
    from_json: str | None = None,
    configs: tuple[str, ...] = CONFIGS,
) -> dict:
    """Runs B5; returns the results (see ``run_all.py`` for the format).

    ``from_json`` re-renders a run saved with ``--json`` instead of running.
    """
    if from_json:
        with open(from_json) as f:
            saved = json.load(f)
        runs = {
            (k.rsplit(" N=", 1)[0], int(k.rsplit(" N=", 1)[1])): v
            for k, v in saved["runs"].items()
        }
        seconds = saved["seconds"]
        all_sizes = tuple(sorted({n for _, n in runs}))
        large = LARGE in all_sizes
        sizes = tuple(n for n in all_sizes if n != LARGE)
        rounds = max(len(v) for v in runs.values())
    else:
        sizes = sizes or (QUICK_SIZES if tiny else SIZES)
        rounds = rounds or 1
        runs = measure_compiles(sizes, configs, rounds, timeout)
        large = large and not tiny
        if large:
            runs.update(
                measure_compiles(
                    (LARGE,), ("optax agc+adam", "README fused"), 1, timeout
                )
            )
        all_sizes = sizes + ((LARGE,) if large else ())
        seconds = time_per_call(max(sizes), rounds=5 if tiny else 30)
    rows = [
        _row(runs, c, n) for n in all_sizes for c in CONFIGS if (c, n) in runs
    ]
    floor = seconds["tree add (floor)"]
    rows += [
        [
            str(max(sizes)),
            f"run: {name}",
            "-",
            "-",
            "-",
            "-",
            "-",
            f"{1e3 * t:.3f} ms/call",
            f"{t / floor:.2f}x floor",
        ]
        + ["-"] * (len(HEADERS) - 9)
        for name, t in seconds.items()
    ]
    headers = HEADERS
    big = max(sizes)
    ratios = {
        f"B5 {c} N={big}": _ratios(runs, c, big)
        for c in CONFIGS
        if c != REFERENCE
    }
    return {
        "name": "B5",
        "title": (
            f"B5: compile time of one step on N small leaves, "
            f"{rounds} round(s), each compile in a fresh process"
        ),
        "headers": headers,
        "rows": rows,
        "targets": _targets(runs, sizes, large, seconds),
        "ratios": {k: v for k, v in ratios.items() if v is not None},
        "ratio_label": f"compile time / {REFERENCE}",
        "runs": {f"{c} N={n}": v for (c, n), v in runs.items()},
        "seconds": seconds,
        "notes": [
            "CPU s: process CPU time (all threads) of each stage; total = "
            "trace + lower + compile; median over rounds. vs "
            f"{REFERENCE}: median of the per-round ratios. The targets use "
            "the CPU-time ratios: on a shared machine a process's wall time "
            "depends on how much of a core it got at that moment (a load "
            "of 8 on 2 cores made wall ratios swing by 2x between "
            "configurations of one round), its CPU time much less. Peak "
            "RSS of the compiling process (JAX's import included).",
            f"Leaves cycle through the shapes {list(SHAPES)}, float32.",
            "run: non-closing fused step (mini_step 1) and a jitted tree add "
            "(donated), median of interleaved rounds.",
        ],
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--worker"]:
        print(json.dumps(compile_once(args[1], int(args[2]))))
        sys.exit(0)
    import argparse

    import _common

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes")
    parser.add_argument("--large", action="store_true", help=f"also N={LARGE}")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", default=None, help="write raw runs here")
    parser.add_argument(
        "--from-json", default=None, help="re-render a saved --json run"
    )
    parser.add_argument(
        "--configs", default=None, help="comma-separated subset of CONFIGS"
    )
    parser.add_argument("--sizes", default=None, help="e.g. 100,1000")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds allowed to one compile",
    )
    ns = parser.parse_args(args)
    sizes = tuple(map(int, ns.sizes.split(","))) if ns.sizes else None
    res = main(
        from_json=ns.from_json,
        configs=tuple(ns.configs.split(",")) if ns.configs else CONFIGS,
        tiny=ns.quick,
        large=ns.large,
        rounds=ns.rounds,
        timeout=ns.timeout,
        sizes=sizes,
    )
    _common.print_result(res)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(
                {"runs": res["runs"], "seconds": res["seconds"]}, f, indent=1
            )
