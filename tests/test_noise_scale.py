"""Gradient noise scale from the window (docs/noise_scale.md).

Outside truths:

* synthetic micro-batch gradients ``g_i = G + e_i``, ``e_i ~ N(0, s2/w_i I)``
  in ``D`` dimensions: ``tr(Sigma) = D s2`` per unit of weight, ``|G|^2``
  known, ``b_simple = D s2 / |G|^2``; tolerances from the estimator's
  variance, derived where used;
* a brute-force numpy formula in the residual form
  ``sum_i w_i |g_i - g_bar|^2 / (k - 1)`` (the library uses ``W (A - C)``);
* per-example gradients of an MLP on sklearn's digits (``jax.vmap`` of
  ``jax.grad``) over the whole training set.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.flatten_util import ravel_pytree

import optaxaccum as oa
from tests import helpers

D = helpers.NOISE_DIM  # dimensions of the synthetic gradient
K = 4  # micro-batches per window
S2 = helpers.NOISE_VARIANCE  # per-unit-of-weight noise variance
G = jnp.full(D, helpers.NOISE_MEAN)  # |G|^2 = 16: b_simple = D S2 / |G|^2 = 4
G_SQ = float(G @ G)
TRACE = D * S2


def _run(tx, grads, weights, fused):
    """Feeds the micro-batches through ``tx`` in one ``lax.scan``."""
    params = jnp.zeros(D)

    def step(carry, gw):
        params, state = carry
        g, w = gw
        if fused:
            return oa.apply_gradients(tx, g, state, params, accum_weight=w), 0
        u, state = tx.update(g, state, params, accum_weight=w)
        return (optax.apply_updates(params, u), state), 0

    (_, state), _ = lax.scan(step, (params, tx.init(params)), (grads, weights))
    return state


def _tx(decay, k=K, **kwargs):
    return oa.chain(
        oa.accumulate(k, noise_scale_decay=decay, **kwargs), optax.sgd(0.0)
    )


WEIGHTS = {"equal": (4.0, 4.0, 4.0, 4.0), "unequal": (1.0, 2.0, 5.0, 8.0)}


@pytest.mark.parametrize("fused,weights", [(False, "equal"), (True, "unequal")])
def test_single_window_estimates_are_unbiased_over_seeds(fused, weights):
    """decay 0: the last window's estimates, for 4096 seeds (vmapped).

    Variance, for any fixed weights (W = sum w_i = 16 here): per coordinate
    sum_i w_i (x_i - x_bar)^2 = S2 chi2_{k-1}, so Var(trace) =
    2 D S2^2 / (k - 1). The weighted mean g_bar ~ N(G, S2/W I) is
    independent of the residuals and grad_sq = |g_bar|^2 - trace / W, so
    Var(grad_sq) = 4 |G|^2 S2 / W + 2 D S2^2 / W^2 + 2 D S2^2 /
    ((k - 1) W^2). The seed mean's standard error is sqrt(Var / seeds);
    we allow 5 of them (two-sided miss probability 6e-7 each).
    """
    seeds, w = 4096, WEIGHTS[weights]
    big_w = sum(w)

    def one(key):
        grads, ws = helpers.noisy_gradients(key, w, 1)
        return oa.noise_scale(_run(_tx(0.0), grads, ws, fused))

    est = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), seeds))
    var_trace = 2 * D * S2**2 / (K - 1)
    var_gsq = 4 * G_SQ * S2 / big_w + var_trace * (K / big_w**2)
    se_trace = math.sqrt(var_trace / seeds)
    se_gsq = math.sqrt(var_gsq / seeds)
    print(
        f"seed means: trace {float(est.trace_cov.mean()):.4f} (truth {TRACE},"
        f" SE {se_trace:.4f}), |G|^2 {float(est.grad_sq.mean()):.4f} (truth"
        f" {G_SQ}, SE {se_gsq:.4f})"
    )
    assert abs(float(est.trace_cov.mean()) - TRACE) < 5 * se_trace
    assert abs(float(est.grad_sq.mean()) - G_SQ) < 5 * se_gsq
    # the per-seed spread matches the derived variance (within 10%: the
    # sample variance of 4096 near-normal draws has a 2.2% relative SD)
    np.testing.assert_allclose(float(est.trace_cov.var()), var_trace, rtol=0.1)
    np.testing.assert_allclose(float(est.grad_sq.var()), var_gsq, rtol=0.1)


@pytest.mark.parametrize("fused,weights", [(False, "equal"), (True, "unequal")])
def test_moving_average_lands_on_the_true_noise_scale(fused, weights):
    """decay 0.995 over 2000 windows: the averages are weighted means of
    independent window estimates with normalized weights a_j, so their
    relative standard error is sqrt(sum a_j^2) times a window's relative
    SD: 0.102 for the trace (sqrt(2 / ((k - 1) D))), 0.135 for |G|^2
    (sqrt(Var(grad_sq)) / |G|^2 with W = 16, formula above). They are
    independent, so b_simple's relative SE is sqrt(sum a_j^2) * 0.169
    (0.9%); we allow 4 of them, about 3.4%."""
    decay, windows = 0.995, 2000
    grads, ws = helpers.noisy_gradients(
        jax.random.key(1), WEIGHTS[weights], windows
    )
    state = jax.jit(_run, static_argnums=(0, 3))(_tx(decay), grads, ws, fused)
    est = oa.noise_scale(state)
    a = (1 - decay) * decay ** np.arange(windows)
    a /= a.sum()
    rel = math.sqrt((a**2).sum())
    big_w = sum(WEIGHTS[weights])
    rel_trace = math.sqrt(2 / ((K - 1) * D))
    var_gsq = 4 * G_SQ * S2 / big_w + 2 * D * S2**2 * K / ((K - 1) * big_w**2)
    rel_gsq = math.sqrt(var_gsq) / G_SQ
    np.testing.assert_allclose(
        float(est.trace_cov), TRACE, rtol=4 * rel * rel_trace
    )
    np.testing.assert_allclose(float(est.grad_sq), G_SQ, rtol=4 * rel * rel_gsq)
    rel_b = rel * math.hypot(rel_trace, rel_gsq)
    print(f"EMA b_simple {float(est.b_simple):.4f}, truth {TRACE / G_SQ}")
    np.testing.assert_allclose(
        float(est.b_simple), TRACE / G_SQ, rtol=4 * rel_b
    )
    assert 4 * rel_b < 0.04  # "within a few percent"


def _window(tx, grads, weights, params=None):
    params = jnp.zeros(D) if params is None else params
    state, update = tx.init(params), jax.jit(tx.update)
    for g, w in zip(grads, weights):
        _, state = update(g, state, params, accum_weight=w)
    return state


def _assert_brute(state, grads, weights, rtol=2e-5):
    trace, gsq = helpers.brute_noise(grads, weights)
    est = oa.noise_scale(state)
    np.testing.assert_allclose(float(est.trace_cov), trace, rtol=rtol)
    np.testing.assert_allclose(float(est.grad_sq), gsq, rtol=rtol)
    np.testing.assert_allclose(float(est.b_simple), trace / gsq, rtol=rtol)


def test_padding_weight_zero_micro_batch_does_not_count():
    """A fully padded micro-batch (weight 0, 0/0 gradient) adds nothing:
    the estimate is that of the other three (k = 3, not 4)."""
    grads, ws = helpers.noisy_gradients(
        jax.random.key(2), (1.0, 2.0, 3.0, 1.0), 1
    )
    grads = grads.at[1].set(jnp.nan)
    ws = ws.at[1].set(0.0)
    _assert_brute(_window(_tx(0.0), grads, ws), grads, ws)


def test_skip_nonfinite_dropped_micro_batch_does_not_count():
    """A dropped micro-batch is as if never seen: the window takes a fifth
    one and the estimate is that of the four counted."""
    grads, ws = helpers.noisy_gradients(
        jax.random.key(3), (1.0, 2.0, 3.0, 1.0, 2.0), 1
    )
    grads = grads.at[2].set(jnp.inf)
    state = _window(_tx(0.0, skip_nonfinite=True), grads, ws)
    keep = np.array([0, 1, 3, 4])
    _assert_brute(state, grads[keep], ws[keep])


def test_flush_closes_the_window_with_its_micro_batches():
    """flush after 3 of 5: the estimate of those 3; a flushed window of one
    micro-batch (k < 2) changes nothing, also not the averages."""
    tx = _tx(0.0, k=5)
    grads, ws = helpers.noisy_gradients(
        jax.random.key(4), (1.0, 3.0, 2.0, 1.0), 1
    )
    params = jnp.zeros(D)
    state = _window(tx, grads[:3], ws[:3])
    _, state = jax.jit(lambda s: oa.flush(tx, s, params))(state)
    _assert_brute(state, grads[:3], ws[:3])
    before = oa.noise_scale(state)
    _, state = tx.update(grads[3], state, params, accum_weight=ws[3])
    _, state = oa.flush(tx, state, params)
    assert int(state[0].gradient_step) == 2
    chex.assert_trees_all_equal(oa.noise_scale(state), before)


def test_nan_until_a_window_of_two_and_windows_of_one_change_nothing():
    state = _window(
        _tx(0.5, k=1), *helpers.noisy_gradients(jax.random.key(5), (1.0,), 5)
    )
    assert int(state[0].gradient_step) == 5
    assert all(np.isnan(x) for x in oa.noise_scale(state))


def test_checkpoint_round_trip_continues_to_the_same_estimate():
    """Mid-window: the state through host numpy and back into the structure
    of ``jax.eval_shape(tx.init, params)`` continues like the original."""
    tx = _tx(0.8)
    grads, ws = helpers.noisy_gradients(
        jax.random.key(6), (1.0, 2.0, 3.0, 4.0), 3
    )
    params = jnp.zeros(D)
    state = _window(tx, grads[:6], ws[:6])
    saved = jax.device_get(state)
    restored = jax.tree.unflatten(
        jax.tree.structure(jax.eval_shape(tx.init, params)),
        [jnp.asarray(x) for x in jax.tree.leaves(saved)],
    )
    for g, w in zip(grads[6:], ws[6:]):
        _, state = tx.update(g, state, params, accum_weight=w)
        _, restored = tx.update(g, restored, params, accum_weight=w)
    chex.assert_trees_all_equal(restored, state)
    # and the result is the truth: the decayed mean of the three windows
    est = [
        helpers.brute_noise(grads[i : i + 4], ws[i : i + 4]) for i in (0, 4, 8)
    ]
    a = np.array([0.2 * 0.8**2, 0.2 * 0.8, 0.2]) / (1 - 0.8**3)
    trace = sum(ai * e[0] for ai, e in zip(a, est))
    np.testing.assert_allclose(
        float(oa.noise_scale(state).trace_cov), trace, rtol=2e-5
    )


def test_fresh_state_can_be_donated():
    """Every leaf of a new state is its own buffer (jit rejects donating
    one buffer twice)."""
    tx = _tx(0.9)
    params = jnp.zeros(D)
    step = jax.jit(
        lambda p, s, g: oa.apply_gradients(tx, g, s, p), donate_argnums=(0, 1)
    )
    params, state = step(params, tx.init(params), jnp.ones(D))
    assert int(state[0].mini_step) == 1


def test_off_by_default_no_state_and_value_error():
    tx = oa.chain(oa.accumulate(2), optax.adam(0.1))
    state = tx.init(jnp.zeros(3))
    assert state[0].noise_scale is None
    with pytest.raises(ValueError, match="noise_scale_decay"):
        oa.noise_scale(state)
    with pytest.raises(ValueError, match="noise_scale_decay"):
        oa.accumulate(oa.critical_batch_every_k(1, 4, micro_batch_weight=8))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(noise_scale_decay=1.0), ValueError, "noise_scale_decay"),
        (dict(noise_scale_decay=-0.1), ValueError, "noise_scale_decay"),
        (dict(noise_scale_decay="0.9"), TypeError, "noise_scale_decay"),
        (dict(noise_scale_decay=True), TypeError, "noise_scale_decay"),
    ],
)
def test_bad_noise_scale_decay(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        oa.accumulate(2, **kwargs)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((0, 4), dict(micro_batch_weight=1), ValueError, "min_k"),
        ((4, 2), dict(micro_batch_weight=1), ValueError, "max_k"),
        ((1, 2.5), dict(micro_batch_weight=1), TypeError, "max_k"),
        ((1, 4), dict(micro_batch_weight=0), ValueError, "micro_batch_weight"),
        (
            (1, 4),
            dict(micro_batch_weight=1, fraction=math.inf),
            ValueError,
            "fraction",
        ),
        ((1, 4), dict(micro_batch_weight="8"), TypeError, "micro_batch_weight"),
    ],
)
def test_bad_critical_batch_every_k(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        oa.critical_batch_every_k(*args, **kwargs)


# ------------------------------------------------------- real model: digits


def _digits_problem():
    from sklearn.datasets import load_digits

    data, target = load_digits(return_X_y=True)
    x = jnp.asarray(data / 16.0, jnp.float32)
    y = jnp.asarray(target, jnp.int32)
    k1, k2 = jax.random.split(jax.random.key(7))
    params = {
        "w1": jax.random.normal(k1, (64, 16)) / 8.0,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 10)) / 4.0,
        "b2": jnp.zeros(10),
    }

    def per_example(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"][None])
        logits = h @ p["w2"] + p["b2"][None]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    return x, y, params, per_example


def test_digits_mlp_agrees_with_per_example_gradients():
    """Brute force: the per-example gradients of all 1797 digits
    (``jax.vmap(jax.grad)``) give G and tr(Sigma) of the data set directly.
    Windows of 8 padded micro-batches (5 to 16 real examples of 16, drawn
    with replacement, per-example mean loss, ``accum_weight`` = real
    count) are then exactly the synthetic model's: each micro-batch
    gradient has mean G and covariance Sigma / m_i. 512 windows' estimates
    (decay 0, vmapped); their mean is within 4 standard errors (the
    estimates' sample SD / sqrt(512)) of the truth."""
    x, y, params, per_example = _digits_problem()
    n, windows, k, m = x.shape[0], 512, 8, 16

    def one_grad(p, xi, yi):
        return jax.grad(lambda p: per_example(p, xi[None], yi[None])[0])(p)

    flat = jax.vmap(lambda xi, yi: ravel_pytree(one_grad(params, xi, yi))[0])(
        x, y
    )
    mean = flat.mean(0)
    true_trace = float(((flat - mean[None]) ** 2).sum(1).mean())
    true_gsq = float(mean @ mean)

    def masked_loss(p, idx, mask):
        return (mask * per_example(p, x[idx], y[idx])).sum() / mask.sum()

    tx = oa.chain(oa.accumulate(k, noise_scale_decay=0.0), optax.sgd(0.0))

    def one_window(key):
        k_idx, k_cnt = jax.random.split(key)
        idx = jax.random.randint(k_idx, (k, m), 0, n)
        counts = jax.random.randint(k_cnt, (k,), 5, m + 1)
        mask = (jnp.arange(m)[None] < counts[:, None]).astype(jnp.float32)

        def step(state, batch):
            i, msk = batch
            g = jax.grad(masked_loss)(params, i, msk)
            return oa.apply_gradients(
                tx, g, state, params, accum_weight=msk.sum()
            )[1], 0

        state, _ = lax.scan(step, tx.init(params), (idx, mask))
        return oa.noise_scale(state)

    keys = jax.random.split(jax.random.key(8), windows)
    est = jax.jit(jax.vmap(one_window))(keys)
    for got, want in ((est.trace_cov, true_trace), (est.grad_sq, true_gsq)):
        got = np.asarray(got, np.float64)
        se = got.std(ddof=1) / math.sqrt(windows)
        print(
            f"digits: estimate {got.mean():.4f} +- {se:.4f}, truth {want:.4f}"
        )
        assert abs(got.mean() - want) < 4 * se, (got.mean(), want, se)
        assert se < 0.1 * want  # the check has teeth: 10% or better


# ------------------------------------------------------------ multi-device

AXIS, NDEV = "d", 4


def _device_step(tx):
    """Each device's micro-batch gradient and weight are its own inputs."""

    def step(params, state, g, w):
        return oa.apply_gradients(tx, g, state, params, accum_weight=w)

    return step


def _pmapped(tx):
    return jax.pmap(
        _device_step(tx), axis_name=AXIS, devices=jax.devices()[:NDEV]
    )


def _shard_mapped(tx):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(
        (NDEV,),
        (AXIS,),
        devices=jax.devices()[:NDEV],
        axis_types=(jax.sharding.AxisType.Explicit,),
    )
    specs = oa.map_accumulators(
        jax.tree.map(lambda _: P(), tx.init(jnp.zeros(D))), lambda _: P(AXIS)
    )
    step = _device_step(tx)

    def body(p, s, g, w):
        s = oa.map_accumulators(s, lambda a: a[0])
        p, s = step(p, s, g[0], w[0])
        return p, oa.map_accumulators(s, lambda a: a[None])

    in_specs = (P(), specs, P(AXIS), P(AXIS))
    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=(P(), specs),
        )
    )

    def put(*args):  # each argument placed as its spec says
        return jax.tree.map(
            lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
            args,
            in_specs,
        )

    return fn, put


class _Placed:
    """``fn`` called (or lowered) on arguments placed by ``put``."""

    def __init__(self, fn, put):
        self.fn, self.put = fn, put

    def __call__(self, *args):
        return self.fn(*self.put(*args))

    def lower(self, *args):
        return self.fn.lower(*self.put(*args))


def _device_inputs(runner, tx):
    if runner == "pmap":
        params = jnp.zeros((NDEV, D))
        state = jax.tree.map(
            lambda a: jnp.broadcast_to(a, (NDEV, *a.shape)),
            tx.init(jnp.zeros(D)),
        )
        return _pmapped(tx), params, state
    fn, put = _shard_mapped(tx)
    state = oa.map_accumulators(
        tx.init(jnp.zeros(D)), lambda a: jnp.broadcast_to(a, (NDEV, *a.shape))
    )
    return _Placed(fn, put), jnp.zeros(D), state


@pytest.mark.devices(4)
@pytest.mark.parametrize(
    "runner,reduction",
    [("pmap", "mean"), ("pmap", "sum"), ("shard_map", "mean")],
)
def test_devices_micro_batches_are_the_small_batches(runner, reduction):
    """4 devices x 2 micro-steps: k = 8 device micro-batches (one of weight
    0 with a NaN gradient: 7 count); the estimate is the brute force over
    all of them, on every device, whatever the window emits."""
    tx = _tx(0.0, k=2, axis_name=AXIS, reduction=reduction)
    fn, params, state = _device_inputs(runner, tx)
    w = np.array([[1.0, 2.0, 0.0, 4.0], [3.0, 1.0, 2.0, 5.0]], np.float32)
    grads, _ = helpers.noisy_gradients(jax.random.key(9), (1.0,) * 8, 1)
    grads = grads.reshape(2, NDEV, D).at[0, 2].set(jnp.nan)
    for t in range(2):
        params, state = fn(params, state, grads[t], jnp.asarray(w[t]))
    est = jax.tree.map(np.asarray, oa.noise_scale(state))
    if runner == "pmap":  # one copy per device, all equal
        assert all(np.all(x == x[0]) for x in est)
        est = jax.tree.map(lambda x: x[0], est)
    trace, gsq = helpers.brute_noise(grads.reshape(8, D), w.reshape(8))
    np.testing.assert_allclose(est.trace_cov, trace, rtol=2e-5)
    np.testing.assert_allclose(est.grad_sq, gsq, rtol=2e-5)


@pytest.mark.devices(4)
@pytest.mark.parametrize("runner", ["pmap", "shard_map"])
def test_hlo_no_collective_added_per_micro_batch(runner):
    """Compiled micro-step with the estimate on: still no collective at the
    top level (every micro-step); in the closing branch the gradient tree
    and the weight as before plus the two scalars (sq_sum, count: 8 bytes)
    of the estimate, in one more small all-reduce at most."""
    from tests import hlo_queries as hlo

    def census(decay):
        tx = _tx(decay, k=2, axis_name=AXIS)
        fn, params, state = _device_inputs(runner, tx)
        g = jnp.ones((NDEV, D))
        w = jnp.ones(NDEV)
        return hlo.summarize(fn.lower(params, state, g, w).compile().as_text())

    off, on = census(None), census(0.9)
    assert off["top_ops"] == on["top_ops"] == 0, (off, on)
    assert on["true_branch_only"], on
    assert on["branch_bytes"] == off["branch_bytes"] + 8 == 4 * D + 4 + 8
    assert on["branch_ops"] <= off["branch_ops"] + 1, (off, on)


# ------------------------------------------------- critical_batch_every_k


def _window_lengths(tx, grads):
    """The length of every closed window (from ``gradient_step``)."""
    params = jnp.zeros(D)

    def step(state, g):
        state = oa.apply_gradients(tx, g, state, params)[1]
        return state, state[0].gradient_step

    _, steps = jax.jit(lambda g: lax.scan(step, tx.init(params), g))(grads)
    ends = np.flatnonzero(np.diff(np.concatenate([[0], steps])))
    return np.diff(np.concatenate([[-1], ends]))


def test_critical_batch_windows_follow_a_jump_in_the_noise_scale():
    """Phase 1: |G|^2 = 256, b_simple = 64 / 256 = 0.25 micro-batches ->
    windows of min_k = 2 (a window's estimate: trace +-18%, |G|^2 +-9%, so
    b stays far below 1). Phase 2: |G|^2 = 0.16, b_simple = 400 -> max_k
    = 16. The average of |G|^2 forgets phase 1 at rate 0.5 per window: j
    windows after the jump it is about 256 / 2^j, so the window is about
    2^(j - 2) micro-batches and reaches 16 at j = 6; we allow 8. Then it
    stays: with W = 16 an average of |G|^2 above 1.9 (b < 34) has
    probability below 1e-4."""
    tx = _tx(0.5, k=oa.critical_batch_every_k(2, 16, micro_batch_weight=1))
    noise = jax.random.normal(jax.random.key(10), (40 + 16 * 16, D))
    g = jnp.concatenate([2.0 + noise[:40], 0.05 + noise[40:]])
    lengths = _window_lengths(tx, g)
    assert list(lengths[:20]) == [2] * 20, lengths
    after = lengths[20:]
    assert after[0] <= 4 and list(after[8:]) == [16] * len(after[8:])
    assert len(after) >= 12, lengths


def test_critical_batch_min_k_1_on_one_device_is_refused():
    """min_k = 1 on one device: windows of one micro-batch give no estimate
    (it needs two micro-batches), so b_simple would stay NaN and every
    window keep min_k, however noisy the gradients: refused when the
    accumulate is built, naming min_k. With axis_name each micro-batch is
    one per device, and min_k = 1 is accepted."""
    every_k = oa.critical_batch_every_k(1, 16, micro_batch_weight=1)
    with pytest.raises(ValueError, match="min_k=1") as info:
        oa.accumulate(every_k, noise_scale_decay=0.5)
    assert "min_k >= 2" in str(info.value)
    oa.accumulate(every_k, noise_scale_decay=0.5, axis_name="data")


def test_critical_batch_window_rounds_up():
    """The window length is ceil(fraction * b_simple / micro_batch_weight):
    an estimate asking for 2.5 micro-batches gives 3. Gradients 4 and 2
    (decay 0, weights 1): |G|^2 = (2 * 9 - 10) / 1 = 8, tr(Sigma) =
    2 * (10 - 9) / 1 = 2, b_simple = 0.25, exact in float32; fraction 10
    asks for 2.5. The first window has min_k = 2 (no estimate yet), the
    second then closes at call 2 + 3 = 5."""
    every_k = oa.critical_batch_every_k(
        2, 16, micro_batch_weight=1, fraction=10.0
    )
    tx = oa.chain(oa.accumulate(every_k, noise_scale_decay=0.0), optax.sgd(1.0))
    params = jnp.zeros(1)
    state = tx.init(params)
    closed = []
    for g in (4.0, 2.0, 1.0, 1.0, 1.0):
        _, state = tx.update(jnp.array([g]), state, params)
        closed.append(int(state[0].gradient_step))
        if len(closed) == 2:
            assert float(oa.noise_scale(state).b_simple) == 0.25
            assert int(every_k.window(state[0].noise_scale)) == 3
    assert closed == [0, 1, 1, 1, 2]


# ------------------------------------------------------ flax integrations


def test_noise_scale_in_flax_train_state_and_nnx_optimizer():
    """``oa.noise_scale`` reads a linen TrainState's and an nnx Optimizer's
    ``opt_state``; the estimate is the brute force over the window."""
    from flax import nnx

    from optaxaccum.flax import TrainState
    from optaxaccum.flax import nnx as oa_nnx

    grads, ws = helpers.noisy_gradients(jax.random.key(12), (1.0, 3.0, 2.0), 1)
    tx = _tx(0.0, k=3)
    state = TrainState.create(apply_fn=None, params=jnp.zeros(D), tx=tx)
    for g, w in zip(grads, ws):
        state = state.apply_gradients(grads=g, accum_weight=w)
    _assert_brute(state.opt_state, grads, ws)

    model = nnx.Linear(D, 1, use_bias=False, rngs=nnx.Rngs(0))
    opt = oa_nnx.Optimizer(model, _tx(0.0, k=3), wrt=nnx.Param)
    for g, w in zip(grads, ws):
        tree = jax.tree.map(
            lambda _, g=g: g[:, None], nnx.state(model, nnx.Param)
        )
        opt.update(model, tree, accum_weight=w)
    _assert_brute(opt.opt_state, grads, ws)


# ------------------------------------------------------- jit meshes

MESH_SHAPES = {"data8": (8,), "data2xfsdp4": (2, 4)}


def _mesh_problem(name):
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    shape = MESH_SHAPES[name]
    names = ("data", "fsdp")[: len(shape)]
    mesh = jax.make_mesh(
        shape, names, axis_types=(AxisType.Explicit,) * len(shape)
    )
    fsdp = "fsdp" if "fsdp" in names else None
    specs = {"w": P(fsdp, None), "v": P()}
    rng = np.random.default_rng(13)
    params = {
        "w": rng.normal(size=(8, 4)).astype(np.float32) / 3,
        "v": rng.normal(size=(4, 4)).astype(np.float32) / 2,
    }
    x = rng.normal(size=(4, 16, 8)).astype(np.float32)  # 4 micro-steps
    y = rng.normal(size=(4, 16, 4)).astype(np.float32)
    return mesh, specs, params, x, y


def _mesh_loss(params, x, y):
    from jax.sharding import PartitionSpec as P

    def gather(a):  # keep the reduced axes (docs/scaling.md)
        return jax.reshard(a, P(None, None, reduced={"data"}))

    pred = (x @ gather(params["w"])) @ gather(params["v"])
    return ((pred - y) ** 2).sum() / x.shape[0]


def _mesh_run(name, decay, *, compile_only=False, checkpoint_at=None):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh, specs, params, x, y = _mesh_problem(name)
    tx = _tx(decay, k=2, axis_name="data")
    grad = oa.unreduced_value_and_grad(_mesh_loss, "data")

    def step(p, s, xb, yb):
        g = grad(p, xb, yb)[1]
        return oa.apply_gradients(tx, g, s, p, accum_weight=16.0)

    with jax.set_mesh(mesh):
        p = {
            k: jax.device_put(v, NamedSharding(mesh, specs[k]))
            for k, v in params.items()
        }
        s = jax.jit(tx.init)(p)
        batch = P("data", None)
        put = lambda a: jax.device_put(a, NamedSharding(mesh, batch))  # noqa: E731
        fn = jax.jit(step)
        if compile_only:
            return mesh, fn.lower(p, s, put(x[0]), put(y[0])).compile()
        types = jax.tree.map(jax.typeof, s)
        for t in range(len(x)):
            if t == checkpoint_at:  # a host copy and back, as orbax does
                host = jax.device_get(s)
                s = jax.device_put(host, oa.state_shardings(tx, p))
            p, s = fn(p, s, put(x[t]), put(y[t]))
        # init already gives the micro-steps' types: jit compiles once
        assert jax.tree.map(jax.typeof, s) == types
        return mesh, jax.device_get(oa.noise_scale(s))


@pytest.mark.devices(8)
@pytest.mark.parametrize("name", list(MESH_SHAPES))
def test_jit_mesh_device_shares_are_the_small_batches(name):
    """jit with oa.unreduced_value_and_grad on data8 and data2 x fsdp4: each
    data device's share of a micro-batch (16 / n_data examples, the mean
    loss's equal shares) is a small batch. Truth: the brute force over the
    single-device gradients of each share, for the last window (2 micro-
    steps x n_data shares)."""
    mesh, specs, params, x, y = _mesh_problem(name)
    n = mesh.shape["data"]
    shares = []
    for t in (2, 3):
        for d in range(n):
            sl = slice(d * 16 // n, (d + 1) * 16 // n)
            shares.append(
                ravel_pytree(
                    jax.grad(
                        lambda p: (
                            ((x[t, sl] @ p["w"] @ p["v"] - y[t, sl]) ** 2)
                            .sum(-1)
                            .mean()
                        )
                    )(params)
                )[0]
            )
    trace, gsq = helpers.brute_noise(np.stack(shares), np.full(2 * n, 16.0 / n))
    _, est = _mesh_run(name, 0.0)
    np.testing.assert_allclose(est.trace_cov, trace, rtol=1e-4)
    np.testing.assert_allclose(est.grad_sq, gsq, rtol=1e-4)


@pytest.mark.devices(8)
def test_jit_mesh_state_round_trips_mid_window():
    """The estimate's per-device sum of squares is state (API.md section 9):
    on a jit mesh it must survive jax.device_get mid-window (each device's
    own partial sum, stored stacked like the accumulator) and the restored
    run lands on the uninterrupted run's estimate."""
    _, straight = _mesh_run("data2xfsdp4", 0.5)
    _, resumed = _mesh_run("data2xfsdp4", 0.5, checkpoint_at=1)
    np.testing.assert_allclose(resumed.trace_cov, straight.trace_cov, rtol=1e-6)
    np.testing.assert_allclose(resumed.grad_sq, straight.grad_sq, rtol=1e-6)


@pytest.mark.devices(8)
def test_jit_mesh_no_collective_added_per_micro_batch():
    """data2 x fsdp4: with the estimate on, the collectives run on every
    micro-step are those without it; the closing branch reduces 4 more
    bytes (the float32 sum of squares)."""
    from optaxaccum._src import collectives

    mesh, off = _mesh_run("data2xfsdp4", None, compile_only=True)
    _, on = _mesh_run("data2xfsdp4", 0.9, compile_only=True)
    off = oa.collective_census(off, mesh)
    on = oa.collective_census(on, mesh)

    def top(ops):
        return sorted(
            (o["op"], o["bytes"], tuple(sorted(o["axes"])))
            for o in ops
            if not o["branches"]
        )

    assert top(on) == top(off), (on, off)
    branch_bytes = [
        sum(o["bytes"] for o in collectives.over(ops, "data", top=False))
        for ops in (off, on)
    ]
    assert branch_bytes[1] == branch_bytes[0] + 4, (on, off)


@pytest.mark.parametrize("name", list(MESH_SHAPES))
@pytest.mark.devices(8)
def test_jit_mesh_init_gives_plain_shardings(name):
    """``jax.jit(tx.init)`` under an explicit mesh: every leaf of the state
    comes out with a NamedSharding (the scalars replicated, ``P()``), so a
    later ``jit`` takes it. jax 0.12 gives the jit's scalar zeros the
    sharding ``GSPMDSharding({unreduced})`` (which the next ``jit`` cannot
    read) when the same function reshards a zero to unreduced; plain JAX::

        mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

        def f():
            a, z = jnp.zeros([]), jnp.zeros([])
            u = jax.reshard(z, P(unreduced={"data"}))
            s = jax.shard_map(lambda b: b[None], in_specs=P(unreduced={"data"}),
                              out_specs=P("data"), check_vma=False)(u)
            return a, s

        with jax.set_mesh(mesh):
            a, s = jax.jit(f)()
            jax.jit(lambda x: x + 1)(a)  # TypeError on jax 0.12.0.1

    The initial state therefore builds its stacked sum of squares directly,
    never from a zero made unreduced."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh, specs, params, _, _ = _mesh_problem(name)
    tx = _tx(0.9, k=2, axis_name="data")
    with jax.set_mesh(mesh):
        p = {
            k: jax.device_put(v, NamedSharding(mesh, specs[k]))
            for k, v in params.items()
        }
        state = jax.jit(tx.init)(p)
        for leaf in jax.tree.leaves(state):
            assert isinstance(leaf.sharding, NamedSharding), leaf.sharding
            if not leaf.ndim:
                assert leaf.sharding.spec == P(), leaf.sharding
        add = lambda a: a + jnp.zeros_like(a)  # noqa: E731
        again = jax.jit(lambda s: jax.tree.map(add, s))(state)
    assert jax.tree.map(jax.typeof, again) == jax.tree.map(jax.typeof, state)


# --------------------------- jit meshes: uneven real examples per device


def _share_estimates(g, w_dev):
    """The estimator as the jit mesh computes it, by hand: ``g[..., i, d]``
    is device ``d``'s partial sum of micro-batch ``i``'s gradient of the
    global mean loss (a vector), ``w_dev[i, d]`` its real examples. Each
    device share counts as a small batch of weight ``w_i / n``, mean
    gradient ``n g_id``: ``A = sum_id n w_i |g_id|^2 / W``, ``k = n m``."""
    m, n = w_dev.shape
    w = w_dev.sum(1)
    big_w = w.sum()
    a = (n * w[:, None] * (g**2).sum(-1)).sum((-1, -2)) / big_w
    mean = (w[:, None] * g.sum(-2)).sum(-2) / big_w
    c = (mean**2).sum(-1)
    k = n * m
    return big_w * (a - c) / (k - 1), (k * c - a) / (k - 1)


def _uneven_bias(w_dev):
    """The derived bias (docs/noise_scale.md): with ``rho`` the weight-
    averaged ``n sum_d w_id^2 / w_i^2``, ``E[grad_sq] = |G|^2 (k - rho) /
    (k - 1)`` and ``E[trace_cov] = tr(Sigma) + W (rho - 1) |G|^2 / (k - 1)``.
    Returns ``(rho, k, W)``."""
    m, n = w_dev.shape
    w = w_dev.sum(1)
    rho = (n * (w_dev**2).sum(1) / w).sum() / w.sum()
    return rho, n * m, w.sum()


@pytest.mark.devices(8)
def test_jit_mesh_uneven_shares_match_the_hand_computation():
    """data8, 3 micro-batches whose real examples sit unevenly on the 8
    devices (masks): the library's single-window trace_cov and grad_sq
    equal the hand computation of the equal-shares estimator from each
    device's partial gradient of the global mean loss."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh, specs, params, x, y = _mesh_problem("data8")
    m, n = 3, 8
    mask = np.zeros((m, 16), np.float32)
    mask[0, :2] = 1  # one device holds all 2 real examples
    mask[1, :9] = 1  # four full devices and one half
    mask[2, ::3] = 1  # spread
    tx = _tx(0.0, k=m, axis_name="data")

    def per_example(p, xb, yb, gather=lambda a: a):
        return ((xb @ gather(p["w"]) @ gather(p["v"]) - yb) ** 2).sum(-1)

    def loss(p, xb, yb, mb):
        def gather(a):
            return jax.reshard(a, P(None, None, reduced={"data"}))

        return (mb * per_example(p, xb, yb, gather)).sum() / mb.sum()

    def step(p, s, xb, yb, mb):
        g = oa.unreduced_value_and_grad(loss, "data")(p, xb, yb, mb)[1]
        return oa.apply_gradients(tx, g, s, p, accum_weight=mb.sum())

    with jax.set_mesh(mesh):
        p = {
            k: jax.device_put(v, NamedSharding(mesh, specs[k]))
            for k, v in params.items()
        }
        s = jax.jit(tx.init)(p)
        fn = jax.jit(step)
        for t in range(m):
            batch = [
                jax.device_put(a[t], NamedSharding(mesh, P("data")))
                for a in (x, y, mask)
            ]
            p, s = fn(p, s, *batch)
        est = jax.device_get(oa.noise_scale(s))

    g = np.zeros((m, n, ravel_pytree(params)[0].size))
    for t in range(m):
        w_t = mask[t].sum()
        for d in range(n):
            rows = slice(2 * d, 2 * d + 2)
            g[t, d] = ravel_pytree(
                jax.grad(
                    lambda q: (
                        (
                            mask[t, rows]
                            * per_example(q, x[t, rows], y[t, rows])
                        ).sum()
                        / w_t
                    )
                )(params)
            )[0]
    w_dev = mask.reshape(m, n, 2).sum(-1)
    trace, gsq = _share_estimates(g, w_dev)
    np.testing.assert_allclose(est.trace_cov, trace, rtol=1e-4)
    np.testing.assert_allclose(est.grad_sq, gsq, rtol=1e-4)


def test_jit_mesh_uneven_shares_bias_is_as_derived():
    """Over 20000 synthetic windows (device means h_id ~ N(G, sigma^2 I /
    w_id), partial sums g_id = w_id h_id / w_i), the equal-shares
    estimator's means are the derived ones: |G|^2 scaled by
    (k - rho) / (k - 1) < 1 (biased low, not high) and tr(Sigma) plus
    W (rho - 1) |G|^2 / (k - 1) (biased high): b_simple reads high."""
    rng = np.random.default_rng(0)
    dim, sigma2, seeds = 16, 4.0, 20000
    big_g = rng.normal(size=dim)
    w_dev = np.array(
        [[8, 0, 0, 0, 0, 0, 0, 0], [4, 4, 0, 0, 0, 0, 0, 0],
         [2, 2, 2, 2, 1, 1, 1, 1], [3, 0, 3, 0, 3, 0, 3, 0]],
        np.float64,
    )  # fmt: skip
    w = w_dev.sum(1)
    scale = np.sqrt(sigma2 / np.maximum(w_dev, 1))[..., None]
    h = big_g + scale * rng.normal(size=(seeds, *w_dev.shape, dim))
    g = (w_dev / w[:, None])[..., None] * h
    trace, gsq = _share_estimates(g, w_dev)
    rho, k, big_w = _uneven_bias(w_dev)
    g2, tr = (big_g**2).sum(), sigma2 * dim
    assert rho > 2  # far from equal shares (rho = 1)
    for got, want in (
        (gsq, g2 * (k - rho) / (k - 1)),
        (trace, tr + big_w * (rho - 1) * g2 / (k - 1)),
    ):
        se = got.std() / np.sqrt(seeds)
        assert abs(got.mean() - want) < 5 * se, (got.mean(), want, se)
    assert gsq.mean() + 5 * gsq.std() / np.sqrt(seeds) < g2  # low
    assert trace.mean() - 5 * trace.std() / np.sqrt(seeds) > tr  # high
