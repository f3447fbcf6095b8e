"""The loss scale checked once per window: ``oa.chain(oa.accumulate(k),
oa.dynamic_loss_scale(), opt)``.

References: a hand-written loop with the semantics of PyTorch's
``GradScaler`` under accumulation (the scale fixed inside a window, a window
with an overflowing micro-batch dropped, the scale halved, ``period``
counted in windows), and ``jmp.DynamicLossScale`` adjusted once per window.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from flax import serialization
from jax.sharding import NamedSharding

import optaxaccum as oa

K = 3
INIT, PERIOD, FACTOR, MIN = 2.0**10, 2, 2.0, 1.0


def _loss(params, x):
    return 0.5 * jnp.sum((params - x) ** 2 * jnp.arange(1.0, 4.0))


def _batches(n, overflow=(), seed=0):
    """``n`` micro-batches; an inf in those at ``overflow`` (their gradient
    overflows)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    for i in overflow:
        x[i, 1] = np.inf
    return x


def _window_tx(opt, *extra):
    return oa.chain(
        oa.accumulate(K),
        oa.dynamic_loss_scale(
            INIT, period=PERIOD, factor=FACTOR, min_scale=MIN
        ),
        *extra,
        opt,
    )


def _gradscaler_reference(opt, params, xs):
    """PyTorch GradScaler's semantics with accumulation, by hand: per window
    of K micro-batches, the gradients of ``loss * s``; a window with a
    non-finite one is dropped (``s = max(MIN, s / FACTOR)``), else the
    optimizer steps on the unscaled mean and after PERIOD finite windows in
    a row ``s *= FACTOR``. Yields (params, scale, stepped, steps) per call."""
    state, scale, good, steps = opt.init(params), INIT, 0, 0
    grads = []
    for i, x in enumerate(xs):
        grads.append(jax.grad(lambda p: _loss(p, x) * scale)(params))
        if (i + 1) % K:
            yield params, scale, False, steps
            continue
        total = sum(grads[1:], grads[0])
        grads = []
        if not bool(jnp.all(jnp.isfinite(total))):
            scale, good = max(MIN, scale / FACTOR), 0
            yield params, scale, False, steps
            continue
        u, state = opt.update(total / K / scale, state, params)
        params = optax.apply_updates(params, u)
        good, steps = good + 1, steps + 1
        if good == PERIOD:
            scale, good = scale * FACTOR, 0
        yield params, scale, True, steps


def _run(tx, params, xs, *, fused=True, jit=True):
    """Yields (params, state) after each micro-step of ``tx``, the loss
    scaled by the state's scale (``oa.scaled_value_and_grad``)."""

    def step(params, state, x):
        _, g = oa.scaled_value_and_grad(_loss, state)(params, x)
        if fused:
            return oa.apply_gradients(tx, g, state, params)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    step = jax.jit(step) if jit else step
    state = tx.init(params)
    for x in xs:
        params, state = step(params, state, x)
        yield params, state


OVERFLOWS = (1, 7, 8, 15)  # windows 0, 2 and 5 overflow (two in window 2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "update"])
@pytest.mark.parametrize(
    "opt", [optax.adam(0.1), optax.sgd(0.1, momentum=0.9)], ids=["adam", "sgdm"]
)
def test_window_loss_scale_matches_gradscaler(opt, fused):
    """Call by call: params, scale, has_updated and optimizer_step as the
    GradScaler reference (windows dropped, scale halved and grown)."""
    params = jnp.array([1.0, -2.0, 0.5])
    xs = _batches(8 * K, OVERFLOWS)
    ours = _run(_window_tx(opt), params, xs, fused=fused)
    ref = _gradscaler_reference(opt, params, xs)
    stepped_seen = []
    for (p, s), (rp, rs, stepped, steps) in zip(ours, ref, strict=True):
        np.testing.assert_allclose(p, rp, rtol=1e-6, atol=1e-7)
        assert float(oa.loss_scale(s)) == rs
        assert bool(oa.has_updated(s)) == stepped
        assert int(oa.optimizer_step(s)) == steps
        stepped_seen.append(stepped)
    assert sum(stepped_seen) == 5  # 8 windows, 3 dropped


def test_window_loss_scale_matches_jmp_once_per_window():
    """The scale follows jmp.DynamicLossScale adjusted once per window on
    the window's finiteness."""
    xs = _batches(10 * K, (0, 4, 5, 9, 27))
    jmp_scale = jmp.DynamicLossScale(
        jnp.float32(INIT), period=PERIOD, factor=int(FACTOR)
    )
    params = jnp.array([1.0, -2.0, 0.5])
    for t, (_, s) in enumerate(_run(_window_tx(optax.sgd(0.1)), params, xs)):
        if (t + 1) % K == 0:
            window = xs[t + 1 - K : t + 1]
            jmp_scale = jmp_scale.adjust(jnp.all(jnp.isfinite(window)))
        assert float(oa.loss_scale(s)) == float(jmp_scale.loss_scale), t


def test_dropped_window_zeroes_the_accumulator_and_keeps_the_optimizer():
    tx = _window_tx(optax.adam(0.1))
    params = jnp.array([1.0, -2.0, 0.5])
    runs = list(_run(tx, params, _batches(2 * K, (K + 1,))))
    (_, s1), (p2, s2) = runs[K - 1], runs[-1]
    assert int(s2[0].mini_step) == 0 and int(s2[0].gradient_step) == 2
    chex.assert_trees_all_equal(s2[0].acc, jnp.zeros(3))
    chex.assert_trees_all_equal(s2[2], s1[2])  # adam not stepped
    chex.assert_trees_all_equal(p2, runs[K - 1][0])
    assert not bool(oa.has_updated(s2)) and int(oa.optimizer_step(s2)) == 1
    assert int(s2[1].counter) == 0 and float(s2[1].scale) == INIT / FACTOR


def test_noise_scale_estimates_the_unscaled_gradients():
    """The accumulate's noise scale with scaled gradients equals that of
    the same run unscaled; an overflowing window is dropped from it."""
    params = jnp.array([1.0, -2.0, 0.5])
    xs = _batches(4 * K + 2, (K,))  # window 1 overflows; 2 left to flush
    ours = oa.chain(
        oa.accumulate(K, noise_scale_decay=0.5),
        oa.dynamic_loss_scale(INIT, period=100),
        optax.sgd(0.1),
    )
    plain = oa.chain(oa.accumulate(K, noise_scale_decay=0.5), optax.sgd(0.1))
    *_, (p, s) = _run(ours, params, xs)
    finite = np.concatenate([xs[:K], xs[2 * K :]])
    *_, (rp, rs) = _run(plain, params, finite)
    _, s = oa.flush(ours, s, p)  # the last window, closed by flush
    _, rs = oa.flush(plain, rs, rp)
    np.testing.assert_allclose(p, rp, rtol=1e-6)
    got, want = oa.noise_scale(s), oa.noise_scale(rs)
    for a, b in zip(got, want, strict=True):
        assert np.isfinite(float(b))
        np.testing.assert_allclose(a, b, rtol=2e-5)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("value", [6.0e4, np.nan], ids=["f16max", "nan"])
def test_window_overflowing_its_own_dtype_is_dropped(value, jit):
    """A float16 window summed in float32 whose sum is finite but beyond
    float16's range (6e4 + 6e4 > 65504 after unscaling by 1), or NaN, is
    dropped: its float16 updates are not finite. The check reads the
    window's peaks in the updates' dtype, not in the accumulator's."""
    params = {"w": jnp.zeros((2, 3), jnp.float16)}
    tx = oa.chain(
        oa.accumulate(2, reduction="sum"),
        oa.dynamic_loss_scale(1.0, min_scale=0.5),
        optax.sgd(1e-3),
    )
    step = functools.partial(oa.apply_gradients, tx)
    step = jax.jit(step) if jit else step
    state = tx.init(params)
    for g in (6.0e4, value):
        grads = {"w": jnp.full((2, 3), g, jnp.float16)}
        new_params, state = step(grads, state, params)
    assert not oa.has_updated(state)
    chex.assert_trees_all_equal(new_params, params)
    assert float(state[1].scale) == 0.5  # halved


def test_element_between_the_accumulate_and_the_loss_scale_is_checked():
    """An element between the accumulate and the loss scale changes the
    window (``optax.scale(1e38)`` makes it overflow): the loss scale
    checks what it gets, not the window's peaks before that element."""
    params = {"w": jnp.zeros((2, 3))}
    tx = oa.chain(
        oa.accumulate(2),
        optax.scale(1e38),
        oa.dynamic_loss_scale(1.0, min_scale=0.5),
        optax.sgd(1e-3),
    )
    state = tx.init(params)
    for _ in range(2):
        grads = {"w": jnp.full((2, 3), 10.0)}
        new_params, state = jax.jit(functools.partial(oa.apply_gradients, tx))(
            grads, state, params
        )
    assert not oa.has_updated(state)
    chex.assert_trees_all_equal(new_params, params)


def test_agc_after_the_loss_scale_clips_the_window():
    params = jnp.array([1.0, -2.0, 0.5])
    xs = 30.0 * _batches(2 * K)
    agc = oa.agc(0.01)
    ours = _window_tx(optax.sgd(1.0), agc)
    *_, (p, _) = _run(ours, params, xs)
    ref = params
    for w in range(2):
        g = jax.grad(lambda q: sum(_loss(q, x) for x in xs[w * K : w * K + K]))
        u, _ = agc.update(g(ref) / K, agc.init(ref), ref)
        ref = ref - u
    np.testing.assert_allclose(p, ref, rtol=1e-6)


@pytest.mark.parametrize("overflow", [False, True])
def test_flush_closes_the_partial_window(overflow):
    tx = _window_tx(optax.sgd(1.0))
    params = jnp.array([1.0, -2.0, 0.5])
    xs = _batches(2, (1,) if overflow else ())
    *_, (_, s) = _run(tx, params, xs)
    u, s = oa.flush(tx, s, params)
    want = sum(jax.grad(_loss)(params, x) for x in xs) / 2
    np.testing.assert_allclose(u, np.zeros(3) if overflow else -want, rtol=1e-6)
    assert bool(oa.has_updated(s)) is not overflow
    assert int(oa.optimizer_step(s)) == (0 if overflow else 1)
    assert float(oa.loss_scale(s)) == (INIT / FACTOR if overflow else INIT)
    chex.assert_trees_all_equal(s[0].acc, jnp.zeros(3))


def test_checkpoint_round_trip_mid_window():
    """A state saved and restored (flax.serialization) mid-window, and after
    a dropped window, continues as the run that was not interrupted."""
    tx = _window_tx(optax.adam(0.1))
    params = jnp.array([1.0, -2.0, 0.5])
    xs = _batches(4 * K, (2,))
    *_, (p_all, s_all) = _run(tx, params, xs)
    *_, (p, s) = _run(tx, params, xs[: 2 * K - 1])
    blob = serialization.to_bytes(s)
    target = tx.init(jnp.zeros(3))
    s = serialization.from_bytes(target, blob)
    step = jax.jit(
        lambda p, s, x: oa.apply_gradients(
            tx, oa.scaled_value_and_grad(_loss, s)(p, x)[1], s, p
        )
    )
    for x in xs[2 * K - 1 :]:
        p, s = step(p, s, x)
    chex.assert_trees_all_close(p, p_all, rtol=1e-6)
    chex.assert_trees_all_equal(s, s_all)
    assert int(oa.optimizer_step(s)) == 3


# ----------------------------------------------------- apply_if_finite


def test_apply_if_finite_after_the_accumulate_drops_windows():
    """Without a loss scale: a non-finite window is not applied; has_updated
    and optimizer_step say the optimizer did not step."""
    tx = oa.chain(oa.accumulate(2), optax.apply_if_finite(optax.adam(0.1), 3))
    params = jnp.zeros(2)
    s = tx.init(params)
    grads = [[1.0, 2.0], [1.0, 1.0], [jnp.nan, 1.0], [1.0, 1.0], [2.0, 1.0]]
    flags, steps = [], []
    for g in grads + [[1.0, 0.0]]:
        params, s = oa.apply_gradients(tx, jnp.array(g), s, params)
        flags.append(bool(oa.has_updated(s)))
        steps.append(int(oa.optimizer_step(s)))
    assert flags == [False, True, False, False, False, True]
    assert steps == [0, 1, 1, 1, 1, 2]
    assert int(s[1].inner_state[0].count) == 2


# ------------------------------------------------------- multi-device


N = 4


@pytest.mark.devices(N)
@pytest.mark.parametrize("mapper", ["pmap", "shard_map"])
def test_window_loss_scale_across_devices(mapper):
    """One check per window across devices: one device's overflowing
    micro-batch drops the window everywhere; the params match the
    single-device run on the window's whole batch."""
    tx = oa.chain(
        oa.accumulate(2, axis_name="d"),
        oa.dynamic_loss_scale(INIT, period=100, axis_name="d"),
        optax.sgd(0.1),
    )
    params = jnp.array([1.0, -2.0, 0.5])
    xs = _batches(3 * 2 * N).reshape(3 * 2, N, 3)
    xs[2, 3, 0] = np.inf  # window 1, device 3

    def step(p, s, x, varying=False):
        # Under shard_map, the local gradient of replicated params (no psum
        # inside the backward pass).
        local = jax.lax.pcast(p, "d", to="varying") if varying else p
        _, g = oa.scaled_value_and_grad(_loss, s)(local, x)
        return oa.apply_gradients(tx, g, s, p)

    state = tx.init(params)
    if mapper == "pmap":
        rep = lambda t: jax.tree.map(lambda a: jnp.stack([a] * N), t)  # noqa: E731
        fn = jax.pmap(step, axis_name="d", devices=jax.devices()[:N])
        p, s = rep(params), rep(state)
        unrep = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
    else:
        mesh = jax.make_mesh((N,), ("d",), devices=jax.devices()[:N])
        P = jax.sharding.PartitionSpec
        specs = oa.map_accumulators(
            jax.tree.map(lambda _: P(), state), lambda _: P("d")
        )

        def mapped(p, s, x):
            s = oa.map_accumulators(s, lambda a: a[0])
            p, s = step(p, s, x[0], varying=True)
            return p, oa.map_accumulators(s, lambda a: a[None])

        fn = jax.jit(
            jax.shard_map(
                mapped,
                mesh=mesh,
                in_specs=(P(), specs, P("d")),
                out_specs=(P(), specs),
            )
        )

        def put(tree, spec):
            return jax.tree.map(
                lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp)),
                tree,
                spec,
            )

        p = put(params, P())
        s = put(oa.map_accumulators(state, lambda a: jnp.stack([a] * N)), specs)
        unrep = lambda t: t  # noqa: E731
    flags = []
    for t in range(len(xs)):
        x = xs[t] if mapper == "pmap" else put(xs[t], P("d"))
        p, s = fn(p, s, x)
        flags.append(bool(np.all(oa.has_updated(s))))
    assert flags == [False, True, False, False, False, True]
    ref = params
    for w in (0, 2):  # window 1 dropped
        window = xs[2 * w : 2 * w + 2].reshape(-1, 3)
        g = sum(jax.grad(_loss)(ref, x) for x in window) / len(window)
        ref = ref - 0.1 * g
    np.testing.assert_allclose(
        unrep(p) if mapper == "pmap" else p, ref, rtol=1e-5
    )
    assert np.all(np.asarray(oa.loss_scale(s)) == INIT / FACTOR)
    assert np.all(np.asarray(oa.optimizer_step(s)) == 2)


@pytest.mark.devices(N)
def test_window_loss_scale_on_a_jit_mesh():
    """Under jax.jit on an explicit data mesh (unreduced gradients, one
    reduction per window): as the single-device run on the whole batch."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(
        (N,), ("data",), (AxisType.Explicit,), devices=jax.devices()[:N]
    )
    tx = oa.chain(
        oa.accumulate(K, axis_name="data"),
        oa.dynamic_loss_scale(INIT, period=PERIOD),
        optax.adam(0.1),
    )
    xs = _batches(4 * K * N, (5 * N + 2,)).reshape(4 * K, N, 3)

    def batch_loss(p, xb, on_mesh=False):
        if on_mesh:  # a reduced param broadcast to the sharded batch
            p = jnp.broadcast_to(oa.fsdp_gather(p, ("data",)), xb.shape)
            p = jax.reshard(p, jax.typeof(xb).sharding.spec)
        else:
            p = jnp.broadcast_to(p, xb.shape)
        return jnp.mean(jax.vmap(_loss)(p, xb))

    def step(p, s, xb):
        def scaled(f, argnums, has_aux):
            return oa.scaled_value_and_grad(
                f, s, argnums=argnums, has_aux=has_aux
            )

        vg = oa.unreduced_value_and_grad(
            functools.partial(batch_loss, on_mesh=True),
            "data",
            value_and_grad=scaled,
        )
        _, g = vg(p, xb)
        return oa.apply_gradients(tx, g, s, p)

    params = jnp.array([1.0, -2.0, 0.5])
    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        s = jax.jit(tx.init)(p)
        fn = jax.jit(step)
        for xb in xs:
            p, s = fn(p, s, jax.device_put(xb, NamedSharding(mesh, P("data"))))
    # The reference: micro-batch t is the mean over its N examples.
    ref_tx = _window_tx(optax.adam(0.1))
    state, ref = ref_tx.init(params), params
    for xb in xs:
        _, g = oa.scaled_value_and_grad(batch_loss, state)(ref, xb)
        ref, state = oa.apply_gradients(ref_tx, g, state, ref)
    np.testing.assert_allclose(np.asarray(p), ref, rtol=2e-5, atol=1e-6)
    assert int(oa.optimizer_step(s)) == int(oa.optimizer_step(state)) == 3
    assert float(oa.loss_scale(s)) == float(oa.loss_scale(state))


# ----------------------------------------------------------------- Flax


def _fused_reference(tx, params, xs):
    *_, (p, s) = _run(tx, params, xs)
    return p, s


def test_window_loss_scale_in_flax_train_state():
    from optaxaccum.flax import TrainState

    tx = _window_tx(optax.adam(0.1))
    params = jnp.array([1.0, -2.0, 0.5])
    xs = _batches(3 * K, (4,))
    state = TrainState.create(apply_fn=None, params=params, tx=tx)

    @jax.jit
    def step(state, x):
        _, g = oa.scaled_value_and_grad(_loss, state.opt_state)(state.params, x)
        return state.apply_gradients(grads=g)

    for x in xs:
        state = step(state, x)
    want_p, want_s = _fused_reference(tx, params, xs)
    np.testing.assert_allclose(state.params, want_p, rtol=1e-6)
    assert int(state.optimizer_step) == 2 and int(state.step) == 3 * K
    assert float(oa.loss_scale(state.opt_state)) == float(oa.loss_scale(want_s))


def test_window_loss_scale_in_nnx_optimizer():
    from flax import nnx

    from optaxaccum.flax.nnx import Optimizer

    class Vec(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.array([1.0, -2.0, 0.5]))

    model = Vec()
    tx = _window_tx(optax.adam(0.1))
    opt = Optimizer(model, tx, wrt=nnx.Param)
    xs = _batches(3 * K, (4,))

    @nnx.jit
    def step(model, opt, x):
        scale = oa.loss_scale(nnx.as_pure(opt.opt_state))
        grads = nnx.grad(lambda m: _loss(m.w[...], x) * scale)(model)
        opt.update(model, grads)

    for x in xs:
        step(model, opt, x)
    want_p, want_s = _fused_reference(tx, jnp.array([1.0, -2.0, 0.5]), xs)
    np.testing.assert_allclose(model.w[...], want_p, rtol=1e-6)
    assert int(oa.optimizer_step(opt.opt_state)) == 2
    assert float(oa.loss_scale(opt.opt_state)) == float(oa.loss_scale(want_s))
