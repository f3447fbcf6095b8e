"""``oa.optimizer_step``: how many times the optimizer after the
accumulate stepped, on every state that holds a window (a chain, a bare
accumulate, nested accumulates, ``oa.MultiSteps``, the Flax
integrations), and the schedule idiom it serves."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state

import optaxaccum as oa
from optaxaccum.flax import TrainState
from optaxaccum.flax.nnx import Optimizer


def _steps(tx, grads, *, jit=False, **kwargs):
    params = jnp.zeros(2)
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    out = []
    for g in grads:
        _, state = update(jnp.asarray(g), state, params, **kwargs)
        out.append(int(oa.optimizer_step(state)))
    return out, state


@pytest.mark.parametrize("jit", [False, True])
def test_counts_windows_in_a_chain_and_a_bare_accumulate(jit):
    ones = [jnp.ones(2)] * 7
    chained, s = _steps(
        oa.chain(oa.accumulate(3), optax.adam(0.1)), ones, jit=jit
    )
    assert chained == [0, 0, 1, 1, 1, 2, 2]
    assert oa.optimizer_step(s).dtype == jnp.int32 and s[1][0].count == 2
    bare, _ = _steps(oa.accumulate(3), ones, jit=jit)
    assert bare == chained


def test_window_of_weight_zero_and_skipped_micro_batches_do_not_step():
    tx = oa.chain(oa.accumulate(2, skip_nonfinite=True), optax.sgd(0.1))
    params = jnp.zeros(2)
    s = tx.init(params)
    calls = [(1.0, 0.0), (1.0, 0.0), (1.0, 1.0), (jnp.nan, 1.0), (1.0, 1.0)]
    counts = []
    for g, w in calls:
        _, s = tx.update(jnp.full(2, g), s, params, accum_weight=w)
        counts.append(int(oa.optimizer_step(s)))
    # Window 1 has weight 0 (closed, no step); the NaN is skipped.
    assert counts == [0, 0, 0, 0, 1]
    assert int(s[0].gradient_step) == 2


def test_nested_accumulates_count_the_whole_window():
    nested = oa.chain(oa.accumulate(2), oa.accumulate(3), optax.sgd(0.1))
    counts, s = _steps(nested, [jnp.ones(2)] * 13)
    one, _ = _steps(
        oa.chain(oa.accumulate(6), optax.sgd(0.1)), [jnp.ones(2)] * 13
    )
    assert counts == one and counts[-1] == 2
    assert int(s[0].gradient_step) == 6  # the inner windows closed 6 times


def test_flush_counts_and_an_empty_flush_does_not():
    tx = oa.chain(oa.accumulate(4), optax.sgd(0.1))
    params = jnp.zeros(2)
    s = tx.init(params)
    for _ in range(5):
        _, s = tx.update(jnp.ones(2), s, params)
    _, s = oa.flush(tx, s, params)
    assert int(oa.optimizer_step(s)) == 2
    _, s = oa.flush(tx, s, params)
    assert int(oa.optimizer_step(s)) == 2


def test_multisteps_counts_its_windows():
    ms = oa.MultiSteps(optax.sgd(0.1), 2)
    counts, _ = _steps(ms, [jnp.ones(2)] * 5)
    assert counts == [0, 1, 1, 2, 2]


def test_state_of_an_earlier_version_counts_from_its_windows():
    """A state without the count (None): its first update starts it from
    the windows closed so far."""
    tx = oa.chain(oa.accumulate(2), optax.sgd(0.1))
    params = jnp.zeros(2)
    s = tx.init(params)
    for _ in range(4):
        _, s = tx.update(jnp.ones(2), s, params)
    old = (s[0]._replace(optimizer_step=None), *s[1:])
    assert int(oa.optimizer_step(old)) == 2
    for _ in range(2):
        _, old = tx.update(jnp.ones(2), old, params)
    assert int(oa.optimizer_step(old)) == 3


def test_no_window_raises():
    with pytest.raises(ValueError, match="oa.optimizer_step"):
        oa.optimizer_step(optax.sgd(0.1).init(jnp.zeros(1)))


# ----------------------------------------------------------------- Flax


def _linen_state(tx):
    model = nn.Dense(1)
    params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def test_train_state_exposes_the_step_of_a_schedule():
    """The lm1b idiom: log and schedule with ``state.optimizer_step``, not
    ``state.step`` (micro-batches, k times ahead)."""
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    tx = oa.chain(
        oa.accumulate(4),
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule),
    )
    state = _linen_state(tx)
    grads = jax.tree.map(jnp.ones_like, state.params)
    step = jax.jit(lambda s: s.apply_gradients(grads=grads))
    for _ in range(9):
        state = step(state)
    assert int(state.step) == 9
    assert int(state.optimizer_step) == 2
    # The schedule inside the chain ran at the optimizer's steps: the last
    # update used the rate of the step before the count.
    lr = state.opt_state[1].hyperparams["learning_rate"]
    np.testing.assert_allclose(
        lr, schedule(state.optimizer_step - 1), rtol=1e-6
    )
    assert int(state.opt_state[1].count) == int(state.optimizer_step)
    state = state.flush()
    assert int(state.optimizer_step) == 3


def test_nnx_optimizer_opt_state():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    opt = Optimizer(model, oa.chain(oa.accumulate(2), optax.sgd(0.1)))
    loss = lambda m, x: (m(x) ** 2).mean()  # noqa: E731
    for _ in range(5):
        opt.update(model, nnx.grad(loss)(model, jnp.ones((1, 2))))
    assert int(oa.optimizer_step(opt.opt_state)) == 2
    assert int(opt.step[...]) == 5


# ------------------------------------- flax's own TrainState drops weights


def test_flax_train_state_dropping_accum_weight_is_explained():
    """flax's TrainState.apply_gradients does not forward accum_weight to
    tx.update: the summed-gradients error says so and names the fix."""
    model = nn.Dense(1)
    params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    state = flax_train_state.TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=oa.chain(oa.accumulate(2, summed_gradients=True), optax.sgd(0.1)),
    )
    grads = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(ValueError, match="accum_weight") as info:
        state.apply_gradients(grads=grads, accum_weight=3.0)
    message = str(info.value)
    assert "optaxaccum.flax.TrainState" in message
    assert "flax.training.train_state.TrainState" in message
    ours = _linen_state(state.tx).replace(params=params)
    ours = ours.apply_gradients(grads=grads, accum_weight=3.0)
    assert int(ours.step) == 1


@pytest.mark.parametrize("flush", [False, True])
def test_nested_accumulates_before_a_loss_scale_count_as_one(flush):
    """``oa.chain(acc(2), acc(3), loss scale, opt)`` steps, drops and counts
    as ``oa.chain(acc(6), loss scale, opt)``, flush included."""

    def tx(*accs):
        return oa.chain(*accs, oa.dynamic_loss_scale(4.0), optax.adam(0.1))

    grads = [jnp.full(2, 4.0 * (i + 1)) for i in range(16)]
    grads[8] = jnp.array([jnp.inf, 1.0])  # the second big window overflows
    runs = []
    for t in (tx(oa.accumulate(2), oa.accumulate(3)), tx(oa.accumulate(6))):
        params = jnp.zeros(2)
        s = t.init(params)
        seen = []
        for g in grads:
            params, s = oa.apply_gradients(t, g, s, params)
            seen.append((bool(oa.has_updated(s)), int(oa.optimizer_step(s))))
        if flush:
            u, s = oa.flush(t, s, params)
            seen.append((bool(oa.has_updated(s)), int(oa.optimizer_step(s))))
        runs.append((seen, params, float(oa.loss_scale(s))))
    (got, p, scale), (want, p1, scale1) = runs
    assert got == want and scale == scale1 == 2.0
    np.testing.assert_allclose(p, p1, rtol=1e-6)
    assert want[-1][1] == (2 if flush else 1)
