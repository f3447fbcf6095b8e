"""Gather once, hidden: what the scheduled program overlaps, compiled for 8
H200s and 8 TPU v5e chips without the hardware (README.md in this folder).

The step of examples/fsdp.py's model (``steps.fsdp_step``: three held
leaves, k = 4 on data=2 x fsdp=4). Read with ``optaxaccum._src.hlo``:
for every weight-sized collective, sync or async, whether a GEMM or a loop
is scheduled between its start and its done. Held, the first and last
micro-batch run outside the scan: at most the first layer's gather and
the last reduce-scatter are left exposed (nothing to hide under), at least
half the step's weight-sized collective bytes are overlapped, and none
runs inside the scan's loop. The per-micro-batch path is the control: its
reduce-scatters run inside the loop.
"""

from __future__ import annotations

import functools
import os

import pytest

if os.environ.get("OPTAXACCUM_GPU_COMPILE") != "1":
    pytest.skip(
        "compiled-program checks: run `make test-gpu-compile`",
        allow_module_level=True,
    )

import jax  # noqa: E402
import jaxlib  # noqa: E402

from optaxaccum._src import hlo  # noqa: E402
from tests.gpu_compile import steps, targets  # noqa: E402

pytestmark = pytest.mark.gpu_compile


def _devices(target):
    try:
        if target == "tpu":
            return targets.tpu_devices8()
        return targets.gpu_devices8(target)
    except Exception as err:
        pytest.skip(f"jaxlib {jaxlib.__version__}: no {target} x 8: {err}")


@functools.cache
def _exposure(target, hold, options=True, hidden=128, rows=steps.FSDP_ROWS):
    fn, args, mesh = steps.fsdp_step(_devices(target), hold, hidden, rows)
    opts = steps.GPU_OVERLAP_OPTIONS if options and target != "tpu" else {}
    try:
        with jax.set_mesh(mesh):
            compiled = jax.jit(fn, compiler_options=opts).lower(*args)
            text = compiled.compile().as_text()
    except jax.errors.JaxRuntimeError as err:  # an option this XLA lacks
        pytest.skip(f"jaxlib {jaxlib.__version__}: {err}")
    rows = hlo.overlaps(text)
    return hlo.exposure(rows, steps.fsdp_held_bytes()), rows


def test_gather_once_hidden_h200():
    got, rows = _exposure("h200", True)
    assert got["collectives"] == 6, rows  # one gather, one scatter per leaf
    assert got["in_loop"] == 0, rows
    assert got["exposed"] <= 2, rows
    assert got["overlapped"] >= 0.5, rows


def test_per_micro_batch_control_h200():
    """The check can fail: the per-micro-batch path reduce-scatters each
    weight inside the loop (k times per step)."""
    got, rows = _exposure("h200", False)
    assert got["in_loop"] >= 1, rows


def test_gather_once_tpu_v5e_nothing_in_the_loop():
    """XLA:TPU (libtpu): no weight-sized collective inside the loop; the
    exposure figures are reported in benchmarks/GPU_COMPILE.md."""
    got, rows = _exposure("tpu", True)
    assert got["in_loop"] == 0, rows


def test_gather_once_tpu_v5e_one_gather_per_held_weight_at_scale():
    """A wider model (64 -> 8192 -> 10, 1024 rows per micro-batch): XLA:TPU
    runs one all-gather per held weight per step, not one per peeled
    micro-batch and one for the loop (it repeats the gather of a held copy
    into each of its users unless the copy is pinned)."""
    _, rows = _exposure("tpu", True, hidden=8192, rows=1024)
    weights = [r for r in rows if r["bytes"] >= 64 * 1024]
    gathers = [r for r in weights if r["op"] == "all-gather"]
    assert len(gathers) == 2 and not any(r["loop"] for r in weights), rows
