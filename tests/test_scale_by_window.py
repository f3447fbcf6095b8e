"""``oa.scale_by_window`` and ``oa.window_progress``: the updates of a
closed window scaled by a factor of its size (AdaScale's gain ratio from
the window's noise estimates, linear, sqrt, or the user's), the factors
summed into the progress ``tau``, a schedule evaluated at it.

Against the hand formula on synthetic gradients with known ``Sigma`` and
``G`` (those of tests/test_noise_scale.py), and AdaScale's claim (Johnson
et al., ICML 2020) on a linear regression with known noise: SGD on windows
of ``S`` base batches with the gain reaches the base batch's loss at the
same ``tau``; without the scaling it lags far behind on the same examples.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import optaxaccum as oa
from tests import data_parallel_helpers as dp
from tests import helpers
from tests import mesh_helpers as mh

TOL = dict(rtol=2e-5, atol=2e-6)


def _feed(tx, grads, weights, fused=False, params=None):
    """Feeds ``(grads, weights)`` one by one; returns the per-call updates
    and the final state."""
    params = jnp.zeros(grads.shape[1]) if params is None else params
    state = tx.init(params)
    out = []

    def fused_step(g, state, params, accum_weight):
        _, state, u = oa.apply_gradients(
            tx, g, state, params, accum_weight=accum_weight, return_updates=True
        )
        return u, state

    step = jax.jit(fused_step if fused else tx.update)
    for g, w in zip(grads, weights):
        u, state = step(g, state, params, accum_weight=w)
        out.append(np.asarray(u))
    return np.stack(out), state


def _hand_gain(grads, weights, base):
    """AdaScale's gain ratio of one window from the estimator's hand
    formula, unclipped (the callers check that no bound binds)."""
    trace, grad_sq = helpers.brute_noise(grads, weights)
    big_w = float(np.sum(weights))
    return (trace / base + grad_sq) / (trace / big_w + grad_sq), big_w


@pytest.mark.parametrize("fused", [False, True])
def test_gain_equals_the_hand_formula(fused):
    """decay 0: each window's factor is the hand formula's gain from that
    window's micro-batches (unequal weights); the updates are SGD's times
    it; tau adds the factors up."""
    grads, weights = helpers.noisy_gradients(
        jax.random.key(0), (1.0, 2.0, 5.0, 8.0), 3
    )
    tx = oa.chain(
        oa.accumulate(4, noise_scale_decay=0.0),
        optax.sgd(1.0),
        oa.scale_by_window(2.0),
    )
    updates, state = _feed(tx, grads, weights, fused=fused)
    tau = 0.0
    for j in range(3):
        sl = slice(4 * j, 4 * j + 4)
        r, big_w = _hand_gain(grads[sl], weights[sl], 2.0)
        assert 1.0 < r < big_w / 2.0  # the gain's bounds do not bind
        mean = (weights[sl, None] * grads[sl]).sum(0) / big_w
        np.testing.assert_allclose(updates[4 * j + 3], -r * mean, rtol=2e-4)
        tau += r
    np.testing.assert_allclose(state[2].factor, r, rtol=2e-4)
    np.testing.assert_allclose(oa.window_progress(state), tau, rtol=2e-4)


def test_gain_of_a_window_lighter_than_the_base_batch():
    """A window of total weight W = 2 against a base batch of 8: the gain
    is the ratio itself, between W / B0 = 0.25 and 1 (a smaller step than
    the base batch's), not W / B0."""
    grads, weights = helpers.noisy_gradients(jax.random.key(3), (0.5,) * 4, 2)
    tx = oa.chain(
        oa.accumulate(4, noise_scale_decay=0.0),
        optax.sgd(1.0),
        oa.scale_by_window(8.0),
    )
    updates, state = _feed(tx, grads, weights)
    for j in range(2):
        sl = slice(4 * j, 4 * j + 4)
        r, big_w = _hand_gain(grads[sl], weights[sl], 8.0)
        assert big_w == 2.0 and 0.3 < r < 0.9, r  # no bound binds
        mean = (weights[sl, None] * grads[sl]).sum(0) / big_w
        np.testing.assert_allclose(updates[4 * j + 3], -r * mean, rtol=2e-4)
    np.testing.assert_allclose(state[2].factor, r, rtol=2e-4)


def test_bf16_updates_stay_bf16():
    """Every rule scales bfloat16 updates in bfloat16: the float32 factor
    does not promote them."""
    params = jnp.zeros(2, jnp.bfloat16)
    grads = jnp.asarray([[1.0, 2.0], [3.0, -1.0]], jnp.bfloat16)
    for rule in ("gain", "linear", "sqrt", lambda w, noise: w / 8.0):
        tx = oa.chain(
            oa.accumulate(2, noise_scale_decay=0.5),
            optax.sgd(1.0),
            oa.scale_by_window(2.0, rule=rule),
        )
        updates, _ = _feed(tx, grads, jnp.asarray([2.0, 2.0]), params=params)
        assert updates.dtype == jnp.bfloat16, (rule, updates.dtype)


def test_linear_sqrt_callable_and_the_schedule_at_tau():
    """``W / base``, its square root, a callable of ``(W, noise_scale)``;
    the schedule is evaluated at the progress before the window."""
    grads = jnp.ones((6, 2))
    weights = jnp.asarray([1.0, 3.0, 2.0, 2.0, 5.0, 1.0])  # W = 4, 4, 6
    seen = []

    def rule(w, noise):
        seen.append(noise)
        return w / 8.0

    cases = {
        "linear": [4 / 2, 4 / 2, 6 / 2],
        "sqrt": [2**0.5, 2**0.5, 3**0.5],
        rule: [0.5, 0.5, 0.75],
    }
    for rule_, factors in cases.items():
        tx = oa.chain(
            oa.accumulate(2),
            optax.sgd(1.0),
            oa.scale_by_window(2.0, rule=rule_, schedule=lambda t: 1.0 + t),
        )
        updates, state = _feed(tx, grads, weights)
        taus = np.cumsum([0.0, *factors])
        want = [-f * (1.0 + t) for f, t in zip(factors, taus)]
        np.testing.assert_allclose(updates[1::2, 0], want, rtol=1e-6)
        np.testing.assert_allclose(updates[::2], 0.0)
        np.testing.assert_allclose(oa.window_progress(state), taus[-1])
    assert seen and seen[0] is None  # no noise_scale_decay: None


def test_tau_across_checkpoints_flush_and_the_noise_keyword_stays_private():
    """A checkpoint (host arrays) mid-run keeps ``tau``; ``oa.flush``
    closes a partial window with its own weight and adds its factor;
    another follower never sees ``window_noise_scale``."""
    grads, weights = helpers.noisy_gradients(
        jax.random.key(1), (2.0, 2.0, 2.0), 3
    )
    seen = []

    def record(updates, state, params=None, **extra_args):
        seen.append(sorted(extra_args))
        return updates, state

    spy = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), record
    )
    tx = oa.chain(
        oa.accumulate(3, noise_scale_decay=0.5),
        optax.sgd(1.0),
        spy,
        oa.scale_by_window(2.0, rule="linear"),
    )
    params = jnp.zeros(grads.shape[1])
    state = tx.init(params)
    step = jax.jit(tx.update)
    for i, (g, w) in enumerate(zip(grads[:8], weights[:8])):
        if i == 4:
            state = jax.tree.map(jnp.asarray, jax.device_get(state))
        _, state = step(g, state, params, accum_weight=w)
    np.testing.assert_allclose(oa.window_progress(state), 3.0 + 3.0)
    _, state = oa.flush(tx, state, params)  # two micro-batches: W = 4
    np.testing.assert_allclose(oa.window_progress(state), 6.0 + 2.0)
    # neither the estimates nor accum_weight (it declares neither)
    assert seen and all(s == [] for s in seen), seen


def test_gain_is_one_while_the_estimates_are_unset():
    """Windows of one micro-batch give no estimate (NaN): the gain is 1
    and the updates are SGD's."""
    tx = oa.chain(
        oa.accumulate(1, noise_scale_decay=0.9),
        optax.sgd(1.0),
        oa.scale_by_window(1.0),
    )
    grads = jnp.asarray([[1.0, 2.0], [3.0, -1.0]])
    updates, state = _feed(tx, grads, jnp.asarray([4.0, 4.0]))
    np.testing.assert_allclose(updates, -grads)
    np.testing.assert_allclose(oa.window_progress(state), 2.0)


_UNWEIGHTED_CALLS = {
    "update": lambda tx, g, s, p: tx.update(g, s, p),
    "fused": lambda tx, g, s, p: oa.apply_gradients(tx, g, s, p)[::-1],
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("call", list(_UNWEIGHTED_CALLS))
@pytest.mark.parametrize("nest", ["flat", "in_optax_chain", "nested"])
def test_a_window_without_weights_warns_naming_both(nest, call, jit):
    """Without ``accum_weight`` the window's weight counts micro-batches: a
    ``base_weight`` in examples would scale the wrong way (four
    micro-batches of 16 against 16 examples: 0.25, not 4). The window
    warns when its closing work is traced (an eager fused call that does not
    close its window does not trace it), naming ``accum_weight`` and
    ``base_weight``."""
    inner = (oa.accumulate(2), optax.sgd(1.0))
    sbw = oa.scale_by_window(16, rule="linear")
    tx = {
        "flat": lambda: oa.chain(*inner, sbw),
        "in_optax_chain": lambda: optax.chain(
            optax.scale(1.0), oa.chain(*inner, sbw)
        ),
        "nested": lambda: oa.chain(oa.accumulate(1), oa.chain(*inner, sbw)),
    }[nest]()
    params = jnp.zeros(1)
    step = _UNWEIGHTED_CALLS[call]
    step = jax.jit(step, static_argnums=0) if jit else step
    state = tx.init(params)
    with pytest.warns(UserWarning, match="accum_weight") as record:
        for _ in range(2):  # one window
            out = step(tx, jnp.ones(1), state, params)
            state = out[1] if call == "update" else out[0]
    assert "base_weight=16" in str(record[0].message)


def test_weights_a_flush_and_a_callable_rule_do_not_warn():
    """Calls that pass ``accum_weight`` (the unit of ``base_weight`` is
    then theirs), ``oa.flush`` (it takes the window's weight as it is) and
    a callable rule (it reads ``W`` itself) do not warn; a follower that
    does not ask never sees the keyword that tells it."""
    seen = []

    def record(updates, state, params=None, **extra_args):
        seen.append(sorted(extra_args))
        return updates, state

    spy = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), record
    )
    params = jnp.zeros(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Four micro-batches of 16 against 16 examples: W / B0 = 4.
        tx = oa.chain(
            oa.accumulate(4),
            optax.sgd(1.0),
            spy,
            oa.scale_by_window(16, rule="linear"),
        )
        state = tx.init(params)
        for _ in range(4):
            u, state = tx.update(jnp.ones(1), state, params, accum_weight=16)
        np.testing.assert_allclose(u, [-4.0])
        _, state = tx.update(jnp.ones(1), state, params, accum_weight=16)
        u, state = oa.flush(tx, state, params)
        np.testing.assert_allclose(u, [-1.0])
        own = oa.chain(
            oa.accumulate(2),
            optax.sgd(1.0),
            spy,
            oa.scale_by_window(16, rule=lambda w, noise: w),
        )
        state = own.init(params)
        for _ in range(2):
            u, state = own.update(jnp.ones(1), state, params)
        np.testing.assert_allclose(u, [-2.0])
    assert seen and all(s == [] for s in seen), seen


def test_bad_input_is_named():
    for kwargs, exc, match in [
        (dict(base_weight=0.0), ValueError, "base_weight"),
        (dict(base_weight=float("inf")), ValueError, "base_weight"),
        (dict(base_weight=True), TypeError, "base_weight"),
        (dict(base_weight=1.0, rule="cubic"), ValueError, "rule"),
        (dict(base_weight=1.0, rule=2), ValueError, "rule"),
        (dict(base_weight=1.0, schedule=0.1), TypeError, "schedule"),
    ]:
        with pytest.raises(exc, match=match):
            oa.scale_by_window(**kwargs)
    params = jnp.zeros(2)
    no_decay = oa.chain(
        oa.accumulate(2), optax.sgd(1.0), oa.scale_by_window(1.0)
    )
    with pytest.raises(ValueError, match="noise_scale_decay"):
        no_decay.update(jnp.ones(2), no_decay.init(params), params)
    alone = oa.scale_by_window(1.0, rule="linear")
    with pytest.raises(ValueError, match="oa.accumulate"):
        alone.update(jnp.ones(2), alone.init(params), params)
    plain = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    with pytest.raises(ValueError, match="window_progress"):
        oa.window_progress(plain.init(params))


@pytest.mark.parametrize("runner", ["pmap", "shard_map"])
@pytest.mark.devices(8)
def test_devices_scale_by_the_global_window_weight(runner):
    """Under pmap/shard_map the window's weight reaching the factor is its
    total over the devices."""
    x, y, mask = dp._data(4, ragged=True, seed=2)
    tx = oa.chain(
        oa.accumulate(2, axis_name=dp.AXIS),
        optax.sgd(0.1),
        oa.scale_by_window(10.0, rule="linear"),
    )
    _, state = dp.RUNNERS[runner](
        tx, helpers.multihost_params(), (x, y, mask), weighted=True
    )
    w = mask.sum((1, 2)).reshape(2, 2).sum(1)
    tau = np.asarray(state[2].tau).reshape(-1)
    np.testing.assert_allclose(
        tau, np.full_like(tau, w.sum() / 10.0), rtol=1e-6
    )


@pytest.mark.devices(8)
def test_jit_mesh_scales_by_the_global_window_weight():
    """``jax.jit`` on data=8: the window's weight is the global token
    count (the sum of each micro-batch's mask)."""
    mesh = mh._mesh("data8")
    data = mh._make_data(4, seed=1)
    tx = oa.chain(
        oa.accumulate(2, axis_name="data", noise_scale_decay=0.5),
        optax.sgd(0.1),
        oa.scale_by_window(10.0, rule="linear"),
    )
    _, state = mh._run(tx, mesh, data)
    want = data[2].sum() / 10.0
    np.testing.assert_allclose(oa.window_progress(state), want, rtol=1e-6)


# ---------------------------------------------------- AdaScale's claim

D, SIGMA, B0, S, T, SEEDS = 16, 1.0, 4, 8, 300, 8
LR = 0.02


def _regression(tx, micro_steps, seed):
    """SGD through ``tx`` on ``y = x . w* + SIGMA * eps``, micro-batches of
    ``B0`` examples weighted ``B0`` (fused steps): the excess loss ``|w -
    w*|^2 / 2`` and the progress ``tau`` (0 without
    :func:`scale_by_window`) after every micro-batch."""
    key = jax.random.key(seed)
    k_star, k_data = jax.random.split(key)
    w_star = jax.random.normal(k_star, (D,))
    params = w_star + 1.0  # start away from the optimum

    def step(carry, key):
        params, state = carry
        kx, ke = jax.random.split(key)
        x = jax.random.normal(kx, (B0, D))
        y = x @ w_star + SIGMA * jax.random.normal(ke, (B0,))
        grads = jax.grad(lambda p: 0.5 * jnp.mean((x @ p - y) ** 2))(params)
        params, state = oa.apply_gradients(
            tx, grads, state, params, accum_weight=float(B0)
        )
        excess = 0.5 * jnp.sum((params - w_star) ** 2)
        try:
            tau = oa.window_progress(state)
        except ValueError:  # no scale_by_window
            tau = jnp.zeros([])
        return (params, state), (excess, tau)

    keys = jax.random.split(k_data, micro_steps)
    _, (excess, tau) = lax.scan(step, (params, tx.init(params)), keys)
    return excess, tau


def _runs(tx, micro_steps):
    """The excess loss (mean over seeds) and tau (of the first seed)."""
    run = jax.jit(jax.vmap(lambda s: _regression(tx, micro_steps, s)))
    excess, tau = run(jnp.arange(SEEDS))
    return np.asarray(excess).mean(0), np.asarray(tau)[0]


def test_adascale_gain_reaches_the_base_loss_at_the_same_tau():
    """SGD on windows of S base batches with ``rule="gain"``: where ``tau``
    reaches T, the excess loss (mean over seeds) is the base batch's after
    T steps, on fewer examples than S times the base's; on the same
    examples, the same windows without the scaling lag far behind."""
    base, _ = _runs(optax.sgd(LR), T)
    acc = oa.accumulate(S, noise_scale_decay=0.9)
    gain_tx = oa.chain(acc, optax.sgd(LR), oa.scale_by_window(float(B0)))
    gain, tau = _runs(gain_tx, S * T)
    at = int(np.argmax(tau >= T))  # the micro-step where tau reaches T
    assert tau[at] >= T, tau[-1]
    assert 0.67 < gain[at] / base[T - 1] < 1.5, (gain[at], base[T - 1])
    assert at + 1 < S * T * 0.75, at  # the gain grew beyond 1
    plain, _ = _runs(oa.chain(oa.accumulate(S), optax.sgd(LR)), at + 1)
    assert plain[at] > 3 * base[T - 1], (plain[at], base[T - 1])
