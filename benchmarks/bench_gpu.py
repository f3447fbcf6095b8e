"""Gated steps on a GPU: is the gate still a branch, and what does a
micro-step cost in device time?

For each step of ``_pipeline.steps()`` (fused and plain, non-closing and
closing, the noise scale, the README chain with the loss scale,
``oa.MultiSteps``, and ``optax.MultiSteps`` and Adam alone for reference)
on 8 float32 leaves of 4096 x 4096 (512 MiB per tree), params and state
donated, this prints

* the number of ``conditional`` instructions in the *compiled* HLO (XLA:GPU's
  ``simplify-conditional`` pass turns a conditional of cheap elementwise
  branches into a ``select`` that runs both: the optimizer would then run on
  every micro-step);
* the pipelined time per call (30 calls back to back, fed their own
  outputs, one sync) as ratios to the floor (a donated tree add), to Adam
  alone and to ``optax.MultiSteps``;
* the targets of the GPU (H100/H200 class);
* the end-to-end micro-step (``_e2e.py``) at 512 and 4096 rows: the
  gradient alone, with a donated ``acc + g`` (the floor), the non-closing
  ``oa.apply_gradients`` unweighted and summed-gradient weighted, and the
  closing call, as ratios to the gradient alone, with which backend each
  GEMM got (cuBLAS custom call or Triton fusion) and how many take their
  accumulator.

It exits 1 when a gated step lost its conditional, 0 otherwise (timing
targets are reported, not enforced: a shared or throttled card misses
them without a bug). Without a GPU it says so and exits 0; ``--cpu`` (or
``--tiny``) runs the same code on the default backend at a small size (the
smoke test of the suite; its timings mean nothing).

Run: ``python benchmarks/bench_gpu.py [--cpu] [--json out.json]``
(``make bench-gpu``).
"""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _e2e  # noqa: E402
import _pipeline  # noqa: E402
import jax  # noqa: E402

FULL_SHAPES = {f"w{i}": (4096, 4096) for i in range(8)}  # 512 MiB per tree
TINY_SHAPES = {"w0": (64, 128), "w1": (32, 32), "b": (128,)}
# The end-to-end micro-step: (width, layers, rows of each micro-batch).
FULL_E2E = [(4096, 8, 512), (4096, 8, 4096)]
TINY_E2E = [(32, 2, 8)]


def _targets(r: dict[str, float]) -> list[tuple[str, float, bool]]:
    fused = [n for n in r if "fused" in n and n in r]
    ms = r["optax.MultiSteps non-closing"]
    return [
        (
            "fused non-closing <= 1.15x floor",
            r["fused non-closing"],
            r["fused non-closing"] <= 1.15,
        ),
        (
            "fused closing <= 1.1x (Adam alone + floor)",
            r["fused closing"] / (r["Adam step alone"] + 1.0),
            r["fused closing"] <= 1.1 * (r["Adam step alone"] + 1.0),
        ),
        (
            "every fused step >= 2.5x faster than optax.MultiSteps "
            "non-closing (the slowest fused step's factor)",
            min(ms / r[n] for n in fused),
            min(ms / r[n] for n in fused) >= 2.5,
        ),
        (
            "fused+noise_scale non-closing <= 1.1x fused non-closing",
            r["fused+noise_scale non-closing"] / r["fused non-closing"],
            r["fused+noise_scale non-closing"] <= 1.1 * r["fused non-closing"],
        ),
    ]


def main(cpu: bool = False, calls: int | None = None) -> dict:
    """Measures and prints; returns ``{"rows": ..., "lost": [...], ...}``."""
    info = _pipeline.device_info()
    shapes = TINY_SHAPES if cpu else FULL_SHAPES
    calls = calls or (5 if cpu else 30)
    res = _pipeline.measure(shapes, calls=calls, rounds=3)
    floor = res["floor"]["seconds"]
    adam = res["Adam step alone"]["seconds"]
    ms = res["optax.MultiSteps non-closing"]["seconds"]
    ratios = {n: v["seconds"] / floor for n, v in res.items()}
    mib = sum(4 * math.prod(s) for s in shapes.values()) / 2**20
    print(
        f"bench-gpu: {info['backend']} ({info['device_kind']}), "
        f"{len(shapes)} float32 leaves, {mib:.1f} MiB per tree, Adam; "
        f"pipelined: {calls} calls back to back, one sync"
    )
    print(
        "| step | conditionals | ms/call | vs floor | vs Adam alone "
        "| optax.MultiSteps / step | temp |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, v in res.items():
        s = v["seconds"]
        print(
            f"| {name}{' (gated)' if v['gated'] else ''} "
            f"| {v['conditionals']} | {1e3 * s:.3f} | {s / floor:.2f}x "
            f"| {s / adam:.2f}x | {ms / s:.2f}x | {v['temp']} B |"
        )
    lost = [n for n, v in res.items() if v["gated"] and not v["conditionals"]]
    targets = _targets(ratios)
    print("\n| target (pipelined) | measured | met |\n|---|---|---|")
    for what, value, met in targets:
        print(f"| {what} | {value:.2f}x | {'yes' if met else 'NO'} |")
    if lost:
        print(f"\nFAIL: the gate lost its conditional in: {', '.join(lost)}")
    else:
        print("\nEvery gated step keeps its conditional in the compiled HLO.")
    e2e = [_print_e2e(*size, calls) for size in (TINY_E2E if cpu else FULL_E2E)]
    return {
        "device": info,
        "shapes": {k: list(v) for k, v in shapes.items()},
        "calls": calls,
        "rows": res,
        "ratios": ratios,
        "targets": [
            {"target": t, "measured": v, "met": m} for t, v, m in targets
        ],
        "lost": lost,
        "end_to_end": e2e,
    }


def _print_e2e(width: int, layers: int, rows: int, calls: int) -> dict:
    """Measures and prints the end-to-end micro-step (``_e2e.py``)."""
    res = _e2e.measure(width, layers, rows, calls=calls)
    alone = res["gradient alone"]["seconds"]
    floor = res["gradient + donated add"]["seconds"]
    print(
        f"\nEnd to end: gradient + accumulation in one jit, {layers} tanh "
        f"layers {width} wide (float32), micro-batch {rows} rows; "
        "oa.fold_compiler_options(), weights and state donated"
    )
    keys = [k for k in res["oa non-closing"] if k != "seconds"]
    print(
        "| step | ms/call | vs gradient alone | vs gradient + donated add | "
        + " | ".join(keys)
        + " |"
    )
    print("|---" * (4 + len(keys)) + "|")
    for name, v in res.items():
        s = v["seconds"]
        counts = " | ".join(str(v.get(k, "")) for k in keys)
        print(
            f"| {name} | {1e3 * s:.3f} | {s / alone:.2f}x | {s / floor:.2f}x "
            f"| {counts} |"
        )
    for name in ("oa non-closing", "oa non-closing, summed weighted"):
        r = res[name]["seconds"] / alone
        print(
            f"| target: {name} <= 1.10x gradient alone | {r:.2f}x "
            f"| {'yes' if r <= 1.10 else 'NO'} |"
        )
    return {"width": width, "layers": layers, "rows": rows, "rows_out": res}


def _cli(argv: list[str]) -> int:
    cpu = "--cpu" in argv or "--tiny" in argv
    if not cpu and jax.default_backend() != "gpu":
        print(
            f"bench-gpu: no GPU here (JAX's default backend is "
            f"{jax.default_backend()!r}); nothing measured. Run it on a "
            "machine with a GPU, or with --cpu for a small run of the same "
            "code on this backend."
        )
        return 0
    res = main(cpu=cpu)
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["lost"] else 0


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
