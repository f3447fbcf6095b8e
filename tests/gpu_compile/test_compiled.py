"""The compiled XLA:GPU and XLA:TPU programs, checked without the hardware.

``tests/test_gpu_branch.py`` reads the lowered module, before XLA's passes;
these tests read what XLA:GPU (H100 and H200 targets) and XLA:TPU (v5e)
compile it to (README.md in this folder):

* every gated step keeps a ``conditional`` with the followers' work (Adam's
  ``sqrt``) only inside it; with the barriers off, XLA:GPU turns it into a
  ``select`` (the control: the check can fail);
* in a train step (gradients and the update in one jit), each dense
  weight's accumulation is the epilogue of the GEMM that makes its gradient,
  and a call that does not close its window copies no accumulator and makes
  no other pass over a weight-sized array, in each GEMM backend (Triton,
  cuBLAS-LT) with and without ``oa.fold_compiler_options()``; where a
  setting or a configuration does not reach that floor, a strict expected
  failure names it;
* the memory premises of the suite hold for the compiled GPU program.

Run with ``make test-gpu-compile`` (``tests/gpu_compile/run.py``), which
installs the wheels and sets the environment; elsewhere they skip.
"""

from __future__ import annotations

import contextlib
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

from tools.compiled import hlo, steps, targets  # noqa: E402

pytestmark = pytest.mark.gpu_compile


def _gpu(target):
    try:
        return targets.gpu_device(target)
    except Exception as err:  # an older jaxlib's proto lacks newer fields
        pytest.skip(f"jaxlib {jaxlib.__version__} cannot read {target}: {err}")


def _tpu():
    try:
        return targets.tpu_device()
    except Exception as err:
        pytest.skip(f"no TPU compiler (libtpu) here: {err}")


def _device(target):
    return _tpu() if target == "tpu" else _gpu(target)


@functools.cache
def _gated(name, target, barriers=True):
    """The compiled program of a gated step, parsed."""
    fn, args = steps.GATED[name]()
    with contextlib.nullcontext() if barriers else targets.barriers_off():
        compiled = targets.compile_for(fn, args, _device(target))
    return hlo.Module.parse(compiled.as_text())


def _followers(module):
    size = max(x.size for x in jax.tree.leaves(steps._params()))
    return hlo.placement(module, steps.FOLLOWER_OPS, min_count=size)


@pytest.mark.parametrize("target", ["h100", "h200", "tpu"])
@pytest.mark.parametrize("name", list(steps.GATED))
def test_gate_kept_with_followers_inside(name, target):
    where = _followers(_gated(name, target))
    assert where["conditionals"] >= 1, where
    assert where["outside"] == 0 and where["inside"] >= 1, where


# The fused step, the plain protocol and flush branch with a loop of 0 or 1
# trips, which XLA:GPU keeps with or without barriers.
FUSED_LOOPS = (
    "fused accumulate",
    "plain accumulate",
    "flush",
    "fused noise_scale",
    "fused nested_gates",
    "fused MultiSteps",
    "TrainState",
    "nnx Optimizer",
)


@pytest.mark.parametrize("target", ["h100", "h200"])
@pytest.mark.parametrize("name", FUSED_LOOPS)
def test_fused_loop_needs_no_barrier(name, target):
    where = _followers(_gated(name, target, barriers=False))
    assert where["conditionals"] >= 1, where
    assert where["outside"] == 0 and where["inside"] >= 1, where


@functools.cache
def _train(api, model, target):
    fn, args, counts, _ = steps.train_step(api, model)
    donate = (0,) if api in ("TrainState", "nnx Optimizer") else (0, 1)
    compiled = targets.compile_for(fn, args, _gpu(target), donate)
    module = hlo.Module.parse(compiled.as_text())
    return hlo.fold(module, hlo.is_kernel_accumulator), counts


WHERE = {"gemm", "split-k", "merged", "loop"}


@pytest.mark.parametrize("target", ["h100", "h200"])
@pytest.mark.parametrize("form", ["folded", "overwrite"])
def test_the_fold_check_sees_both_forms(form, target):
    """The check on a bare accumulation: ``acc + x.T @ dy`` is the GEMM's
    epilogue; the lazy reset's ``where(fresh, g, acc + g)`` is a loop
    fusion of its own."""
    x = jax.ShapeDtypeStruct((256, 512), jax.numpy.float32)
    acc = {"acc": {"kernel": jax.ShapeDtypeStruct((512, 768), x.dtype)}}

    def step(acc, x, dy, fresh):
        g = x.T @ dy
        a = acc["acc"]["kernel"]
        new = a + g if form == "folded" else jax.numpy.where(fresh, g, a + g)
        return {"acc": {"kernel": new}}

    dy = jax.ShapeDtypeStruct((256, 768), x.dtype)
    args = (acc, x, dy, jax.ShapeDtypeStruct((), bool))
    compiled = targets.compile_for(step, args, _gpu(target), (0,))
    where = hlo.fold(
        hlo.Module.parse(compiled.as_text()), hlo.is_kernel_accumulator
    )
    assert list(where.values()) == ["gemm" if form == "folded" else "loop"]


# The transformer on one target: its compiles take most of the run.
TRAIN_CASES = [
    *((m, t) for m in ["mlp"] for t in ["h100", "h200"]),
    ("transformer", "h100"),
]


@pytest.mark.parametrize(("model", "target"), TRAIN_CASES)
@pytest.mark.parametrize("api", list(steps.TRAIN))
def test_every_accumulation_is_found(api, model, target):
    where, counts = _train(api, model, target)
    assert len(where) == len(counts) and set(where.values()) <= WHERE, where


def _newest_gpu():
    """The H200 target, or the H100 one where this jaxlib cannot read the
    H200 config (jaxlib 0.10)."""
    try:
        targets.gpu_device("h200")
        return "h200"
    except Exception:
        return "h100"


@functools.cache
def _floor(api, setting, target=None, model="mlp"):
    """A train step's fold and its non-closing path's weight-sized copies
    and passes, compiled in a setting of ``targets.SETTINGS``."""
    fn, args, counts, shapes = steps.train_step(api, model)
    donate = (0,) if api in ("TrainState", "nnx Optimizer") else (0, 1)
    options = targets.options(setting)
    device = _gpu(target or _newest_gpu())
    compiled = targets.compile_for(fn, args, device, donate, options)
    module = hlo.Module.parse(compiled.as_text())
    where = hlo.fold(module, hlo.is_kernel_accumulator)
    path = hlo.non_closing(module, shapes, steps.FOLLOWER_OPS)
    return where, counts, path


def _at_the_floor(api, setting, target=None, model="mlp"):
    where, counts, path = _floor(api, setting, target, model)
    assert len(where) == len(counts), where
    assert set(where.values()) == {"gemm"}, where
    assert path == {"copies": 0, "passes": 0}, path


# Every setting a card may pick, with no option as with the options: the
# fused step branches with a loop of 0 or 1 trips, whose carry XLA updates
# in place (docs/gpu.md).
_FLOOR_SETTINGS = list(targets.SETTINGS)


@pytest.mark.parametrize("setting", _FLOOR_SETTINGS)
@pytest.mark.parametrize("api", list(steps.TRAIN))
def test_non_closing_step_is_the_gemm_epilogue(api, setting):
    """Every dense weight's accumulation is the epilogue of the GEMM that
    makes its gradient, and the non-closing path has no weight-sized copy
    and no weight-sized pass outside the GEMMs (H200; H100 on jaxlib
    0.10)."""
    _at_the_floor(api, setting)


@pytest.mark.parametrize("api", ["chain", "MultiSteps"])
def test_h100_non_closing_step_is_the_gemm_epilogue(api):
    _at_the_floor(api, "triton+options", target="h100")


@pytest.mark.parametrize("target", ["h100"])
@pytest.mark.parametrize("api", list(steps.TRAIN))
def test_transformer_reads_no_gradient_twice(api, target):
    """Every dense weight of examples/transformer_lm.py's model: the
    accumulation is in the GEMM that makes its gradient, or in the sum of a
    split-K GEMM's partials; XLA computes the query, key and value weights'
    gradients in one GEMM (they share their input), whose slices the
    accumulations then read ("merged")."""
    where, counts = _train(api, "transformer", target)
    assert len(where) == len(counts), where
    assert set(where.values()) <= {"gemm", "split-k", "merged"}, where
    assert sum(v == "gemm" for v in where.values()) >= 3, where


# Off the floor, named (docs/gpu.md): a traced weight multiplied in front
# of the add keeps it out of cuBLAS-LT's GEMM (alpha and beta are
# compile-time constants), Triton fuses it; skip_nonfinite and the loss
# scale read every gradient for their finiteness check (a pass of its own)
# and select on it; with bfloat16 products the GEMM writes a bfloat16
# gradient that a loop fusion converts and adds to the float32 accumulator.
_TRACED_WEIGHT = pytest.mark.xfail(
    raises=AssertionError,
    strict=True,
    reason="a traced weight multiplies the gradient",
)
_READS_GRADIENT = pytest.mark.xfail(
    raises=AssertionError,
    strict=True,
    reason="the finiteness check reads every gradient",
)
_BF16 = pytest.mark.xfail(
    raises=AssertionError,
    strict=True,
    reason="bfloat16 gradients are converted in a pass",
)


@pytest.mark.parametrize(
    ("api", "model", "setting"),
    [
        ("mean weighted", "mlp", "triton+options"),
        pytest.param(
            "mean weighted", "mlp", "cublas+options", marks=_TRACED_WEIGHT
        ),
        *(
            pytest.param(api, "mlp", setting, marks=_READS_GRADIENT)
            for api in ("skip_nonfinite", "loss_scale")
            for setting in ("triton+options", "cublas+options")
        ),
        *(
            pytest.param("chain", "mlp_bf16", setting, marks=_BF16)
            for setting in ("triton+options", "cublas+options")
        ),
    ],
)
def test_off_the_floor(api, model, setting):
    """Configurations whose micro-step does more than the GEMM's epilogue,
    each named in docs/gpu.md."""
    _at_the_floor(api, setting, model=model)


def _premise_shape(target):
    """XLA:TPU's premises are measured past its VMEM (tools/compiled/steps.py)."""
    return steps.TPU_PREMISE_SHAPE if target == "tpu" else steps.PREMISE_SHAPE


def _temp(name, target, fused=True, weighted=False, setting="triton"):
    """Temporaries of a premise's step (its gradients are arguments),
    compiled in ``setting`` (no compiler option by default) for
    ``target``."""
    shape = _premise_shape(target)
    fn, args = steps.premise_step(name, fused, weighted, shape)
    options = targets.options(setting) if target != "tpu" else None
    compiled = targets.compile_for(fn, args, _device(target), (0, 1), options)
    mem = compiled.memory_analysis()
    if mem is None:
        pytest.skip("this plugin gives no memory analysis")
    return mem.temp_size_in_bytes


# XLA:TPU, a big model (past VMEM), both libtpus: optax.apply_if_finite's
# lax.cond after the accumulate holds the window's mean (read by its check
# and by the optimizer in its branch) and the updates its cond returns.
_AIF_TPU = (
    "XLA:TPU: optax.apply_if_finite's lax.cond after the accumulate holds "
    "the window's mean and the updates it returns (docs/gpu.md)"
)


@pytest.mark.parametrize("setting", ["triton", "triton+options"])
@pytest.mark.parametrize("target", ["h100", "h200", "tpu"])
@pytest.mark.parametrize(
    "name",
    [
        "accumulate",
        "loss_scale",
        "eager_gate_own_chain",
        "window_loss_scale",
        "apply_if_finite",
    ],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_step_needs_no_tree_sized_temporary(
    name, weighted, target, setting, request
):
    """tests/test_chain.py, tests/test_accumulate.py: the fused donated
    step (gradients passed in) allocates less than 1/64 of the tree, with
    no compiler option and with ``oa.fold_compiler_options()``; XLA:TPU's
    on a tree past its VMEM."""
    if target == "tpu" and setting != "triton":
        pytest.skip("XLA:TPU: one setting")
    if target == "tpu" and name == "apply_if_finite":
        request.applymarker(pytest.mark.xfail(reason=_AIF_TPU, strict=True))
    temp = _temp(name, target, weighted=weighted, setting=setting)
    assert temp < steps.tree_bytes(_premise_shape(target)) // 64, temp


@pytest.mark.parametrize("target", ["h100", "h200"])
def test_headline_chain_holds_one_tree(target):
    """tests/test_chain.py: the README chain holds the unscaled gradient
    (one tree), AGC's unit norms and 4 KiB of scalars; no more than the
    plain path."""
    temp = _temp("headline", target)
    unit_norms = 2 * 256 * 4
    assert temp <= steps.TREE_BYTES + unit_norms + 4096, temp
    assert temp <= _temp("headline", target, fused=False)


def _train_model(target):
    """XLA:TPU's train steps are measured past its VMEM (tools/compiled/steps.py)."""
    return "mlp_wide" if target == "tpu" else "mlp"


@functools.cache
def _train_temp(api, target, setting):
    fn, args, _, _ = steps.train_step(api, _train_model(target))
    donate = (0,) if api in ("TrainState", "nnx Optimizer") else (0, 1)
    options = None if target == "tpu" else targets.options(setting)
    compiled = targets.compile_for(fn, args, _device(target), donate, options)
    mem = compiled.memory_analysis()
    if mem is None:
        pytest.skip("this plugin gives no memory analysis")
    return mem.temp_size_in_bytes


@pytest.mark.parametrize(
    ("target", "setting"),
    [("h200", "triton"), ("h200", "cublas"), ("tpu", "none")],
)
@pytest.mark.parametrize("api", list(steps.TRAIN))
def test_train_step_needs_no_tree_beyond_the_optimizer_alone(
    api, target, setting, request
):
    """With no compiler option, a train step that makes its gradients in
    the jit needs less than half a param tree of temporaries beyond the
    same step with the optimizer alone (no accumulation), closing branch
    included: a summed weighted window and the loss scale after the
    accumulate too; XLA:TPU's on a model past its VMEM."""
    if target == "h200":
        target = _newest_gpu()
    if target == "tpu" and api == "apply_if_finite":
        request.applymarker(pytest.mark.xfail(reason=_AIF_TPU, strict=True))
    tree = 4 * sum(steps.weight_counts(_train_model(target)))
    extra = _train_temp(api, target, setting) - _train_temp(
        "adamw", target, setting
    )
    assert extra < tree // 2, (extra, tree)
