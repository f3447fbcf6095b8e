"""The scheduled-program reader (``optaxaccum._src.hlo.overlaps``): which
collectives have compute (a GEMM or a loop) scheduled between their start
and their done. Synthetic scheduled HLO text; the compiled XLA:GPU and
XLA:TPU programs are read in tests/gpu_compile."""

from optaxaccum._src import hlo

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
