"""Tests for ``oa.agc`` and ``oa.unitwise_norm``."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import optaxaccum as oa
from tests import helpers

WRAPS = [lambda f: f, jax.jit]
WRAP_IDS = ["eager", "jit"]

# Tolerances against float64/float32 oracles, per gradient dtype. bf16 keeps
# 8 significant bits: one rounding of the result is a relative error <= 2**-8.
TOL = {
    jnp.float32: dict(rtol=1e-5, atol=1e-7),
    jnp.bfloat16: dict(rtol=2.0**-8, atol=0.0),
}


def np_agc(g, w, axes, clipping, eps):
    """Obvious float64 oracle: rescale units whose norm exceeds the bound."""
    g = np.asarray(g, np.float64)
    w = np.asarray(w, np.float64)
    g_norm = np.sqrt(np.sum(g * g, axis=axes, keepdims=True))
    bound = clipping * np.maximum(
        np.sqrt(np.sum(w * w, axis=axes, keepdims=True)), eps
    )
    scale = np.ones_like(g_norm)
    over = g_norm > bound
    scale[over] = bound[over] / g_norm[over]
    return g * scale


def default_axes(ndim):
    return tuple(range(ndim)) if ndim <= 1 else tuple(range(ndim - 1))


def spread_grads(seed, shapes, dtype=jnp.float32):
    """Gradients whose output units range in scale from 1e-4 to 1."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        spread = np.logspace(-4.0, 0.0, shape[-1], dtype=np.float32)
        x = rng.standard_normal(shape).astype(np.float32) * spread
        out[name] = jnp.asarray(x.astype(dtype))
    return out


def f32(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


def run(tx, grads, params, wrap=lambda f: f):
    with jax.numpy_dtype_promotion("strict"):
        state = tx.init(params)
        return wrap(tx.update)(grads, state, params)[0]


# ------------------------------------------------ against optax and numpy

OPTAX_SHAPES = {
    "bias": (5,),
    "dense": (6, 4),
    "conv2d": (3, 3, 2, 4),
    "conv3d": (2, 2, 3, 2, 3),
}


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
@pytest.mark.parametrize("clipping", [0.01, 0.3])
def test_agc_matches_optax_float32(wrap, clipping):
    params = helpers.float32_normal_tree(0, OPTAX_SHAPES)
    grads = spread_grads(1, OPTAX_SHAPES)
    got = run(oa.agc(clipping, eps=1e-3), grads, params, wrap)
    ref_tx = optax.adaptive_grad_clip(clipping, eps=1e-3)
    want, _ = ref_tx.update(grads, ref_tx.init(params), params)
    chex.assert_trees_all_equal_dtypes(got, grads)
    chex.assert_trees_all_close(got, want, **TOL[jnp.float32])
    # Both regimes occur: some units are clipped, some are not.
    n_changed = sum(
        int(np.sum(np.asarray(got[k]) != np.asarray(grads[k]))) for k in grads
    )
    assert 0 < n_changed < sum(g.size for g in grads.values())


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_bfloat16_matches_float32_optax(wrap):
    params = helpers.float32_normal_tree(2, OPTAX_SHAPES, jnp.bfloat16)
    grads = spread_grads(3, OPTAX_SHAPES, jnp.bfloat16)
    got = run(oa.agc(0.02), grads, params, wrap)
    chex.assert_trees_all_equal_dtypes(got, grads)
    # Oracle: optax in float32 on the same (bf16-representable) values.
    ref_tx = optax.adaptive_grad_clip(0.02)
    want, _ = ref_tx.update(f32(grads), ref_tx.init(params), f32(params))
    chex.assert_trees_all_close(f32(got), want, **TOL[jnp.bfloat16])


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_bfloat16_grads_float32_params_strict(wrap):
    params = helpers.float32_normal_tree(4, {"w": (4, 3), "b": (3,)})
    grads = helpers.float32_normal_tree(
        5, {"w": (4, 3), "b": (3,)}, jnp.bfloat16
    )
    got = run(oa.agc(0.05), grads, params, wrap)  # strict promotion inside
    chex.assert_trees_all_equal_dtypes(got, grads)
    for k in grads:
        want = np_agc(
            np.asarray(grads[k], np.float32),
            params[k],
            default_axes(grads[k].ndim),
            0.05,
            1e-3,
        )
        np.testing.assert_allclose(
            np.asarray(got[k], np.float64), want, **TOL[jnp.bfloat16]
        )


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
@pytest.mark.parametrize(
    "shape",
    [(3, 4, 5), (6, 2, 3), (2, 3, 6)],
    ids=["conv1d_WIO", "attn_qkv_F_H_D", "attn_out_H_D_F"],
)
def test_agc_3d_kernels(wrap, shape):
    params = helpers.float32_normal_tree(6, {"k": shape})
    grads = helpers.float32_normal_tree(7, {"k": shape}, scale=0.2)
    got = run(oa.agc(0.05), grads, params, wrap)["k"]
    # The contract's default: all axes but the last.
    want = np_agc(grads["k"], params["k"], (0, 1), 0.05, 1e-3)
    np.testing.assert_allclose(got, want, **TOL[jnp.float32])
    assert not np.allclose(want, grads["k"])  # something was clipped


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_attention_qkv_per_head_units_via_callable(wrap):
    params = {
        "query": helpers.float32_normal_tree(8, {"kernel": (6, 2, 3)}),
        "out": helpers.float32_normal_tree(9, {"kernel": (2, 3, 6)}),
    }
    grads = {
        "query": helpers.float32_normal_tree(
            10, {"kernel": (6, 2, 3)}, scale=0.2
        ),
        "out": helpers.float32_normal_tree(
            11, {"kernel": (2, 3, 6)}, scale=0.2
        ),
    }

    def axis(path, x):
        return 0 if path[0].key in ("query", "key", "value") else None

    got = run(oa.agc(0.05, axis=axis), grads, params, wrap)
    want_q = np_agc(
        grads["query"]["kernel"], params["query"]["kernel"], (0,), 0.05, 1e-3
    )
    want_o = np_agc(
        grads["out"]["kernel"], params["out"]["kernel"], (0, 1), 0.05, 1e-3
    )
    np.testing.assert_allclose(
        got["query"]["kernel"], want_q, **TOL[jnp.float32]
    )
    np.testing.assert_allclose(got["out"]["kernel"], want_o, **TOL[jnp.float32])
    # axis=0 is exactly optax's rule for 3-D leaves.
    ref_tx = optax.adaptive_grad_clip(0.05)
    ref, _ = ref_tx.update(
        grads["query"], ref_tx.init(params["query"]), params["query"]
    )
    np.testing.assert_allclose(
        got["query"]["kernel"], ref["kernel"], **TOL[jnp.float32]
    )


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_agc_clips_per_output_unit(wrap, dtype):
    # Column 0 is quiet (grad norm 0.01 < 0.1 * 5), column 1 loud
    # (grad norm 50 > 0.1 * 13).
    w = jnp.array([[3.0, 5.0], [4.0, 12.0]], dtype)
    g = jnp.array([[0.006, 30.0], [0.008, 40.0]], dtype)
    got = run(oa.agc(0.1), {"w": g}, {"w": w}, wrap)["w"]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got[:, 0], g[:, 0])  # bit-for-bit
    loud = np.asarray(got[:, 1], np.float64)
    np.testing.assert_allclose(np.linalg.norm(loud), 0.1 * 13.0, **TOL[dtype])
    g1 = np.asarray(g[:, 1], np.float64)  # direction kept
    np.testing.assert_allclose(
        loud, g1 * (1.3 / np.linalg.norm(g1)), **TOL[dtype]
    )


# ---------------------------------------------------------------- axis forms

AXIS_SHAPES = {"a": (4, 3), "b": (2, 3, 4), "c": (5,)}


def axis_case(axis, per_leaf_axes, wrap):
    params = helpers.float32_normal_tree(12, AXIS_SHAPES)
    grads = helpers.float32_normal_tree(13, AXIS_SHAPES, scale=0.3)
    got = run(oa.agc(0.1, axis=axis), grads, params, wrap)
    for k in grads:
        want = np_agc(grads[k], params[k], per_leaf_axes[k], 0.1, 1e-3)
        np.testing.assert_allclose(got[k], want, **TOL[jnp.float32], err_msg=k)


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
@pytest.mark.parametrize(
    "axis, per_leaf",
    [
        (0, {"a": (0,), "b": (0,), "c": (0,)}),
        (-1, {"a": (1,), "b": (2,), "c": (0,)}),
        ((), {"a": (), "b": (), "c": ()}),
    ],
    ids=["int", "negative", "elementwise"],
)
def test_agc_axis_global(wrap, axis, per_leaf):
    axis_case(axis, per_leaf, wrap)


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_axis_global_tuple(wrap):
    shapes = {"a": (4, 3, 2), "b": (2, 3, 4)}
    params = helpers.float32_normal_tree(14, shapes)
    grads = helpers.float32_normal_tree(15, shapes, scale=0.3)
    got = run(oa.agc(0.1, axis=(0, -1)), grads, params, wrap)
    for k in grads:
        want = np_agc(grads[k], params[k], (0, 2), 0.1, 1e-3)
        np.testing.assert_allclose(got[k], want, **TOL[jnp.float32])


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_axis_pytree_with_none_entries(wrap):
    axis = {"a": -1, "b": (0, 2), "c": None}
    axis_case(axis, {"a": (1,), "b": (0, 2), "c": (0,)}, wrap)


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_axis_pytree_prefix(wrap):
    params = {
        "enc": helpers.float32_normal_tree(16, {"w": (4, 3), "v": (3, 5)}),
        "head": helpers.float32_normal_tree(17, {"w": (3, 2)}),
    }
    grads = {
        "enc": helpers.float32_normal_tree(
            18, {"w": (4, 3), "v": (3, 5)}, scale=0.3
        ),
        "head": helpers.float32_normal_tree(19, {"w": (3, 2)}, scale=0.3),
    }
    got = run(oa.agc(0.1, axis={"enc": 1, "head": None}), grads, params, wrap)
    for k in ("w", "v"):
        want = np_agc(grads["enc"][k], params["enc"][k], (1,), 0.1, 1e-3)
        np.testing.assert_allclose(got["enc"][k], want, **TOL[jnp.float32])
    want = np_agc(grads["head"]["w"], params["head"]["w"], (0,), 0.1, 1e-3)
    np.testing.assert_allclose(got["head"]["w"], want, **TOL[jnp.float32])


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_axis_pytree_for_tuple_params(wrap):
    # Per-leaf specs of tuple-shaped params are given as 1-tuples.
    rng = np.random.default_rng(20)
    params = (
        helpers.float32_normal(rng, (4, 3)),
        helpers.float32_normal(rng, (3, 4)),
    )
    grads = (
        helpers.float32_normal(rng, (4, 3), scale=0.3),
        helpers.float32_normal(rng, (3, 4), scale=0.3),
    )
    got = run(oa.agc(0.1, axis=((0,), (1,))), grads, params, wrap)
    np.testing.assert_allclose(
        got[0], np_agc(grads[0], params[0], (0,), 0.1, 1e-3), **TOL[jnp.float32]
    )
    np.testing.assert_allclose(
        got[1], np_agc(grads[1], params[1], (1,), 0.1, 1e-3), **TOL[jnp.float32]
    )


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_axis_callable_equinox_layout(wrap):
    seen = []

    def axis(path, x):
        seen.append(jax.tree_util.keystr(path))
        return tuple(range(1, x.ndim)) if x.ndim >= 2 else None

    axis_case(axis, {"a": (1,), "b": (1, 2), "c": (0,)}, wrap)
    assert set(seen) == {"['a']", "['b']", "['c']"}


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_axis_default_is_none(wrap):
    axis_case(None, {"a": (0,), "b": (0, 1), "c": (0,)}, wrap)


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_scalar_and_size_one_axes(wrap):
    # No squeezing: a (1, 3) kernel has 3 units of one element each; a
    # scalar is one unit.
    params = {"k": jnp.array([[1.0, 2.0, 0.5]]), "s": jnp.array(2.0)}
    grads = {"k": jnp.array([[1.0, 0.1, 1.0]]), "s": jnp.array(-3.0)}
    got = run(oa.agc(0.5), grads, params, wrap)
    np.testing.assert_allclose(got["k"], [[0.5, 0.1, 0.25]], rtol=1e-6)
    np.testing.assert_allclose(got["s"], -1.0, rtol=1e-6)


# ----------------------------------------------------------- special values


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_agc_zero_params_use_eps(wrap, dtype):
    params = {"w": jnp.zeros((3, 2), dtype), "b": jnp.zeros((2,), dtype)}
    grads = {"w": jnp.ones((3, 2), dtype), "b": jnp.ones((2,), dtype)}
    got = run(oa.agc(0.5, eps=0.25), grads, params, wrap)
    chex.assert_trees_all_equal_dtypes(got, grads)
    # Each unit's norm becomes 0.5 * 0.25: w columns and b have norms
    # sqrt(3) and sqrt(2), all entries equal.
    np.testing.assert_allclose(
        np.asarray(got["w"], np.float64),
        np.full((3, 2), 0.125 / math.sqrt(3)),
        **TOL[dtype],
    )
    np.testing.assert_allclose(
        np.asarray(got["b"], np.float64),
        np.full((2,), 0.125 / math.sqrt(2)),
        **TOL[dtype],
    )


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_eps_zero_and_zero_params_gives_zero(wrap):
    params = {"w": jnp.zeros((3, 2))}
    got = run(oa.agc(0.5, eps=0.0), {"w": jnp.ones((3, 2))}, params, wrap)
    np.testing.assert_array_equal(got["w"], np.zeros((3, 2)))


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("eps", [1e-3, 0.0])
def test_agc_zero_grads_stay_zero(wrap, dtype, eps):
    params = {"w": jnp.zeros((3, 2), dtype), "v": jnp.ones((2, 2, 2), dtype)}
    grads = jax.tree.map(jnp.zeros_like, params)
    got = run(oa.agc(0.01, eps=eps), grads, params, wrap)
    chex.assert_trees_all_equal_dtypes(got, grads)
    chex.assert_tree_all_finite(got)
    chex.assert_trees_all_equal(got, grads)


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_nonfinite_grads_are_not_hidden(wrap):
    params = {"w": jnp.ones((2, 2))}
    grads = {"w": jnp.array([[jnp.nan, 0.001], [1.0, 0.001]])}
    got = run(oa.agc(0.1), grads, params, wrap)["w"]
    assert np.isnan(got[0, 0])
    np.testing.assert_array_equal(got[:, 1], grads["w"][:, 1])


# ------------------------------------------------------------------- errors


def test_agc_without_params_raises():
    tx = oa.agc()
    grads = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match=r"oa\.agc.*params"):
        tx.update(grads, optax.EmptyState())
    with pytest.raises(ValueError, match=r"oa\.agc.*params"):
        tx.update(grads, optax.EmptyState(), None)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(clipping=0.0), ValueError, "clipping"),
        (dict(clipping=-1.0), ValueError, "clipping"),
        (dict(clipping=float("nan")), ValueError, "clipping"),
        (dict(clipping="0.1"), TypeError, "clipping"),
        (dict(clipping=None), TypeError, "clipping"),
        (dict(clipping=True), TypeError, "clipping"),
        (dict(eps=-1e-3), ValueError, "eps"),
        (dict(eps=float("nan")), ValueError, "eps"),
        (dict(eps="x"), TypeError, "eps"),
        (dict(axis=1.5), TypeError, "axis"),
        (dict(axis="rows"), TypeError, "axis"),
        (dict(axis={"w": "rows"}), TypeError, r"axis\['w'\]"),
        (dict(axis={"w": (0, 1.0)}), TypeError, r"axis\['w'\]"),
    ],
)
def test_agc_bad_constructor_args(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        oa.agc(**kwargs)


def test_agc_accepts_integer_and_scalar_array_args():
    params = {"w": jnp.ones((2, 2))}
    grads = {"w": jnp.full((2, 2), 10.0)}
    a = run(oa.agc(1, eps=0), grads, params)
    b = run(oa.agc(jnp.float32(1.0), eps=np.float64(0.0)), grads, params)
    chex.assert_trees_all_equal(a, b)


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
@pytest.mark.parametrize(
    "axis, exc, match",
    [
        (2, ValueError, r"params\['w'\].*out of range"),
        (-3, ValueError, r"params\['w'\].*out of range"),
        ((0, -2), ValueError, r"params\['w'\].*repeats"),
        ({"w": 0, "z": 3}, ValueError, r"params\['z'\].*out of range"),
        ({"w": 0}, ValueError, "structure of agc's axis"),
        (
            {"w": 0, "z": None, "extra": 0},
            ValueError,
            "structure of agc's axis",
        ),
        (lambda path, x: x.ndim, ValueError, r"params\['w'\].*out of range"),
        (lambda path, x: "last", TypeError, r"params\['w'\]"),
        (lambda path, x: 0.0, TypeError, r"params\['w'\]"),
    ],
    ids=[
        "too_big",
        "too_negative",
        "repeated",
        "pytree_leaf",
        "pytree_missing_key",
        "pytree_extra_key",
        "callable_range",
        "callable_str",
        "callable_float",
    ],
)
def test_agc_bad_axes_raise_naming_the_leaf(wrap, axis, exc, match):
    params = {"w": jnp.ones((2, 3)), "z": jnp.ones((2, 3, 4))}
    tx = oa.agc(axis=axis)
    with pytest.raises(exc, match=match):
        tx.init(params)
    with pytest.raises(exc, match=match):
        wrap(tx.update)(params, optax.EmptyState(), params)


def test_agc_grads_params_mismatch_raises():
    tx = oa.agc()
    params = {"w": jnp.ones((2, 3))}
    with pytest.raises(ValueError, match="structure"):
        tx.update({"v": jnp.ones((2, 3))}, tx.init(params), params)
    with pytest.raises(ValueError, match=r"\['w'\].*shape"):
        tx.update({"w": jnp.ones((3, 2))}, tx.init(params), params)


# ------------------------------------------------------ transform contract


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
def test_agc_is_stateless_and_takes_extra_args(wrap):
    tx = oa.agc()
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert not oa.is_gate(tx)
    params = {"w": jnp.ones((2, 3))}
    state = tx.init(params)
    assert state == optax.EmptyState()
    with jax.numpy_dtype_promotion("strict"):
        updates, new_state = wrap(
            lambda g, s, p: tx.update(g, s, p, accum_weight=2.0)
        )(params, state, params)
    assert new_state == optax.EmptyState()
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)


def test_agc_inside_optax_masked():
    # The NFNet recipe: no clipping for the final classifier.
    params = {
        "body": helpers.float32_normal_tree(21, {"w": (4, 3)}),
        "head": helpers.float32_normal_tree(22, {"w": (3, 2)}),
    }
    grads = {
        k: {"w": jnp.asarray(10.0 * np.asarray(v["w"]))}
        for k, v in params.items()
    }
    mask = {"body": {"w": True}, "head": {"w": False}}
    for axis in (
        None,
        -2,
        {"body": {"w": 0}, "head": {"w": 0}},
        lambda path, x: 0,
    ):
        tx = optax.masked(oa.agc(0.1, axis=axis), mask)
        got = run(tx, grads, params)
        np.testing.assert_array_equal(got["head"]["w"], grads["head"]["w"])
        want = np_agc(grads["body"]["w"], params["body"]["w"], (0,), 0.1, 1e-3)
        np.testing.assert_allclose(got["body"]["w"], want, **TOL[jnp.float32])


@pytest.mark.parametrize("wrap", WRAPS, ids=WRAP_IDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_agc_clips_every_microbatch_in_chain(wrap, dtype):
    shapes = {"w": (4, 3), "b": (3,)}
    params = helpers.float32_normal_tree(23, shapes, dtype)
    g1 = helpers.float32_normal_tree(24, shapes, dtype, scale=0.5)
    g2 = helpers.float32_normal_tree(25, shapes, dtype, scale=0.05)
    lr = 0.5
    tx = oa.chain(oa.agc(0.1), oa.accumulate(2), optax.sgd(lr))
    with jax.numpy_dtype_promotion("strict"):
        state = tx.init(params)
        update = wrap(tx.update)
        u1, state = update(g1, state, params)
        u2, state = update(g2, state, params)
    chex.assert_trees_all_equal_dtypes(u2, g1)
    chex.assert_trees_all_equal(u1, jax.tree.map(jnp.zeros_like, g1))
    # Manual: clip each micro-batch (optax's AGC in float32), then average.
    ref = optax.adaptive_grad_clip(0.1)
    c1, _ = ref.update(f32(g1), ref.init(params), f32(params))
    c2, _ = ref.update(f32(g2), ref.init(params), f32(params))
    want = jax.tree.map(lambda a, b: -lr * (a + b) / 2, c1, c2)
    # Clipping before accumulation differs from clipping the mean.
    unclipped_mean = jax.tree.map(
        lambda a, b: -lr * (a + b) / 2, f32(g1), f32(g2)
    )
    assert not np.allclose(want["w"], unclipped_mean["w"], rtol=0.05)
    if dtype == jnp.float32:
        tol = TOL[dtype]
    else:
        # Each clipped micro-batch gradient is rounded to bf16 (relative
        # error 2**-9) before the two are averaged, so where they cancel the
        # error is relative to the terms, not to their mean.
        biggest = max(
            float(np.max(np.abs(x))) for x in jax.tree.leaves((c1, c2))
        )
        tol = dict(rtol=2.0**-7, atol=2.0**-8 * lr * biggest)
    chex.assert_trees_all_close(f32(u2), want, **tol)


# ----------------------------------------------------------- unitwise_norm


@pytest.mark.parametrize(
    "shape, axis, axes",
    [
        ((), None, ()),
        ((5,), None, (0,)),
        ((4, 3), None, (0,)),
        ((1, 3), None, (0,)),
        ((3, 4, 5), None, (0, 1)),
        ((2, 2, 3, 4), None, (0, 1, 2)),
        ((2, 2, 2, 3, 4), None, (0, 1, 2, 3)),
        ((2, 2, 2, 2, 3, 4), None, (0, 1, 2, 3, 4)),
        ((4, 3), -1, (1,)),
        ((2, 3, 4), (0, 2), (0, 2)),
        ((2, 3), (), ()),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unitwise_norm(shape, axis, axes, dtype):
    x = helpers.float32_normal(np.random.default_rng(26), shape, dtype)
    got = oa.unitwise_norm(x, axis=axis)
    assert got.dtype == jnp.float32
    x64 = np.asarray(x, np.float64)
    want = np.sqrt(np.sum(x64 * x64, axis=axes, keepdims=True))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_unitwise_norm_bad_axis():
    with pytest.raises(ValueError, match="out of range"):
        oa.unitwise_norm(jnp.ones((2, 3)), axis=2)
    with pytest.raises(ValueError, match="repeats"):
        oa.unitwise_norm(jnp.ones((2, 3)), axis=(1, -1))
    with pytest.raises(TypeError, match="axis"):
        oa.unitwise_norm(jnp.ones((2, 3)), axis=0.5)


# --------------------------------------------------------- property test


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=5).map(tuple),
    clipping=st.floats(1e-3, 10.0),
    log_grad_scale=st.floats(-4.0, 2.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_agc_property_bound_holds(shape, clipping, log_grad_scale, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    g = (10.0**log_grad_scale * rng.standard_normal(shape)).astype(np.float32)
    got = np.asarray(
        run(oa.agc(clipping), {"x": jnp.asarray(g)}, {"x": jnp.asarray(w)})[
            "x"
        ],
        np.float64,
    )
    axes = default_axes(len(shape))
    norm = lambda a: np.sqrt(
        np.sum(np.asarray(a, np.float64) ** 2, axis=axes, keepdims=True)
    )
    bound = clipping * np.maximum(norm(w), 1e-3)
    assert np.all(norm(got) <= bound * (1 + 1e-5))
    # Units clearly under the bound are untouched (bit-for-bit); units over
    # it end on the bound.
    g_norm = np.broadcast_to(norm(g), shape)
    b = np.broadcast_to(bound, shape)
    under = g_norm < b * (1 - 1e-5)
    np.testing.assert_array_equal(got[under], g[under])
    over = g_norm > b * (1 + 1e-5)
    np.testing.assert_allclose(
        np.broadcast_to(norm(got), shape)[over], b[over], rtol=1e-5
    )
