"""What XLA:GPU and XLA:TPU compile the gated steps and train steps to.

Without a GPU or TPU: the programs are compiled for an H100, an H200 (XLA's
target configs) and a TPU v5e chip by the jax CUDA plugin and libtpu
(``tests/gpu_compile/README.md``), and read (``tools/compiled/hlo.py``):

* per gated step: the ``conditional``\\ s left, where Adam's ``sqrt`` runs
  (only inside the branch, or on every call), and the same with the
  barriers off (the control: XLA:GPU then turns the gate into a select);
* per train step (gradients and update in one jit) and way of calling the
  optimizer: where each dense weight's accumulation runs (``gemm``: the
  epilogue of the GEMM that makes its gradient; ``split-k``: in the sum of
  a split-K GEMM's partials; ``merged``: sliced from a GEMM XLA shares
  between weights; ``loop``: a pass over the gradient of its own), for
  float32 and bfloat16 products;
* per train step and compiler setting (``targets.SETTINGS``: Triton or
  cuBLAS-LT GEMMs, with or without ``oa.fold_compiler_options()``), on the
  newest GPU this jaxlib reads: the GEMMs that take their accumulator,
  the weight-sized copies and passes of the non-closing path
  (``hlo.non_closing``) and the temporaries;
* the temporaries of the suite's memory premises (``memory_analysis()``).

It writes ``GPU_COMPILE.md`` next to this script (``--out``).

Run: ``python benchmarks/gpu_compile.py [--cache DIR] [--out FILE]
[--quick]`` (``make bench-gpu-compile``); ``--quick`` leaves out the
transformer and the H200.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.compiled import plugins  # noqa: E402

# Everything from this line on in an existing GPU_COMPILE.md was recorded by
# hand (other jaxlibs, other targets) and is kept.
HAND_MARKER = (
    "<!-- Recorded by hand below this line; gpu_compile.py keeps it. -->"
)


def _gated_rows(targets_, steps, hlo, barriers_off):
    rows = []
    size = 64 * 128  # the gated steps' weight: Adam's sqrt of its size
    for name, make in steps.GATED.items():
        row = [name]
        for target in targets_:
            cells = []
            for barriers in (True, False) if target != "tpu" else (True,):
                off = contextlib.nullcontext() if barriers else barriers_off()
                with off:
                    fn, args = make()
                    text = targets_[target](fn, args).as_text()
                w = hlo.placement(
                    hlo.Module.parse(text), steps.FOLLOWER_OPS, size
                )
                cells.append(
                    f"{w['conditionals']} ({w['inside']} in, "
                    f"{w['outside']} out)"
                )
            row.append(" / ".join(cells))
        rows.append(row)
    return rows


def _fold_rows(targets_, steps, hlo, models):
    rows = []
    for model in models:
        for api in steps.TRAIN:
            fn, args, counts, _ = steps.train_step(api, model)
            donate = (0,) if api in ("TrainState", "nnx Optimizer") else (0, 1)
            row = [model, api, str(len(counts))]
            for target in targets_:
                if target == "tpu":
                    continue
                text = targets_[target](fn, args, donate).as_text()
                where = hlo.fold(
                    hlo.Module.parse(text), hlo.is_kernel_accumulator
                )
                tally = collections.Counter(where.values())
                row.append(
                    ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
                )
            rows.append(row)
    return rows


# A bare accumulation of one weight's gradient (x: 256 x 512, dy: 256 x
# 768) into a float32 accumulator, donated.
BARE = {
    "float32: acc + x.T @ dy": "f32",
    "bfloat16 GEMM, output cast to float32": "bf16",
    "bfloat16 GEMM, float32 output (preferred_element_type)": "bf16->f32",
}


def _bare_step(form):
    import jax
    import jax.numpy as jnp

    def step(acc, x, dy):
        a = acc["acc"]["kernel"]
        if form.startswith("bf16"):
            x, dy = x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
        out = jnp.float32 if form == "bf16->f32" else None
        g = jax.lax.dot_general(
            x, dy, (((0,), (0,)), ((), ())), preferred_element_type=out
        ).astype(jnp.float32)
        return {"acc": {"kernel": a + g}}

    sds = jax.ShapeDtypeStruct
    args = (
        {"acc": {"kernel": sds((512, 768), jnp.float32)}},
        sds((256, 512), jnp.float32),
        sds((256, 768), jnp.float32),
    )
    return step, args


def _bare_rows(targets_, hlo):
    rows = []
    for label, form in BARE.items():
        step, args = _bare_step(form)
        row = [label]
        for target in targets_:
            if target == "tpu":
                continue
            text = targets_[target](step, args, (0,)).as_text()
            where = hlo.fold(hlo.Module.parse(text), hlo.is_kernel_accumulator)
            row.append(", ".join(where.values()))
        rows.append(row)
    return rows


# The train steps of the floor table: every step of ``steps.TRAIN`` (the
# micro-step is ``acc + g``), those of ``steps.TRAIN_OFF_FLOOR`` (a select
# or a multiply in front of the add), and the bfloat16 MLP's chain.
def _floor_configs(steps):
    out = [("mlp", api) for api in (*steps.TRAIN, *steps.TRAIN_OFF_FLOOR)]
    return [*out, ("mlp_bf16", "chain")]


def _floor_cell(compiled, hlo, steps, counts, shapes) -> str:
    module = hlo.Module.parse(compiled.as_text())
    where = hlo.fold(module, hlo.is_kernel_accumulator)
    path = hlo.non_closing(module, shapes, steps.FOLLOWER_OPS)
    mem = compiled.memory_analysis()
    temp = "n/a" if mem is None else f"{mem.temp_size_in_bytes:,}"
    gemm = sum(v == "gemm" for v in where.values())
    return (
        f"{gemm}/{len(counts)}; {path['copies']} copies, "
        f"{path['passes']} passes; {temp} B"
    )


def _floor_rows(device, steps, hlo, targets):
    rows = []
    for model, api in _floor_configs(steps):
        fn, args, counts, shapes = steps.train_step(api, model)
        donate = (0,) if api in ("TrainState", "nnx Optimizer") else (0, 1)
        row = [model, api]
        for setting in targets.SETTINGS:
            compiled = targets.compile_for(
                fn, args, device, donate, targets.options(setting)
            )
            row.append(_floor_cell(compiled, hlo, steps, counts, shapes))
        rows.append(row)
    return rows


def _memory_rows(targets_, steps):
    rows = []
    cases = [(n, True, False) for n in steps.PREMISE_CHAINS]
    cases += [("accumulate", True, True), ("headline", False, False)]
    for name, fused, weighted in cases:
        label = f"{'fused' if fused else 'plain'} {name}"
        label += " (traced weight)" if weighted else ""
        row = [label]
        for target in targets_:
            # XLA:TPU's past its VMEM (tools/compiled/steps.py).
            shape = steps.TPU_PREMISE_SHAPE if target == "tpu" else None
            fn, args = steps.premise_step(
                name, fused, weighted, shape or steps.PREMISE_SHAPE
            )
            mem = targets_[target](fn, args, (0, 1)).memory_analysis()
            row.append("n/a" if mem is None else f"{mem.temp_size_in_bytes:,}")
        rows.append(row)
    return rows


def _table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append("|" + "---|" * len(headers))
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def measure(quick: bool) -> str:
    import jax
    import jaxlib

    from tools.compiled import hlo, steps, targets

    devices = {"h100": targets.gpu_device("h100")}
    if not quick:
        with contextlib.suppress(Exception):  # jaxlib 0.10 lacks its fields
            devices["h200"] = targets.gpu_device("h200")
    devices["tpu"] = targets.tpu_device()
    compile_ = {
        t: (
            lambda fn, args, donate=(), d=d: targets.compile_for(
                fn, args, d, donate
            )
        )
        for t, d in devices.items()
    }
    cards = ", ".join(f"{t}: {d.device_kind}" for t, d in devices.items())
    start = time.perf_counter()
    gated = _gated_rows(compile_, steps, hlo, targets.barriers_off)
    models = (
        ["mlp", "mlp_bf16"] if quick else ["mlp", "transformer", "mlp_bf16"]
    )
    fold = _fold_rows(compile_, steps, hlo, models)
    memory = _memory_rows(compile_, steps)
    bare = _bare_rows(compile_, hlo)
    gpus = [t for t in devices if t != "tpu"]
    newest = devices[gpus[-1]]
    floor = _floor_rows(newest, steps, hlo, targets)
    out = [
        "# Compiled XLA:GPU and XLA:TPU programs (deviceless)",
        "",
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}; compiled on "
        f"a machine without GPU or TPU for {cards} "
        f"({time.perf_counter() - start:.0f} s). Written by "
        "`benchmarks/gpu_compile.py` (`make bench-gpu-compile`"
        + (
            ", `--quick`: the transformer and the H200 left out)."
            if quick
            else ")."
        ),
        "",
        "## Gated steps: conditionals kept, followers inside",
        "",
        "Per target: conditionals in the compiled program (Adam's weight-sized"
        " `sqrt`s inside its branches, on every call); on a GPU, then the "
        "same with the barriers off (the control).",
        "",
        _table(["step", *devices], gated),
        "",
        "## Train steps: where each dense weight's accumulation runs",
        "",
        "Gradients and `oa.apply_gradients` (or the wrapper's update) in one "
        "jit, adamw, k=4, no compiler options (Triton GEMMs; the next table "
        "has the other settings). `gemm`: the epilogue of the GEMM making the "
        "weight's gradient; `split-k`: in the sum of a split-K GEMM's "
        "partials; `merged`: sliced from one GEMM XLA shares between weights"
        " (the query, key and value projections); `loop`: a separate pass "
        "over the gradient. `mlp_bf16`: bfloat16 products, float32 weights "
        "and accumulator.",
        "",
        _table(["model", "api", "dense weights", *gpus], fold),
        "",
        "## One accumulation alone: float32 and bfloat16 products",
        "",
        "Where the accumulation of one weight's gradient into a float32 "
        "accumulator runs, by the form it is written in.",
        "",
        _table(["accumulation", *gpus], bare),
        "",
        "## The non-closing path, per compiler setting",
        "",
        f"Compiled for {targets.describe(newest)}, params and state "
        "donated, adamw, k=4; per setting of `tools/compiled/targets.py` "
        "(`triton`: XLA's Triton GEMMs, what a compile without a GPU picks; "
        "`cublas`: `xla_gpu_enable_triton_gemm=False`, cuBLAS-LT calls; "
        "`+options`: with `oa.fold_compiler_options()`): the GEMMs that take "
        "their weight's accumulator (the micro-step is their epilogue) of the"
        " dense weights; the weight-sized copies and passes outside the GEMMs"
        " on the non-closing path (`hlo.non_closing`), which every micro-step"
        " makes; the temporaries (`memory_analysis()`). The steps above "
        "`mean weighted` write the micro-step as `acc + g`; `mean weighted`, "
        "`skip_nonfinite` and `loss_scale` put a multiply or a select in "
        "front of the add (docs/gpu.md).",
        "",
        _table(["model", "api", *targets.SETTINGS], floor),
        "",
        "## Temporaries of the suite's memory premises (bytes)",
        "",
        f"256 x 256 float32 (a tree of {steps.TREE_BYTES:,} B; XLA:TPU's "
        f"4096 x 4096, {steps.tree_bytes(steps.TPU_PREMISE_SHAPE):,} B, past "
        "its VMEM), params and state donated; the premises: fused < 1/64 of "
        "the tree, the headline chain <= one tree + 6 KiB.",
        "",
        _table(["step", *devices], memory),
        "",
    ]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default=str(ROOT / "build" / "gpu-compile"))
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "GPU_COMPILE.md")
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("OPTAXACCUM_GPU_COMPILE") != "1":
        site = plugins.ensure_site(pathlib.Path(args.cache))
        if isinstance(site, str):
            print(plugins.SKIP, site)
            return 0
        cmd = [sys.executable, __file__, *(argv or sys.argv[1:])]
        return subprocess.call(cmd, env=plugins.environment(site))
    text = measure(args.quick)
    out = pathlib.Path(args.out)
    old = out.read_text() if out.exists() else ""
    kept = old[old.find(HAND_MARKER) :] if HAND_MARKER in old else HAND_MARKER
    out.write_text(text + "\n" + kept.rstrip("\n") + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
