"""B5-limits: why compile time and memory on many leaves have a floor.

B5 (``bench_compile.py``) compares our chain with optax's on trees of N
leaves. This script measures the two things that bound what any accumulating
step can reach there, each compile in a fresh process:

* **XLA's conversion of the lowered step is quadratic in its outputs.**
  ``jax.jit(f).lower(...).compiler_ir("hlo")`` (StableHLO to an HLO module,
  which ``.compile()`` does first) is timed, with the growth of the process's
  peak RSS, for a function of one small input and ``m`` outputs, and for one
  of ``m`` inputs and one output. A step's outputs are its params and its
  optimizer state: 3N for ``adam`` (params, mu, nu), 4N once an
  accumulator is added, whatever the library.
* **Flattening does not pay on this backend.** At N leaves it compiles
  one step of ``oa.chain(oa.accumulate(4), adam)`` written by hand with the
  accumulator kept per leaf (what ``oa.accumulate`` does) and the same step
  with a single flat accumulator buffer updated leaf by leaf
  (``dynamic_update_slice``); and the README chain with the inner
  ``optax.adam`` against ``optax.flatten(optax.adam)``.

Run: ``python benchmarks/compile_limits.py [--quick]`` (``--quick``: toy
sizes for the smoke test). ``make bench`` runs it as part of B5.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

K = 4
OUTPUTS = (5_000, 10_000, 20_000)
QUICK_OUTPUTS = (200, 400)
FLAT_N = 1000
QUICK_FLAT_N = 16


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def conversion(m: int, side: str) -> dict:
    """Seconds and peak-RSS growth of StableHLO -> HLO for ``m`` outputs
    (``side="out"``: one input) or ``m`` inputs (``side="in"``: one output)."""
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((3,), jnp.float32)
    if side == "out":
        fn, args = (lambda x: [x * float(i) for i in range(m)]), (x,)
    else:
        fn, args = (lambda xs: sum(xs[1:], xs[0])), ([x] * m,)
    lowered = jax.jit(fn).trace(*args).lower()
    before = _peak_mib()
    start = time.perf_counter()
    lowered.compiler_ir("hlo")
    return {
        "seconds": time.perf_counter() - start,
        "rss_growth_mib": _peak_mib() - before,
    }


def _hand_step(n: int, flat: bool):
    """``oa.chain(oa.accumulate(K), adam)``'s fused step, by hand, its
    abstract arguments and ``init(params) -> state``; the accumulator per
    leaf or one flat buffer."""
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
    adam = optax.adam(1e-3)

    def add(acc, grads):
        if not flat:
            return jax.tree.map(jnp.add, acc, grads)
        for i, g in enumerate(jax.tree.leaves(grads)):
            seg = lax.dynamic_slice(acc, (offsets[i],), (sizes[i],))
            acc = lax.dynamic_update_slice(
                acc, seg + g.reshape(-1), (offsets[i],)
            )
        return acc

    def mean(acc):
        if not flat:
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

        return lax.cond(
            count == K, close, lambda: (params, (acc, count, inner))
        )

    def init(params):
        acc = jnp.zeros(offsets[-1]) if flat else optax.tree.zeros_like(params)
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
        oa.dynamic_loss_scale(),
        oa.agc(bench_compile.CLIP),
        oa.accumulate(K),
        inner,
    )
    shapes = jax.eval_shape(lambda: bench_compile.make_tree(n))
    state = jax.eval_shape(tx.init, shapes)
    return bench_compile.make_step(tx, "fused"), (shapes, state, shapes)


STEPS = {
    "accumulator per leaf (by hand)": lambda n: _hand_step(n, flat=False),
    "flat accumulator (by hand)": lambda n: _hand_step(n, flat=True),
    "README fused, optax.flatten(adam)": _flatten_readme,
}


def compile_step(name: str, n: int) -> dict:
    """CPU seconds, peak RSS and HLO counts of one compile of ``name``."""
    import bench_compile
    import jax

    if name in STEPS:
        step, args = STEPS[name](n)[:2]
        jitted = jax.jit(step, donate_argnums=(0, 1))
        start = time.process_time()
        compiled = jitted.trace(*args).lower().compile()
        return {
            "total_cpu_s": time.process_time() - start,
            "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            **bench_compile.hlo_counts(compiled.as_text()),
        }
    return bench_compile.compile_once(name, n)


def _subprocess(*worker_args: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", *worker_args]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip()[-300:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _worker(args: list[str]) -> dict:
    if args[0] == "conversion":
        return conversion(int(args[1]), args[2])
    return compile_step(args[1], int(args[2]))


def _quadratic_rows(outputs) -> tuple[list[list[str]], list[dict]]:
    rows, fits = [], []
    for m in outputs:
        for side in ("out", "in"):
            res = _subprocess("conversion", str(m), side)
            if "error" in res:
                rows.append([f"{m} {side}puts", res["error"], "-", "-", "-"])
                continue
            per = res["rss_growth_mib"] * 2**20 / m**2
            rows.append(
                [
                    f"conversion, {m} {side}puts",
                    f"{res['seconds']:.2f}",
                    "-",
                    f"{res['rss_growth_mib']:.0f}",
                    f"{per:.2f}" if side == "out" else "-",
                ]
            )
            fits.append({"m": m, "side": side, **res})
    return rows, fits


def _compile_rows(n: int) -> tuple[list[list[str]], dict]:
    pairs = (
        ("accumulator per leaf (by hand)", "flat accumulator (by hand)"),
        ("README fused", "README fused, optax.flatten(adam)"),
    )
    rows, raw = [], {}
    for pair in pairs:
        base = None
        for name in pair:
            res = _subprocess("compile", name, str(n))
            raw[name] = res
            if "error" in res:
                rows.append([name, res["error"], "-", "-", "-"])
                continue
            base = base or res["total_cpu_s"]
            rows.append(
                [
                    name,
                    f"{res['total_cpu_s']:.1f}",
                    f"{res['total_cpu_s'] / base:.2f}x",
                    f"{res['peak_rss_kib'] / 1024:.0f}",
                    str(res["fusions"]),
                ]
            )
    return rows, raw


def main(tiny: bool = False) -> dict:
    """Runs both measurements; returns the result dict of ``run_all.py``."""
    import _common

    outputs = QUICK_OUTPUTS if tiny else OUTPUTS
    n = QUICK_FLAT_N if tiny else FLAT_N
    conv_rows, fits = _quadratic_rows(outputs)
    comp_rows, raw = _compile_rows(n)
    outs = [f for f in fits if f["side"] == "out"]
    lo, hi = outs[0], outs[-1]
    growth = hi["rss_growth_mib"] / max(lo["rss_growth_mib"], 1e-9)
    expected = (hi["m"] / lo["m"]) ** 2
    flat = raw.get("flat accumulator (by hand)", {})
    tree = raw.get("accumulator per leaf (by hand)", {})
    flat_ratio = flat.get("total_cpu_s", float("nan")) / tree.get(
        "total_cpu_s", float("nan")
    )
    return {
        "name": "B5-limits",
        "title": "B5-limits: XLA's conversion cost per output, and "
        f"flattened accumulators at N={n}",
        "headers": [
            "case",
            "seconds",
            "vs first of pair",
            "RSS MiB",
            "bytes per output^2, or fusions",
        ],
        "rows": conv_rows + comp_rows,
        "targets": [
            _common.target(
                f"conversion memory grows as outputs^2 ({lo['m']} -> "
                f"{hi['m']} outputs: x{expected:.0f} expected)",
                growth,
                growth >= 0.5 * expected,
            ),
            _common.target(
                "flat accumulator compiles slower than one per leaf",
                flat_ratio,
                flat_ratio > 1,
            ),
        ],
        "ratios": {"B5-limits flat / per-leaf accumulator": flat_ratio},
        "ratio_label": "compile CPU s / per-leaf accumulator",
        "notes": [
            "Conversion rows: wall seconds of StableHLO -> HLO "
            "(`compiler_ir('hlo')`) of a function with m outputs and one "
            "input, or m inputs and one output; RSS MiB is the growth of "
            "the peak RSS, also given in bytes per output^2.",
            "Compile rows: CPU seconds of trace + lower + compile, the "
            "ratio to the first of each pair, the process's peak RSS and "
            "the optimized HLO's fusions.",
        ],
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(_worker(sys.argv[2:])))
        sys.exit(0)
    import _common

    _common.print_result(main(tiny="--quick" in sys.argv[1:]))
