"""Tests of loss scaling: ``dynamic_loss_scale`` against
``jmp.DynamicLossScale``, gating of followers and of ``accumulate``,
``static_loss_scale``, ``loss_scale`` and ``scaled_value_and_grad``."""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import optaxaccum as oa

JIT_OR_NOT = [lambda f: f, jax.jit]
F32_MAX = np.finfo(np.float32).max

# Tolerances by gradient dtype for unscaled gradients (one rounding to the
# gradient dtype after a float32 multiply).
TOL = {
    jnp.float32: dict(rtol=1e-6, atol=0.0),
    jnp.bfloat16: dict(rtol=1e-2, atol=0.0),
    jnp.float16: dict(rtol=1e-3, atol=0.0),
}


def _grads(finite, scale, kind="inf"):
    """A small gradient tree; one element non-finite unless ``finite``."""
    g = {
        "w": jnp.array([[1.0, -2.0], [3.0, 0.5]], jnp.float32),
        "b": jnp.array([0.25, -4.0], jnp.float32),
    }
    g = jax.tree.map(lambda x: x * scale, g)
    if not finite:
        bad = {"inf": jnp.inf, "-inf": -jnp.inf, "nan": jnp.nan}[kind]
        g["b"] = g["b"].at[1].set(bad)
    return g


def _run_against_jmp(steps, *, init_scale, period, factor, min_scale, update):
    """Runs our transform and jmp's ``adjust`` on the same finiteness
    sequence; checks scale, counter and emitted updates at every step."""
    tx = oa.dynamic_loss_scale(
        init_scale, period=period, factor=factor, min_scale=min_scale
    )
    state = tx.init(None)
    ref = jmp.DynamicLossScale(
        jnp.float32(init_scale),
        period=period,
        factor=factor,
        min_loss_scale=jnp.float32(min_scale),
    )
    for finite, kind in steps:
        # Gradients of loss * scale (the scale may be huge: f32 may overflow,
        # which is then a genuine non-finite gradient for both).
        g = _grads(finite, ref.loss_scale, kind)
        ref_finite = jmp.all_finite(ref.unscale(g))
        with jax.numpy_dtype_promotion("strict"):
            u, state = update(g, state)
        if bool(ref_finite):
            chex.assert_trees_all_close(u, ref.unscale(g), rtol=1e-6)
        else:
            chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, g))
        ref = ref.adjust(ref_finite)
        np.testing.assert_array_equal(state.scale, ref.loss_scale)
        np.testing.assert_array_equal(state.counter, ref.counter)
        assert state.scale.dtype == jnp.float32
        assert state.counter.dtype == jnp.int32
        assert np.isfinite(state.scale) and state.scale >= np.float32(min_scale)


# One compiled update for every configuration: the schedule lives in the state.
_jitted_update = jax.jit(oa.dynamic_loss_scale().update)


# Eagerly, every call compiles its lax.cond anew: fewer steps without jit.
@pytest.mark.parametrize("transform, n", [(JIT_OR_NOT[0], 8), (jax.jit, 60)])
def test_dynamic_loss_scale_matches_jmp_fixed_seed(transform, n):
    rng = np.random.default_rng(0)
    finite = rng.random(n) > 0.3
    kinds = rng.choice(["inf", "-inf", "nan"], size=n)
    _run_against_jmp(
        list(zip(finite, kinds, strict=True)),
        init_scale=2.0**4,
        period=3,
        factor=2.0,
        min_scale=1.0,
        update=transform(oa.dynamic_loss_scale().update),
    )


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    steps=st.lists(
        st.tuples(st.booleans(), st.sampled_from(["inf", "-inf", "nan"])),
        max_size=30,
    ),
    init_scale=st.sampled_from([1.0, 3.0, 2.0**15, 1e30, 2.0**126]),
    period=st.integers(1, 5),
    factor=st.sampled_from([1.1, 1.5, 2.0, 3.0, 1e9]),
    min_frac=st.sampled_from([1.0, 0.5, 1e-3]),
)
def test_dynamic_loss_scale_matches_jmp_random(
    steps, init_scale, period, factor, min_frac
):
    _run_against_jmp(
        steps,
        init_scale=init_scale,
        period=period,
        factor=factor,
        min_scale=init_scale * min_frac,
        update=_jitted_update,
    )


@pytest.mark.parametrize("factor", [2.0, 3.0])
def test_dynamic_loss_scale_saturates_at_float32_max(factor):
    tx = oa.dynamic_loss_scale(2.0**127, period=1, factor=factor)
    state = tx.init(None)
    update = jax.jit(tx.update)
    for _ in range(3):
        _, state = update(jnp.ones(2, jnp.float32), state)
        # scale * factor overflows float32: the scale is kept.
        np.testing.assert_array_equal(state.scale, np.float32(2.0**127))
        np.testing.assert_array_equal(state.counter, 0)


def test_dynamic_loss_scale_saturates_at_min_scale():
    """10 / 3, then the floor. The schedule is jmp's ``scale / factor``, a
    float32 division on the backend that runs the step: XLA:CPU's is
    correctly rounded, XLA:GPU's is not (``div.full.f32``, up to 2 ulp:
    openxla/xla#37181), so 10 / 3 is compared with the backend's own
    quotient, which is NumPy's on CPU. A power-of-two factor divides
    exactly everywhere."""
    tx = oa.dynamic_loss_scale(10.0, factor=3.0, min_scale=2.0)
    state = tx.init(None)
    update = jax.jit(tx.update)
    third = np.asarray(jax.jit(jnp.divide)(jnp.float32(10), jnp.float32(3)))
    if jax.default_backend() == "cpu":
        assert third == np.float32(10.0) / np.float32(3.0)
    expected = [third, 2.0, 2.0, 2.0]
    for want in expected:
        _, state = update(jnp.array([jnp.nan], jnp.float32), state)
        np.testing.assert_array_equal(state.scale, np.float32(want))


def test_dynamic_loss_scale_state_survives_flatten_and_jit():
    tx = oa.dynamic_loss_scale(64.0, period=7, factor=4.0, min_scale=16.0)
    state = tx.init(None)
    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == 5
    restored = jax.tree.unflatten(treedef, leaves)
    jitted = jax.jit(lambda s: s)(state)
    for s in (restored, jitted):
        assert isinstance(s, oa.DynamicLossScaleState)
        chex.assert_trees_all_equal(s, state)
        chex.assert_trees_all_equal_dtypes(s, state)
    assert (
        state.scale.dtype == jnp.float32 and state.factor.dtype == jnp.float32
    )
    assert state.min_scale.dtype == jnp.float32
    assert state.counter.dtype == jnp.int32 and state.period.dtype == jnp.int32
    np.testing.assert_array_equal(
        [state.period, state.factor, state.min_scale], [7, 4.0, 16.0]
    )
    # min_scale still applies after the round trip and under jit.
    update = jax.jit(tx.update)
    s = jitted
    for _ in range(3):
        _, s = update(jnp.array([jnp.inf]), s)
    np.testing.assert_array_equal(s.scale, 16.0)


def test_jmp_pytree_drops_min_loss_scale():
    """What our state is contrasted with (jmp 0.0.4, jmp PR #44)."""
    ref = jmp.DynamicLossScale(
        jnp.float32(64.0), min_loss_scale=jnp.float32(16.0)
    )
    leaves, treedef = jax.tree.flatten(ref)
    assert len(leaves) == 2
    np.testing.assert_array_equal(
        jax.tree.unflatten(treedef, leaves).min_loss_scale, 1.0
    )


@pytest.mark.parametrize("transform", JIT_OR_NOT)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dynamic_loss_scale_leaves_followers_untouched(transform, dtype):
    params = {
        "w": jnp.ones((2, 3), jnp.float32),
        "b": jnp.zeros(3, jnp.float32),
    }
    tx = oa.chain(oa.dynamic_loss_scale(2.0**8), optax.adam(0.1))
    state = tx.init(params)
    update = transform(tx.update)

    def grads(scale, bad=False):
        g = {"w": jnp.full((2, 3), 0.5), "b": jnp.arange(3.0)}
        g = jax.tree.map(lambda x: (x * scale).astype(dtype), g)
        if bad:
            g["w"] = g["w"].at[0, 0].set(jnp.inf)
        return g

    for _ in range(2):
        u_ok, state = update(grads(oa.loss_scale(state)), state, params)
        params = optax.apply_updates(params, u_ok)
    before = state
    u, state = update(grads(oa.loss_scale(state), bad=True), state, params)
    # Adam's count, mu and nu: bit-identical.
    chex.assert_trees_all_equal(state[1], before[1])
    chex.assert_trees_all_equal_dtypes(state, before)
    chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, u_ok))
    chex.assert_trees_all_equal_dtypes(u, u_ok)
    np.testing.assert_array_equal(state[0].scale, before[0].scale / 2)
    np.testing.assert_array_equal(state[0].counter, 0)
    # And the next finite step runs Adam again.
    _, state = update(grads(oa.loss_scale(state)), state, params)
    np.testing.assert_array_equal(state[1][0].count, before[1][0].count + 1)


def test_dynamic_loss_scale_apply_gradients_keeps_params():
    params = jnp.array([1.0, 2.0])
    tx = oa.chain(oa.dynamic_loss_scale(4.0), optax.sgd(1.0))
    state = tx.init(params)
    step = jax.jit(functools.partial(oa.apply_gradients, tx))
    new_params, state = step(jnp.array([4.0, jnp.nan]), state, params)
    chex.assert_trees_all_equal(new_params, params)
    np.testing.assert_array_equal(oa.loss_scale(state), 2.0)
    new_params, state = step(jnp.array([2.0, 4.0]), state, params)
    np.testing.assert_array_equal(new_params, [0.0, 0.0])


@pytest.mark.parametrize("transform", JIT_OR_NOT)
def test_dynamic_loss_scale_overflow_not_counted_by_accumulate(transform):
    params = jnp.zeros(2)
    tx = oa.chain(oa.dynamic_loss_scale(8.0), oa.accumulate(3), optax.sgd(1.0))
    state = tx.init(params)
    update = transform(tx.update)
    true_grads = [
        jnp.array([1.0, 2.0]),
        jnp.array([3.0, -1.0]),
        jnp.array([2.0, 5.0]),
    ]
    feed = [true_grads[0], None, true_grads[1], None, true_grads[2]]
    with jax.numpy_dtype_promotion("strict"):
        for i, g in enumerate(feed):
            acc_before = state[1]
            scale = oa.loss_scale(state)
            if g is None:
                g_in = jnp.array([jnp.nan, 1.0]) * scale
            else:
                g_in = g * scale
            u, state = update(g_in, state, params)
            if g is None:  # dropped: the window did not move
                np.testing.assert_array_equal(
                    state[1].mini_step, acc_before.mini_step
                )
                np.testing.assert_array_equal(oa.loss_scale(state), scale / 2)
            if i < len(feed) - 1:
                chex.assert_trees_all_equal(u, jnp.zeros(2))
    # The window closed on the third finite micro-batch with their mean.
    np.testing.assert_allclose(u, -sum(true_grads) / 3, rtol=1e-6)
    np.testing.assert_array_equal(state[1].gradient_step, 1)
    np.testing.assert_array_equal(state[1].mini_step, 0)


def test_dynamic_loss_scale_unscales_before_clipping():
    """dls -> agc -> accumulate(2) -> sgd equals clipping the *unscaled*
    micro-batch gradients (oracle: optax.adaptive_grad_clip, 2-D leaves)."""
    params = {"w": jnp.array([[1.0, -0.5], [0.25, 2.0], [0.1, 0.3]])}
    tx = oa.chain(
        oa.dynamic_loss_scale(2.0**10),
        oa.agc(0.05),
        oa.accumulate(2),
        optax.sgd(1.0),
    )
    state = tx.init(params)
    rng = np.random.default_rng(1)
    gs = [
        {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
        for _ in range(2)
    ]
    clip = optax.adaptive_grad_clip(0.05)
    clipped = [clip.update(g, clip.init(params), params)[0] for g in gs]
    want = jax.tree.map(lambda a, b: -(a + b) / 2, *clipped)
    for g in gs:
        scale = oa.loss_scale(state)
        scaled = jax.tree.map(lambda x, s=scale: x * s, g)
        u, state = tx.update(scaled, state, params)
    chex.assert_trees_all_close(u, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("transform", JIT_OR_NOT)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dynamic_loss_scale_keeps_grad_dtype(transform, dtype):
    tx = oa.dynamic_loss_scale(2.0**10)
    state = tx.init(None)
    g = {
        "a": jnp.array([1024.0, -3072.0, 96.0], dtype),
        "b": jnp.array(512.0, dtype),
    }
    with jax.numpy_dtype_promotion("strict"):
        u, new_state = transform(tx.update)(g, state)
    chex.assert_trees_all_equal_dtypes(u, g)
    chex.assert_trees_all_equal_dtypes(new_state, state)
    want = jax.tree.map(lambda x: np.asarray(x, np.float32) / 1024.0, g)
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x.astype(jnp.float32), u), want, **TOL[dtype]
    )


def test_dynamic_loss_scale_small_min_scale_overflow_after_unscaling():
    """With a scale below 1, unscaling can overflow float16: a skip."""
    tx = oa.dynamic_loss_scale(0.25, min_scale=0.125)
    state = tx.init(None)
    u, state = tx.update(jnp.array([30000.0], jnp.float16), state)
    np.testing.assert_array_equal(u, np.zeros(1, np.float16))
    assert u.dtype == jnp.float16
    np.testing.assert_array_equal(state.scale, 0.125)


@pytest.mark.parametrize("transform", JIT_OR_NOT)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_static_loss_scale_unscales(transform, dtype):
    tx = oa.static_loss_scale(256.0)
    state = tx.init(None)
    assert isinstance(state, oa.StaticLossScaleState)
    assert state.scale.dtype == jnp.float32
    g = {"a": jnp.array([256.0, -512.0, 100.0], dtype)}
    with jax.numpy_dtype_promotion("strict"):
        u, new_state = transform(tx.update)(g, state)
    chex.assert_trees_all_equal_dtypes(u, g)
    chex.assert_trees_all_equal(new_state, state)
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x.astype(jnp.float32), u),
        {"a": np.array([1.0, -2.0, 100.0 / 256.0], np.float32)},
        **TOL[dtype],
    )
    # Non-finite values are passed on, not skipped.
    u, _ = tx.update({"a": jnp.array([jnp.inf, 1.0, 2.0], dtype)}, state)
    assert np.isinf(np.asarray(u["a"][0], np.float32))
    assert not oa.is_gate(tx)


def test_loss_scale_nested_and_absent():
    params = jnp.zeros(3)
    inner = oa.chain(
        oa.dynamic_loss_scale(32.0), oa.accumulate(2), optax.sgd(0.1)
    )
    tx = optax.chain(optax.clip(1.0), oa.chain(optax.identity(), inner))
    state = tx.init(params)
    s = oa.loss_scale(state)
    np.testing.assert_array_equal(s, 32.0)
    assert s.dtype == jnp.float32 and s.shape == ()
    _, state = tx.update(jnp.array([jnp.nan, 0.0, 0.0]), state, params)
    np.testing.assert_array_equal(oa.loss_scale(state), 16.0)
    static = oa.chain(oa.static_loss_scale(8.0), optax.adam(0.1))
    np.testing.assert_array_equal(oa.loss_scale(static.init(params)), 8.0)
    for no_scale in (optax.adam(0.1).init(params), (), optax.EmptyState()):
        s = oa.loss_scale(no_scale)
        np.testing.assert_array_equal(s, 1.0)
        assert s.dtype == jnp.float32 and s.shape == ()
    # Inside jit as well.
    np.testing.assert_array_equal(jax.jit(oa.loss_scale)(state), 16.0)


def _quadratic(params, x):
    return jnp.sum((params["w"] * x) ** 2) + params["b"] ** 3


@pytest.mark.parametrize("transform", JIT_OR_NOT)
def test_scaled_value_and_grad_unscaled_loss_scaled_grads(transform):
    params = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}
    x = jnp.array([3.0, 0.5])
    tx = oa.chain(oa.dynamic_loss_scale(2.0**12), optax.sgd(0.1))
    state = tx.init(params)
    loss, grads = transform(
        lambda p, s, x: oa.scaled_value_and_grad(_quadratic, s)(p, x)
    )(params, state, x)
    ref_loss, ref_grads = jax.value_and_grad(_quadratic)(params, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    chex.assert_trees_all_close(
        grads, jax.tree.map(lambda g: g * 2.0**12, ref_grads), rtol=1e-6
    )
    # Through the chain: the same update as plain sgd on the true grads.
    u, _ = tx.update(grads, state, params)
    chex.assert_trees_all_close(
        u, jax.tree.map(lambda g: -0.1 * g, ref_grads), rtol=1e-6
    )


def test_scaled_value_and_grad_aux_argnums_and_scalar_scale():
    def fun(p, x):
        return jnp.sum(p * x) ** 2, {"pred": p * x}

    p, x = jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0])
    (loss, aux), (gp, gx) = oa.scaled_value_and_grad(
        fun, 8.0, has_aux=True, argnums=(0, 1)
    )(p, x)
    (ref_loss, ref_aux), (rp, rx) = jax.value_and_grad(
        fun, has_aux=True, argnums=(0, 1)
    )(p, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    chex.assert_trees_all_close(aux, ref_aux)
    np.testing.assert_allclose(gp, 8 * rp, rtol=1e-6)
    np.testing.assert_allclose(gx, 8 * rx, rtol=1e-6)
    # No loss scale in the state: scale 1, plain value_and_grad.
    loss, g = oa.scaled_value_and_grad(
        lambda p: fun(p, x)[0], optax.sgd(1.0).init(p)
    )(p)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(g, rp, rtol=1e-6)


def test_scaled_value_and_grad_float16():
    """fp16 loss: the scaled loss is formed in float32, the loss returned in
    float16 and the grads flow back in float16 (and overflow there)."""

    def fun(p):
        return jnp.sum(p * p)

    p = jnp.array([0.5, -1.0], jnp.float16)
    loss, g = oa.scaled_value_and_grad(fun, 2.0**10)(p)
    assert loss.dtype == jnp.float16 and g.dtype == jnp.float16
    np.testing.assert_array_equal(loss, np.float16(1.25))
    np.testing.assert_array_equal(g, np.array([1024.0, -2048.0], np.float16))
    # A scale fp16 cannot hold gives non-finite grads, which the dynamic
    # loss scale then skips.
    _, g = oa.scaled_value_and_grad(fun, 2.0**17)(p)
    assert not np.all(np.isfinite(np.asarray(g, np.float32)))


_DLS, _SLS = oa.dynamic_loss_scale, oa.static_loss_scale
_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "factory, kwargs, exc, match",
    [
        (_DLS, dict(init_scale=0.0), ValueError, "init_scale=0.0"),
        (_DLS, dict(init_scale=-1.0), ValueError, "init_scale=-1.0"),
        (_DLS, dict(init_scale=_INF), ValueError, "init_scale=inf"),
        (_DLS, dict(init_scale=1e39), ValueError, "init_scale=1e"),
        (_DLS, dict(init_scale=_NAN), ValueError, "init_scale=nan"),
        (_DLS, dict(init_scale="1"), TypeError, "init_scale='1'"),
        (_DLS, dict(init_scale=True), TypeError, "init_scale=True"),
        (_DLS, dict(period=0), ValueError, "period=0"),
        (_DLS, dict(period=2.0), TypeError, "period=2.0"),
        (_DLS, dict(period=True), TypeError, "period=True"),
        (_DLS, dict(period=2**31), ValueError, "period=2147483648"),
        (_DLS, dict(factor=1.0), ValueError, "factor=1.0"),
        (_DLS, dict(factor=0.5), ValueError, "factor=0.5"),
        (_DLS, dict(factor=_INF), ValueError, "factor=inf"),
        (_DLS, dict(factor=None), TypeError, "factor=None"),
        (_DLS, dict(min_scale=0.0), ValueError, "min_scale=0.0"),
        (_DLS, dict(min_scale=-1.0), ValueError, "min_scale=-1.0"),
        (_DLS, dict(init_scale=2.0, min_scale=4.0), ValueError, "min_scale=4"),
        (_DLS, dict(axis_name=["d"]), TypeError, "axis_name"),
        (_SLS, dict(scale=0.0), ValueError, "scale=0.0"),
        (_SLS, dict(scale=_INF), ValueError, "scale=inf"),
        (_SLS, dict(scale="2"), TypeError, "scale='2'"),
    ],
)
def test_loss_scale_bad_arguments(factory, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        factory(**kwargs)


def test_dynamic_loss_scale_rejects_foreign_state():
    tx = oa.dynamic_loss_scale()
    with pytest.raises(TypeError, match="DynamicLossScaleState"):
        tx.update(jnp.ones(2), optax.EmptyState())


# ------------------------------------------------------- fp16 end to end


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    return h @ params["w2"] + params["b2"][None, :]


def _mse16(params, x, y):
    err = (_mlp(params, x) - y).astype(jnp.float32)
    return jnp.mean(err**2).astype(jnp.float16)


def test_dynamic_loss_scale_float16_mlp_trains_and_recovers():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(4, 1))).astype(np.float32)
    x16, y16 = jnp.asarray(x, jnp.float16), jnp.asarray(y, jnp.float16)
    params = {
        "w1": jnp.asarray(rng.normal(size=(4, 32)) * 0.5, jnp.float16),
        "b1": jnp.zeros(32, jnp.float16),
        "w2": jnp.asarray(rng.normal(size=(32, 1)) * 0.2, jnp.float16),
        "b2": jnp.zeros(1, jnp.float16),
    }
    tx = oa.chain(
        oa.dynamic_loss_scale(period=10),
        oa.accumulate(2),
        optax.adam(1e-2, eps=1e-4),  # eps representable in float16
    )
    state = tx.init(params)

    @jax.jit
    def step(params, state, xb, yb, poison):
        loss, grads = oa.scaled_value_and_grad(_mse16, state)(params, xb, yb)
        w1 = grads["w1"]  # a forced overflow in one leaf when `poison`
        grads["w1"] = w1.at[0, 0].set(
            jnp.where(poison, jnp.inf, w1[0, 0]).astype(w1.dtype)
        )
        params, state = oa.apply_gradients(tx, grads, state, params)
        return params, state, loss

    full_loss = jax.jit(_mse16)
    first_loss = float(full_loss(params, x16, y16))
    poison_at = 61
    for i in range(120):
        sl = slice((i % 8) * 32, (i % 8 + 1) * 32)
        before = (params, state)
        params, state, loss = step(
            params, state, x16[sl], y16[sl], jnp.asarray(i == poison_at)
        )
        assert loss.dtype == jnp.float16
        if i == poison_at:
            chex.assert_trees_all_equal(params, before[0])
            # The window and Adam as they were; the accumulate's flag says
            # that this call did not step the optimizer.
            assert not bool(oa.has_updated(state))
            kept = before[1][1]._replace(updated=state[1].updated)
            chex.assert_trees_all_equal(state[1:], (kept, *before[1][2:]))
            np.testing.assert_array_equal(
                oa.loss_scale(state),
                np.maximum(1.0, oa.loss_scale(before[1]) / 2),
            )
            loss_at_poison = float(full_loss(params, x16, y16))
    chex.assert_trees_all_equal_dtypes(params, before[0])
    last_loss = float(full_loss(params, x16, y16))
    assert np.isfinite(last_loss)
    assert loss_at_poison < 0.5 * first_loss
    assert last_loss < 0.8 * loss_at_poison  # kept decreasing afterwards
    # Adam stepped once per window of two finite micro-batches.
    assert int(state[1].gradient_step) == int(state[2][0].count)


# ------------------------------------------------------------ multi-device


@pytest.mark.devices(4)
def test_dynamic_loss_scale_pmap_devices_agree():
    n = 4
    devices = jax.devices()[:n]
    tx = oa.chain(
        oa.dynamic_loss_scale(2.0**4, axis_name="d"),
        oa.accumulate(1, axis_name="d"),
        optax.adam(0.1),
    )
    params = jnp.array([1.0, -1.0])
    replicate = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n), t)  # noqa: E731
    params_r, state_r = replicate(params), replicate(tx.init(params))

    step = jax.pmap(
        lambda g, s, p: oa.apply_gradients(tx, g, s, p),
        axis_name="d",
        devices=devices,
    )
    true_g = jnp.arange(2.0 * n).reshape(n, 2)
    # Step 1: finite everywhere: all devices step with the mean gradient.
    params_r, state_r = step(true_g * 16.0, state_r, params_r)
    adam = optax.adam(0.1)
    u, _ = adam.update(true_g.mean(0), adam.init(params), params)
    want = optax.apply_updates(params, u)
    for d in range(n):
        np.testing.assert_allclose(params_r[d], want, rtol=1e-6)
    # Step 2: only device 2 overflows: every device skips.
    before_p, before_s = params_r, state_r
    g = (true_g * 16.0).at[2, 1].set(jnp.inf)
    params_r, state_r = step(g, state_r, params_r)
    chex.assert_trees_all_equal(params_r, before_p)
    # The window and Adam as they were; the accumulate's flag says that
    # this call did not step the optimizer.
    np.testing.assert_array_equal(state_r[1].updated, np.zeros(n, bool))
    kept = before_s[1]._replace(updated=state_r[1].updated)
    chex.assert_trees_all_equal(state_r[1:], (kept, *before_s[2:]))
    np.testing.assert_array_equal(state_r[0].scale, np.full(n, 8.0, np.float32))
    np.testing.assert_array_equal(state_r[0].counter, np.zeros(n, np.int32))
    for d in range(1, n):
        np.testing.assert_array_equal(params_r[d], params_r[0])


@pytest.mark.parametrize(
    "bad, exc",
    [
        (jnp.array([128.0]), ValueError),
        (np.ones((2,)), ValueError),
        ("128", TypeError),
        (jmp.DynamicLossScale(jnp.float32(128.0)), TypeError),
        (jnp.array(-4.0), ValueError),
        (jnp.array(jnp.inf), ValueError),
    ],
)
def test_scaled_value_and_grad_rejects_what_is_not_a_scale(bad, exc):
    """Regression: these fell back to a scale of 1.0 (or went unchecked)."""
    with pytest.raises(exc):
        oa.scaled_value_and_grad(lambda p: jnp.sum(p**2), bad)


def test_scaled_value_and_grad_traced_scale_is_accepted():
    f = jax.jit(
        lambda s, p: oa.scaled_value_and_grad(lambda q: jnp.sum(q**2), s)(p)
    )
    loss, g = f(jnp.float32(4.0), jnp.ones(2))
    np.testing.assert_allclose(g, 4.0 * 2.0 * np.ones(2))


# ------------------------------------------------ calls of weight 0 (padding)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_loss_scale_zero_weight_call_is_not_an_overflow(fused, jit):
    """A weight-0 micro-batch's NaN gradient (0/0 of an
    empty mask) behind ``dynamic_loss_scale`` leaves the scale and its
    counter as they were and passes on: the window is the one of
    ``oa.accumulate`` alone on the unscaled gradients."""
    scale = 8.0
    nan = jnp.array([jnp.nan, jnp.nan])
    calls = [
        (jnp.array([1.0, 2.0]), 1.0),
        (nan, 0.0),
        (jnp.array([3.0, 1.0]), 2.0),
        (jnp.array([jnp.nan, jnp.inf]), 0.0),
        (jnp.array([2.0, -2.0]), 1.0),
        (jnp.array([5.0, 1.0]), 3.0),
    ]
    tx = oa.chain(
        oa.dynamic_loss_scale(scale, period=2), oa.accumulate(2), optax.sgd(1.0)
    )
    ref = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    params = ref_params = jnp.zeros(2)
    state, ref_state = tx.init(params), ref.init(params)

    def step(params, state, g, w):
        if fused:
            return oa.apply_gradients(tx, g, state, params, accum_weight=w)
        u, state = tx.update(g, state, params, accum_weight=w)
        return optax.apply_updates(params, u), state

    step = jax.jit(step) if jit else step
    for g, w in calls:
        before = state[0]
        params, state = step(params, state, g * oa.loss_scale(state), w)
        u, ref_state = ref.update(g, ref_state, ref_params, accum_weight=w)
        ref_params = optax.apply_updates(ref_params, u)
        if w == 0:
            chex.assert_trees_all_equal(state[0], before)
        np.testing.assert_array_equal(
            state[1].mini_step, ref_state[0].mini_step
        )
        np.testing.assert_allclose(params, ref_params, rtol=1e-6)
    # 4 calls with data, all finite: grown twice (period 2).
    assert float(oa.loss_scale(state)) == scale * 4


def test_loss_scale_without_accumulate_passes_zero_weight_call_on():
    """The loss scale alone (no accumulate) also reads a
    weight-0 call as no data: the scale stays, the followers run."""
    tx = oa.chain(oa.dynamic_loss_scale(4.0), optax.scale(0.5))
    state = tx.init(jnp.zeros(1))
    u, new = tx.update(jnp.array([8.0]), state, accum_weight=0)
    np.testing.assert_allclose(u, [1.0])
    chex.assert_trees_all_equal(new, state)


# ---------------------------------------------------------- complex gradients


@pytest.mark.parametrize("part", ["imag", "real"])
def test_loss_scale_overflow_in_a_complex_part(part):
    """An ``inf`` in the imaginary part of a complex
    gradient is an overflow: scale halved, micro-batch not counted."""
    tx = oa.chain(oa.dynamic_loss_scale(4.0), oa.accumulate(2), optax.sgd(1.0))
    params = jnp.zeros(2, jnp.complex64)
    state = tx.init(params)
    bad = complex(1, np.inf) if part == "imag" else complex(np.inf, 1)
    g = jnp.array([bad, 1j], jnp.complex64)
    _, state = tx.update(g, state, params)
    assert float(oa.loss_scale(state)) == 2.0
    assert int(state[1].mini_step) == 0


# ---------------------------------------------- replicas agree on an overflow


@pytest.mark.devices(4)
def test_dynamic_loss_scale_replicas_agree_on_one_device_overflow():
    """With ``axis_name``, one device's
    overflow skips the step on all and every replica's scale and params
    stay equal (no collective after the gate, so a disagreement shows as
    values, not as a crash)."""
    n = 4
    tx = oa.chain(oa.dynamic_loss_scale(16.0, axis_name="d"), optax.sgd(1.0))
    params = jnp.ones(2)
    rep = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n), t)  # noqa: E731
    params_r, state_r = rep(params), rep(tx.init(params))
    step = jax.pmap(
        lambda g, s, p: oa.apply_gradients(tx, g, s, p),
        axis_name="d",
        devices=jax.devices()[:n],
    )
    g = jnp.ones((n, 2)).at[2, 1].set(jnp.inf)
    params_r, state_r = step(g, state_r, params_r)
    np.testing.assert_array_equal(state_r[0].scale, np.full(n, 8.0))
    np.testing.assert_array_equal(params_r, np.ones((n, 2)))
