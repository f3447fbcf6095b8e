"""Gather once: the held copy's pin, in the program XLA:TPU compiles for 8
TPU v5e chips without the hardware (README.md in this folder).

``GatherOnce`` pins each held copy (``lax.optimization_barrier`` after its
gather, ``optaxaccum/_src/gather_once.py``): XLA:TPU otherwise repeats the
gather into each user of the copy (the peeled first and last micro-batch
and the scan), so a held weight is gathered more than once per step.
XLA:CPU keeps one gather either way (the default suite can see only the
barrier in the lowered program, ``tests/test_gather_once.py``).

The step of examples/fsdp.py's model at a width where XLA:TPU repeats the
gathers (``steps.fsdp_step``: 64 -> 8192 -> 10, 1024 rows per micro-batch,
k = 4 on data=2 x fsdp=4). Read as logical collectives (``hlo.overlaps``
counts an all-gather XLA:TPU splits over the fusions of its async
collective fusion once), libtpu 0.0.42.1 gathers each held weight once
with the pin and without it; the default suite's check of the pin is the
traced program's barrier (``tests/test_gather_once.py``).
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
from tools.compiled import steps, targets  # noqa: E402

pytestmark = pytest.mark.gpu_compile

HIDDEN, ROWS = 8192, 1024
# The held weights of at least 64 KiB: w1 (64 x 8192) and w2 (8192 x 10).
WEIGHT_BYTES = 64 * 1024
HELD_WEIGHTS = 2


@functools.cache
def _tpu_devices():
    try:
        return tuple(targets.tpu_devices8())
    except Exception as err:
        pytest.skip(f"jaxlib {jaxlib.__version__}: no TPU v5e x 8: {err}")


def _weight_gathers() -> list[dict]:
    """The weight-sized all-gathers (sync or async) of the held step
    compiled for XLA:TPU, with where each runs."""
    fn, args, mesh = steps.fsdp_step(_tpu_devices(), True, HIDDEN, ROWS)
    with jax.set_mesh(mesh):
        text = jax.jit(fn).lower(*args).compile().as_text()
    rows = hlo.overlaps(text)
    return [
        r
        for r in rows
        if r["op"] == "all-gather" and r["bytes"] >= WEIGHT_BYTES
    ]


def test_tpu_v5e_gathers_each_held_weight_once_per_step():
    """One all-gather per held weight per step, none inside the loop."""
    gathers = _weight_gathers()
    assert len(gathers) == HELD_WEIGHTS, gathers
    assert not any(r["loop"] for r in gathers), gathers
