"""B5-limits: why compile time and memory on many leaves have a floor.

B5 (``bench_compile.py``) compares our chain with optax's on trees of N
leaves. This script measures what bounds any accumulating step there, each
case in a fresh process:

* **The conversion of a lowered step to HLO takes memory quadratic in the
  step's outputs.** ``jax.jit(f).trace(...).lower().compiler_ir("hlo")``
  (StableHLO to an HLO module) is timed, with the growth of the process's
  resident memory, for a function of one small input and ``m`` outputs,
  for one of ``m`` inputs and one output, and for B5's real steps at 3 000
  leaves. A step's outputs are its params and its optimizer state: 3 per
  leaf for ``adam`` (params, mu, nu), 4 once an accumulator is added,
  whatever the library.
* **Flat accumulators compile slower on this backend.** At N leaves it
  compiles a simplified fused step of ``oa.chain(oa.accumulate(4), adam)``
  written by hand (no weights, no step count) three ways: the accumulator
  one buffer per leaf (as ``oa.accumulate`` keeps it), one flat buffer
  updated leaf by leaf (``dynamic_update_slice``), and one flat buffer
  added to the concatenated gradients; and the README chain with the inner
  ``optax.adam`` against ``optax.flatten(optax.adam)``.

Run: ``python benchmarks/compile_limits.py [--quick]`` (``--quick``: toy
sizes for the smoke test). ``make bench`` runs it after B5.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

K = 4
OUTPUTS = (5_000, 10_000, 20_000)
QUICK_OUTPUTS = (200, 400)
FLAT_N = 1000
QUICK_FLAT_N = 16
# B5's real steps, converted alone.
STEP_CONFIGS = ("adam", "optax agc+adam", "accumulate fused", "README fused")
STEP_N = 3000
QUICK_STEP_N = 16
TIMEOUT_S = 1800
HAND = ("per leaf", "flat, leaf by leaf", "flat, concatenated")
PAIRS = (
    tuple(f"accumulator {h} (by hand)" for h in HAND),
    ("README fused", "README fused, optax.flatten(adam)"),
)


def _converted(lowered) -> dict:
    """Seconds and resident-memory growth (MiB) of converting ``lowered``
    to HLO: the peak during the conversion less the memory before it."""
    import _common

    _common.reset_peak_rss()
    before = _common.rss_kib()["rss"]
    start = time.perf_counter()
    lowered.compiler_ir("hlo")
    return {
        "seconds": time.perf_counter() - start,
        "rss_growth_mib": (_common.rss_kib()["peak"] - before) / 1024,
    }


def conversion(m: int, side: str) -> dict:
    """:func:`_converted` for ``m`` outputs (``side="out"``: one input) or
    ``m`` inputs (``side="in"``: one output)."""
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((3,), jnp.float32)
    if side == "out":
        fn, args = (lambda x: [x * float(i) for i in range(m)]), (x,)
    else:
        fn, args = (lambda xs: sum(xs[1:], xs[0])), ([x] * m,)
    return _converted(jax.jit(fn).trace(*args).lower())


def step_conversion(config: str, n: int) -> dict:
    """:func:`_converted` for B5's step of ``config`` on ``n`` leaves, with
    the step's number of outputs."""
    import bench_compile
    import jax

    shapes = jax.eval_shape(lambda: bench_compile.make_tree(n))
    tx, kind = bench_compile.make_tx(config)
    state = jax.eval_shape(tx.init, shapes)
    step = bench_compile.make_step(tx, kind)
    out = jax.eval_shape(step, shapes, state, shapes)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    lowered = jitted.trace(shapes, state, shapes).lower()
    return {"outputs": len(jax.tree.leaves(out)), **_converted(lowered)}


def hand_step(n: int, how: str):
    """A simplified fused step of ``oa.chain(oa.accumulate(K), adam)``, by
    hand, with its accumulator kept as ``how`` (one of :data:`HAND`).

    Returns ``(step, abstract_args, init)``: ``step(params, state, grads)
    -> (params, state)``, its arguments as ``ShapeDtypeStruct`` for ``n``
    leaves of B5's shapes, and ``init(params) -> state``.
    """
    import bench_compile
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax

    shapes = jax.eval_shape(lambda: bench_compile.make_tree(n))
    leaves, treedef = jax.tree.flatten(shapes)
    sizes = [int(np.prod(leaf.shape)) for leaf in leaves]
    offsets = np.cumsum([0, *sizes]).tolist()
    adam = optax.adam(bench_compile.LEARNING_RATE)

    def add(acc, grads):
        flat = [g.reshape(-1) for g in jax.tree.leaves(grads)]
        if how == "per leaf":
            return jax.tree.map(jnp.add, acc, grads)
        if how == "flat, concatenated":
            return acc + jnp.concatenate(flat)
        for i, g in enumerate(flat):
            seg = lax.dynamic_slice(acc, (offsets[i],), (sizes[i],))
            acc = lax.dynamic_update_slice(acc, seg + g, (offsets[i],))
        return acc

    def mean(acc):
        if how == "per leaf":
            return jax.tree.map(lambda a: a / K, acc)
        parts = [
            acc[offsets[i] : offsets[i + 1]].reshape(leaf.shape) / K
            for i, leaf in enumerate(leaves)
        ]
        return treedef.unflatten(parts)

    def step(params, state, grads):
        acc, count, inner = state
        acc, count = add(acc, grads), count + 1

        def close():
            updates, new_inner = adam.update(mean(acc), inner, params)
            zeros = jax.tree.map(jnp.zeros_like, acc)
            new_params = optax.apply_updates(params, updates)
            return new_params, (zeros, jnp.zeros_like(count), new_inner)

        keep = lambda: (params, (acc, count, inner))  # noqa: E731
        return lax.cond(count == K, close, keep)

    def init(params):
        acc = (
            optax.tree.zeros_like(params)
            if how == "per leaf"
            else jnp.zeros(offsets[-1], jnp.float32)
        )
        return acc, jnp.zeros((), jnp.int32), adam.init(params)

    return step, (shapes, jax.eval_shape(init, shapes), shapes), init


def _flatten_readme(n: int):
    """The README chain fused, its inner ``adam`` inside ``optax.flatten``."""
    import bench_compile
    import jax
    import optax

    import optaxaccum as oa

    inner = optax.flatten(optax.adam(bench_compile.LEARNING_RATE))
    tx = oa.chain(
        oa.accumulate(K),
        oa.dynamic_loss_scale(),
        oa.agc(bench_compile.CLIP),
        inner,
    )
    shapes = jax.eval_shape(lambda: bench_compile.make_tree(n))
    state = jax.eval_shape(tx.init, shapes)
    return bench_compile.make_step(tx, "fused"), (shapes, state, shapes)


def compile_step(name: str, n: int) -> dict:
    """CPU seconds, peak RSS and HLO counts of one compile of ``name`` (a
    hand step, the flattened README chain or a B5 configuration)."""
    import _common
    import bench_compile
    import jax

    if name not in PAIRS[0] and name != PAIRS[1][1]:
        return bench_compile.compile_once(name, n)
    if name in PAIRS[0]:
        step, args, _ = hand_step(n, HAND[PAIRS[0].index(name)])
    else:
        step, args = _flatten_readme(n)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    start = time.process_time()
    compiled = jitted.trace(*args).lower().compile()
    return {
        "total_cpu_s": time.process_time() - start,
        "peak_rss_kib": _common.rss_kib()["peak"],
        **bench_compile.hlo_counts(compiled.as_text()),
    }


def _subprocess(*worker_args: str) -> dict:
    """This script's ``--worker`` in a fresh process: its JSON result, or
    ``{"error": ...}``."""
    import _common

    return _common.run_worker(__file__, worker_args, TIMEOUT_S)


def _worker(args: list[str]) -> dict:
    """Dispatches ``--worker KIND ...`` to its measurement."""
    if args[0] == "conversion":
        return conversion(int(args[1]), args[2])
    if args[0] == "step_conversion":
        return step_conversion(args[1], int(args[2]))
    return compile_step(args[1], int(args[2]))


def _conversion_rows(raw: dict) -> list[list[str]]:
    """Table rows of the conversion measurements in ``raw``."""
    rows = []
    for label, res in raw.items():
        if "error" in res:
            rows.append([label, res["error"], "-", "-", "-"])
            continue
        outputs = res.get("outputs") or (
            int(label.split()[1]) if label.endswith("outputs") else None
        )
        per = (
            f"{res['rss_growth_mib'] * 2**20 / outputs**2:.2f}"
            if outputs
            else "-"
        )
        growth = f"{res['rss_growth_mib']:.0f}"
        rows.append([label, f"{res['seconds']:.2f}", "-", growth, per])
    return rows


def _compile_rows(raw: dict) -> list[list[str]]:
    """Table rows of the compiles in ``raw``, each pair against its first."""
    rows = []
    for pair in PAIRS:
        base = raw[pair[0]].get("total_cpu_s")
        for name in pair:
            res = raw[name]
            if "error" in res:
                rows.append([name, res["error"], "-", "-", "-"])
                continue
            ratio = f"{res['total_cpu_s'] / base:.2f}x" if base else "-"
            rows.append(
                [
                    name,
                    f"{res['total_cpu_s']:.1f}",
                    ratio,
                    f"{res['peak_rss_kib'] / 1024:.0f}",
                    str(res["fusions"]),
                ]
            )
    return rows


def measure(tiny: bool = False) -> dict[str, dict]:
    """Every measurement, each in its own process: ``{label: result}``."""
    raw = {}
    for m in QUICK_OUTPUTS if tiny else OUTPUTS:
        for side in ("out", "in"):
            label = f"conversion, {m} {side}puts"
            raw[label] = _subprocess("conversion", str(m), side)
    n = QUICK_STEP_N if tiny else STEP_N
    for config in STEP_CONFIGS:
        label = f"conversion, {config} step, N={n}"
        raw[label] = _subprocess("step_conversion", config, str(n))
    n = QUICK_FLAT_N if tiny else FLAT_N
    for name in (name for pair in PAIRS for name in pair):
        raw[name] = _subprocess("compile", name, str(n))
    return raw


def _growth(raw: dict, m: int, side: str) -> float:
    return raw.get(f"conversion, {m} {side}puts", {}).get(
        "rss_growth_mib", math.nan
    )


def _targets(raw: dict, tiny: bool) -> list[dict]:
    """Outputs cost quadratically, inputs little; flat accumulators cost
    more than one per leaf."""
    import _common

    sizes = QUICK_OUTPUTS if tiny else OUTPUTS
    lo, hi = sizes[0], sizes[-1]
    g_lo, g_hi = _growth(raw, lo, "out"), _growth(raw, hi, "out")
    expected = (hi / lo) ** 2
    growth = g_hi / g_lo if g_lo >= 20 else math.nan  # below: noise
    inputs = _growth(raw, hi, "in") / g_hi
    per_leaf = raw[PAIRS[0][0]].get("total_cpu_s", math.nan)
    flat = min(raw[n].get("total_cpu_s", math.nan) for n in PAIRS[0][1:])
    return [
        _common.target(
            f"conversion memory ~ outputs^2 ({lo} -> {hi} outputs: "
            f"x{expected:.0f}, at least x{expected / 2:.0f})",
            growth,
            growth >= expected / 2,
        ),
        _common.target(
            f"{hi} inputs cost < 1/4 of {hi} outputs", inputs, inputs < 0.25
        ),
        _common.target(
            "the faster flat accumulator compiles > 1.1x the per-leaf one",
            flat / per_leaf,
            flat / per_leaf > 1.1,
        ),
    ]


def main(tiny: bool = False) -> dict:
    """Runs every measurement; returns the result dict of ``run_all.py``
    (``raw``: each measurement's result)."""
    raw = measure(tiny)
    per_leaf = raw[PAIRS[0][0]].get("total_cpu_s", math.nan)
    ratios = {
        f"B5-limits {name}": raw[name].get("total_cpu_s", math.nan) / per_leaf
        for name in PAIRS[0][1:]
    }
    n = QUICK_FLAT_N if tiny else FLAT_N
    return {
        "name": "B5-limits",
        "title": "B5-limits: conversion memory against outputs, and flat "
        f"accumulators at N={n}",
        "headers": [
            "case",
            "seconds",
            "vs first of pair",
            "RSS MiB",
            "bytes per output^2, or fusions",
        ],
        "rows": _conversion_rows(
            {k: v for k, v in raw.items() if k.startswith("conversion")}
        )
        + _compile_rows(raw),
        "targets": _targets(raw, tiny),
        "ratios": {k: v for k, v in ratios.items() if math.isfinite(v)},
        "ratio_label": "compile CPU s / accumulator per leaf",
        "raw": raw,
        "notes": [
            "Conversion rows: wall seconds of StableHLO -> HLO "
            "(`compiler_ir('hlo')`) and the growth of resident memory "
            "during it (peak less the memory before), also per output^2.",
            "Compile rows: CPU seconds of trace + lower + compile, the "
            "ratio to the first of each pair, the process's peak RSS and "
            "the optimized HLO's fusions. The hand-written steps are "
            "simplified (no weights, no step count), alike in all three.",
        ],
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(_worker(sys.argv[2:])))
        sys.exit(0)
    import _common

    _common.print_result(main(tiny="--quick" in sys.argv[1:]))
