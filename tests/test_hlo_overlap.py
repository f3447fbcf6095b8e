"""The scheduled-program reader (``optaxaccum._src.hlo.overlaps``): which
collectives have compute (a GEMM or a loop) scheduled between their start
and their done. A synthetic module, and real compiled programs saved in
tests/fixtures/hlo (XLA:GPU for 8 H200s, XLA:TPU for 8 v5e chips; how
they were made: tests/fixtures/hlo/make.py)."""

import pathlib

import jax
import jax.numpy as jnp
import pytest

import optaxaccum as oa
from optaxaccum._src import hlo

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hlo"
WEIGHT = 2048 * 2048 * 2  # bytes of one gathered bfloat16 weight

_TEXT = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%gemm_computation (x: f32[8,64], w: f32[64,128]) -> f32[8,128] {
  %x = f32[8,64]{1,0} parameter(0)
  %w = f32[64,128]{1,0} parameter(1)
  ROOT %d = f32[8,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%wrapped_rs (g: f32[64,128]) -> f32[16,128] {
  %g = f32[64,128]{1,0} parameter(0)
  ROOT %rs = f32[16,128]{1,0} reduce-scatter(%g), dimensions={0}, to_apply=%add
}

%body (p: (s32[], f32[16,128])) -> (s32[], f32[16,128]) {
  %p = (s32[], f32[16,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[16,128]{1,0} get-tuple-element(%p), index=1
  %ag = f32[64,128]{1,0} all-gather(%v), dimensions={0}
  %sl = f32[16,128]{1,0} slice(%ag), slice={[0:16], [0:128]}
  ROOT %t = (s32[], f32[16,128]{1,0}) tuple(%i, %sl)
}

%cond (p: (s32[], f32[16,128])) -> pred[] {
  %p = (s32[], f32[16,128]{1,0}) parameter(0)
  ROOT %c = pred[] constant(false)
}

ENTRY %main (w1: f32[16,128], w2: f32[16,128], x: f32[8,64]) -> f32[16,128] {
  %w1 = f32[16,128]{1,0} parameter(0)
  %w2 = f32[16,128]{1,0} parameter(1)
  %x = f32[8,64]{1,0} parameter(2)
  %ag1 = f32[64,128]{1,0} all-gather(%w1), dimensions={0}
  %ags = (f32[16,128]{1,0}, f32[64,128]{1,0}) all-gather-start(%w2), dimensions={0}
  %mm = f32[8,128]{1,0} fusion(%x, %ag1), kind=kCustom, calls=%gemm_computation
  %agd = f32[64,128]{1,0} all-gather-done(%ags)
  %rss = ((f32[64,128]{1,0}), f32[16,128]{1,0}) async-start(%agd), calls=%wrapped_rs
  %rsd = f32[16,128]{1,0} async-done(%rss)
  %t0 = (s32[], f32[16,128]{1,0}) tuple(%c0, %rsd)
  %ws = (f32[16,128]{1,0}, f32[64,128]{1,0}) all-gather-start(%w1), dimensions={0}
  %loop = (s32[], f32[16,128]{1,0}) while(%t0), condition=%cond, body=%body
  %wd = f32[64,128]{1,0} all-gather-done(%ws)
  ROOT %out = f32[16,128]{1,0} get-tuple-element(%loop), index=1
}
"""


def _rows():
    return {
        (r["op"], r["loop"], r["sync"], r["compute"], r["bytes"])
        for r in hlo.overlaps(_TEXT)
    }


def test_overlaps_sees_sync_async_wrapped_and_loop_collectives():
    full = 4 * 64 * 128
    assert _rows() == {
        ("all-gather", False, True, 0, full),  # sync: exposed
        ("all-gather", False, False, 1, full),  # a GEMM fusion in flight
        ("reduce-scatter", False, False, 0, full),  # async, nothing between
        ("all-gather", False, False, 1, full),  # a loop in flight
        ("all-gather", True, True, 0, full),  # inside the loop's body
    }


def test_exposure_counts_and_overlapped_share():
    rows = hlo.overlaps(_TEXT)
    got = hlo.exposure(rows, min_bytes=1024)
    assert got["collectives"] == 5
    assert got["exposed"] == 3
    assert got["in_loop"] == 1
    assert got["overlapped"] == 2 / 5
    assert hlo.exposure(rows, min_bytes=10**9)["collectives"] == 0


def _read(name):
    return hlo.overlaps((FIXTURES / f"{name}.hlo").read_text())


def _table(rows):
    return [
        (r["op"], r["sync"], r["compute"], r["bytes"])
        for r in rows
        if r["bytes"] >= WEIGHT
    ]


def test_fixtures_are_small():
    sizes = [f.stat().st_size for f in FIXTURES.glob("*.hlo")]
    assert len(sizes) == 4 and sum(sizes) < 300_000, sizes


def test_gpu_async_pairs_cublas_gemms_and_a_conditional_in_flight():
    """XLA:GPU, cuBLAS GEMMs (custom calls): the first layer's gather has
    nothing in flight, the third has two GEMMs and the conditional holding
    the side product; the last reduce-scatter runs after every GEMM."""
    rows = _read("gpu_h200_cublas")
    assert _table(rows) == [
        ("all-reduce", False, 0, 2 * WEIGHT),  # f32, in the true branch
        ("all-gather", False, 1, WEIGHT),
        ("all-gather", False, 0, WEIGHT),
        ("all-gather", False, 3, WEIGHT),  # 2 GEMMs and the conditional
        ("reduce-scatter", False, 4, WEIGHT),
        ("reduce-scatter", False, 0, WEIGHT),
        ("reduce-scatter", False, 0, WEIGHT),
    ]
    got = hlo.exposure(rows, min_bytes=WEIGHT)  # min_bytes itself counts
    assert (got["collectives"], got["exposed"]) == (7, 4)
    assert got["overlapped"] == 3 / 8


def test_tpu_continuation_fusion_is_one_overlapped_gather():
    """XLA:TPU with async collective fusion (its default): the second
    layer's gather opens in an ``AsyncCollectiveStart`` fusion, runs on in
    two fusions that also hold the first layer's convolutions and closes in
    an ``AsyncCollectiveDone`` fusion: one collective, overlapped. The
    reduce-scatters are all-reduce + slice fusions, synchronous."""
    rows = _read("tpu_v5e_fusion_on")
    assert _table(rows) == [
        ("all-gather", True, 0, WEIGHT),
        ("all-gather", True, 0, WEIGHT),
        ("all-gather", False, 2, WEIGHT),
        ("reduce-scatter", True, 0, WEIGHT),
        ("reduce-scatter", True, 0, WEIGHT),
        ("reduce-scatter", True, 0, WEIGHT),
    ]
    got = hlo.exposure(rows, min_bytes=WEIGHT)
    assert (got["collectives"], got["exposed"]) == (6, 5)
    assert got["overlapped"] == 1 / 6


def test_tpu_without_async_collective_fusion_every_collective_is_sync():
    rows = _read("tpu_v5e_fusion_off")
    assert (
        _table(rows)
        == [("all-gather", True, 0, WEIGHT)] * 3
        + [("reduce-scatter", True, 0, WEIGHT)] * 3
    )
    assert hlo.exposure(rows, min_bytes=WEIGHT)["overlapped"] == 0.0


def test_tpu_gather_once_step_sync_reduce_scatter_counts_its_operand():
    """The gather-once step of examples/fsdp.py's model on 8 v5e chips
    (this libtpu schedules it synchronously): the first layer's
    reduce-scatter moves its 64 x 128 float32 operand, not its result."""
    rows = [r for r in _read("tpu_v5e_gather_once") if r["bytes"] >= 512]
    assert [(r["op"], r["sync"], r["bytes"]) for r in rows] == [
        ("all-reduce", True, 4 * 128),  # the bias's gather, as a sum
        ("all-gather", True, 2 * 128 * 10),  # gathered in bfloat16
        ("all-gather", True, 2 * 64 * 128),
        ("reduce-scatter", True, 4 * 64 * 128),
        ("all-reduce", True, 5752),  # the other gradients, combined
    ]
    assert not any(r["loop"] for r in rows)


# ------------------------------------------------- oa.overlap_compiler_options


def test_overlap_compiler_options_per_platform():
    gpu = oa.overlap_compiler_options("gpu")
    assert gpu == {
        "xla_gpu_all_gather_combine_threshold_bytes": 0,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
        "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
    }
    tpu = oa.overlap_compiler_options("tpu")
    assert tpu["xla_tpu_enable_async_collective_fusion"] is True
    assert all(k.startswith(("xla_tpu_", "xla_enable_")) for k in tpu)
    assert oa.overlap_compiler_options("cpu") == {}
    assert oa.overlap_compiler_options() == oa.overlap_compiler_options(
        jax.default_backend()
    )
    gpu["xla_gpu_all_gather_combine_threshold_bytes"] = 1  # a new dict
    assert oa.overlap_compiler_options("gpu") != gpu


@pytest.mark.parametrize("platform", ["cuda", "GPU", "", 3])
def test_overlap_compiler_options_bad_platform(platform):
    with pytest.raises(ValueError, match=f"platform={platform!r}"):
        oa.overlap_compiler_options(platform)


def test_overlap_compiler_options_compile_on_this_backend():
    f = jax.jit(
        lambda x: jnp.tanh(x @ x).sum(),
        compiler_options=oa.overlap_compiler_options(),
    )
    x = jnp.arange(16.0).reshape(4, 4) / 16
    assert f(x) == jax.jit(lambda x: jnp.tanh(x @ x).sum())(x)


def test_collective_exposure_reads_the_tpu_program_text():
    text = (FIXTURES / "tpu_v5e_fusion_on.hlo").read_text()
    got = oa.collective_exposure(text, min_bytes=WEIGHT)
    assert (got["collectives"], got["exposed"], got["in_loop"]) == (6, 5, 0)
    assert got["overlapped"] == 1 / 6 and got["bytes"] == 6 * WEIGHT
