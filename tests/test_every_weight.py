"""``oa.every_weight``: windows that close on a total weight (tokens).

Against a hand-written loop over the micro-batches' weights: the window
closes on the first micro-batch with which its total reaches the budget
(that micro-batch counted whole), or after ``max_k`` micro-batches. On
the fused path, with ``oa.flush``, nested accumulates, ``oa.MultiSteps``,
checkpoints, under ``pmap``/``shard_map`` (the global weight, one scalar
``psum`` per micro-batch) and on ``jax.jit`` meshes resumed with
``oa.reshard_state`` on another number of data devices (the 8 CPU
devices of conftest.py).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxaccum as oa
from tests import data_parallel_helpers as dp
from tests import helpers
from tests import hlo_queries as hlo
from tests import mesh_helpers as mh

TOL = dict(rtol=2e-5, atol=2e-6)


def _hand_windows(weights, total, max_k=None):
    """The windows (lists of call indices) a hand-written loop closes: add
    each weight; close when the sum reaches ``total`` or the window holds
    ``max_k``. The last, unclosed window is left out."""
    windows, current, acc = [], [], 0.0
    for i, w in enumerate(weights):
        current.append(i)
        acc += w
        if acc >= total or (max_k is not None and len(current) >= max_k):
            windows.append(current)
            current, acc = [], 0.0
    return windows, current


def _hand_updates(grads, weights, windows, lr):
    """SGD's per-call updates for ``windows``: minus ``lr`` times the
    weighted mean on the closing call, zeros elsewhere."""
    out = np.zeros_like(grads)
    for win in windows:
        w = np.asarray([weights[i] for i in win])
        out[win[-1]] = -lr * (w[:, None] * grads[win]).sum(0) / w.sum()
    return out


def _data(n, seed=0, integer=True):
    rng = np.random.default_rng(seed)
    grads = rng.normal(size=(n, 3)).astype(np.float32)
    if integer:  # token counts, zeros among them
        weights = rng.integers(0, 33, size=n).astype(np.float32)
    else:
        weights = rng.uniform(0.0, 5.0, size=n).astype(np.float32)
    return grads, weights


@pytest.mark.parametrize(
    "total,max_k,integer",
    [(100, None, True), (100, 3, True), (7.5, None, False)],
)
def test_windows_reach_the_budget_and_equal_a_hand_loop(total, max_k, integer):
    """Random weights: every window's total lies in ``[total, total + max
    weight)`` (unless ``max_k`` closed it), its boundaries and updates are
    the hand loop's, on the plain and the fused path alike."""
    grads, weights = _data(60, integer=integer)
    tx = oa.chain(
        oa.accumulate(oa.every_weight(total, max_k=max_k)), optax.sgd(0.5)
    )
    params = jnp.zeros(3)
    state = tx.init(params)
    fused_params, fused_state = params, state
    closed, updates, totals = [], [], []
    step = jax.jit(tx.update)
    fused = jax.jit(
        lambda p, s, g, w: oa.apply_gradients(tx, g, s, p, accum_weight=w)
    )
    for g, w in zip(grads, weights):
        before = state[0].weight if int(state[0].mini_step) else 0.0
        u, state = step(g, state, params, accum_weight=w)
        fused_params, fused_state = fused(fused_params, fused_state, g, w)
        closed.append(bool(oa.has_updated(state)))
        updates.append(np.asarray(u))
        if closed[-1]:
            totals.append(float(before) + float(w))
    windows, rest = _hand_windows(weights, total, max_k)
    assert closed == [i in {w[-1] for w in windows} for i in range(len(grads))]
    assert len(windows) >= 5, windows
    for win, t in zip(windows, totals):
        if max_k is None or len(win) < max_k:
            assert total <= t < total + weights.max(), (win, t)
        np.testing.assert_allclose(t, weights[win].sum(), rtol=1e-6)
    want = _hand_updates(grads, weights, windows, 0.5)
    np.testing.assert_allclose(np.stack(updates), want, **TOL)
    np.testing.assert_allclose(fused_params, want.sum(0), **TOL)
    assert int(fused_state[0].mini_step) == len(rest)
    chex.assert_trees_all_equal(fused_state[0].weight, state[0].weight)


def test_flush_checkpoint_and_nested_accumulates():
    """A checkpoint mid-window (host arrays) resumes on the same
    boundaries; ``oa.flush`` closes the partial window; inside nested
    accumulates (pairs of micro-batches, then the budget over the pairs'
    weights) the windows are the hand loop's over the pairs."""
    grads, weights = _data(40, seed=1)
    tx = oa.chain(oa.accumulate(oa.every_weight(90)), optax.sgd(1.0))
    params = jnp.zeros(3)
    state = tx.init(params)
    out = []
    for i, (g, w) in enumerate(zip(grads, weights)):
        if i == 17:  # saved and restored mid-window
            state = jax.tree.map(jnp.asarray, jax.device_get(state))
        u, state = tx.update(g, state, params, accum_weight=w)
        out.append(u)
    windows, rest = _hand_windows(weights, 90)
    assert rest, "the data must end mid-window"
    u, state = oa.flush(tx, state, params)
    want = _hand_updates(grads, weights, [*windows, rest], 1.0)
    np.testing.assert_allclose(np.stack([*out[:-1], out[-1] + u]), want, **TOL)
    assert int(state[0].gradient_step) == len(windows) + 1

    nested = oa.chain(
        oa.accumulate(2), oa.accumulate(oa.every_weight(90)), optax.sgd(1.0)
    )
    state = nested.init(params)
    total = np.zeros(3, np.float32)
    for g, w in zip(grads, weights):
        u, state = nested.update(g, state, params, accum_weight=w)
        total += np.asarray(u)
    pairs = weights.reshape(-1, 2).sum(1)
    pair_windows, _ = _hand_windows(pairs, 90)
    calls = [[2 * j + d for j in win for d in (0, 1)] for win in pair_windows]
    want = _hand_updates(grads, weights, calls, 1.0).sum(0)
    np.testing.assert_allclose(total, want, **TOL)
    assert int(state[1].gradient_step) == len(pair_windows)


def test_multisteps_takes_a_budget():
    grads, weights = _data(30, seed=2)
    ms = oa.MultiSteps(optax.sgd(1.0), every_k_schedule=oa.every_weight(60))
    params = jnp.zeros(3)
    state = ms.init(params)
    closed = []
    for g, w in zip(grads, weights):
        _, state = ms.update(g, state, params, accum_weight=w)
        closed.append(bool(ms.has_updated(state)))
    windows, _ = _hand_windows(weights, 60)
    assert closed == [i in {w[-1] for w in windows} for i in range(30)]


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(total=0), ValueError, "total"),
        (dict(total=-3.0), ValueError, "total"),
        (dict(total=float("inf")), ValueError, "total"),
        (dict(total=float("nan")), ValueError, "total"),
        (dict(total=True), TypeError, "total"),
        (dict(total="100"), TypeError, "total"),
        (dict(total=10, max_k=0), ValueError, "max_k"),
        (dict(total=10, max_k=True), TypeError, "max_k"),
        (dict(total=10, max_k=2.0), TypeError, "max_k"),
    ],
)
def test_bad_input_is_named(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        oa.every_weight(**kwargs)


def test_a_traced_invalid_weight_closes_the_window():
    """A NaN weight that could not be checked (traced) is propagated: the
    window closes on it and passes the NaN on, rather than never
    closing."""
    tx = oa.chain(oa.accumulate(oa.every_weight(100)), optax.sgd(1.0))
    state = tx.init(jnp.zeros(1))
    step = jax.jit(tx.update)
    _, state = step(jnp.ones(1), state, accum_weight=jnp.float32(10))
    u, state = step(jnp.ones(1), state, accum_weight=jnp.float32(jnp.nan))
    assert bool(oa.has_updated(state)) and np.isnan(u).all()


# ---------------------------------------------------- pmap and shard_map


@pytest.mark.parametrize("runner", ["pmap", "shard_map"])
@pytest.mark.devices(8)
def test_devices_close_on_the_global_weight(runner):
    """Each device passes its own token count: the windows close on the
    budget of their sum over the devices, and land on single-device Adam
    on each window's whole batch."""
    x, y, mask = dp._data(9, ragged=True, seed=3)
    tx = oa.chain(
        oa.accumulate(oa.every_weight(40), axis_name=dp.AXIS),
        optax.adam(0.05),
    )
    params, state = dp.RUNNERS[runner](
        tx, helpers.multihost_params(), (x, y, mask), weighted=True
    )
    windows, rest = _hand_windows(mask.sum((1, 2)), 40)
    assert 2 <= len(windows) and {len(w) for w in windows} != {1}, windows
    want = helpers.multihost_params()
    opt = optax.adam(0.05)
    opt_state = opt.init(want)
    for win in windows:
        sl = slice(win[0], win[-1] + 1)
        g = dp._window_grad(
            want, x[sl], y[sl], mask[sl], weighted=True, reduction="mean"
        )
        u, opt_state = opt.update(g, opt_state, want)
        want = optax.apply_updates(want, u)
    dp._assert_same_on_every_device(params)
    chex.assert_trees_all_close(dp._first(params), want, **TOL)
    acc = state[0]
    assert (np.asarray(acc.gradient_step) == len(windows)).all()
    assert (np.asarray(acc.mini_step) == len(rest)).all()


@pytest.mark.parametrize("runner", ["pmap", "shard_map"])
@pytest.mark.devices(8)
def test_hlo_one_scalar_psum_per_micro_batch(runner):
    """Compiled micro-step: deciding on the global weight costs exactly one
    float32 scalar all-reduce outside the window's branch; the gradient is
    still all-reduced only in the closing branch."""
    varying = dp.AXIS if runner == "shard_map" else None
    tree_bytes = 4 * (dp.worker.D_IN * dp.worker.D_OUT + dp.worker.D_OUT)
    tx = oa.chain(
        oa.accumulate(oa.every_weight(40), axis_name=dp.AXIS),
        optax.adam(0.1),
    )
    ours = hlo.summarize(
        dp._compiled_text(
            runner, tx, dp._local_step(tx, weighted=True, varying=varying)
        )
    )
    assert (ours["top_ops"], ours["top_bytes"]) == (1, 4), ours
    assert ours["true_branch_only"], ours
    assert ours["branch_bytes"] == tree_bytes + 4, ours


# --------------------------------------------------------- jit meshes


def _tx(axis_name="data"):
    return oa.chain(
        oa.accumulate(oa.every_weight(40), axis_name=axis_name),
        optax.adam(0.05),
    )


def _feed_one_device(tx, params, state, data, ts, closed):
    """The same micro-steps on one device, off any mesh."""

    def step(params, state, x, y, mask):
        def loss(p):
            per = mh._per_example(p, x, y)
            return (mask * per).sum() / jnp.maximum(mask.sum(), 1.0)

        grads = jax.grad(loss)(params)
        return oa.apply_gradients(
            tx, grads, state, params, accum_weight=mask.sum()
        )

    step = jax.jit(step)
    for t in ts:
        params, state = step(params, state, *(a[t] for a in data))
        closed.append(bool(oa.has_updated(state)))
    return params, state


def _feed(tx, mesh, params, state, data, ts, closed):
    step = jax.jit(mh._step_fn(tx, mesh))
    with jax.set_mesh(mesh):
        for t in ts:
            batch = mh._put_batch(mesh, *(a[t] for a in data))
            params, state, _ = step(params, state, *batch)
            closed.append(bool(oa.has_updated(state)))
    return params, state


def _moved(tx, state, params, mesh):
    params = mh._put_params(mesh, jax.device_get(params))
    return params, oa.reshard_state(tx, jax.device_get(state), params)


@pytest.mark.parametrize("last", ["data8", "one_device"])
@pytest.mark.devices(8)
def test_jit_mesh_resharded_mid_window_keeps_the_boundaries(last):
    """``jax.jit`` on data=2 x fsdp=4, saved mid-window, resumed on data=8,
    saved mid-window again and resumed on data=8 or on one device (off any
    mesh, the same chain without ``axis_name``): the windows close on the same global weights as
    the hand loop, no collective added per micro-batch, and the params
    equal single-device Adam on each window's whole batch."""
    steps, cuts = 12, (5, 9)
    data = mh._make_data(steps, seed=4)
    weights = data[2].sum(1)
    windows, _ = _hand_windows(weights, 40)
    ends = {w[-1] for w in windows}
    assert not {c - 1 for c in cuts} & ends  # both cuts are mid-window
    tx = _tx()
    mesh = mh._mesh("data2xfsdp4")
    with jax.set_mesh(mesh):
        params = mh._put_params(mesh, helpers.mesh_mlp_params())
        state = jax.jit(tx.init)(params)
    closed = []
    params, state = _feed(tx, mesh, params, state, data, range(cuts[0]), closed)
    mesh = mh._mesh("data8")
    params, state = _moved(tx, state, params, mesh)
    assert state[0].acc["w1"].shape[0] == 8
    params, state = _feed(tx, mesh, params, state, data, range(*cuts), closed)
    rest = range(cuts[1], steps)
    if last == "data8":
        params, state = _moved(tx, state, params, mesh)
        params, state = _feed(tx, mesh, params, state, data, rest, closed)
    else:  # the same chain without axis_name: the rows' sum, one device
        one = _tx(None)
        params = jax.device_get(params)
        state = oa.reshard_state(one, jax.device_get(state), params)
        assert state[0].acc["w1"].shape == params["w1"].shape
        params, state = _feed_one_device(one, params, state, data, rest, closed)
    assert closed == [t in ends for t in range(steps)]
    want = helpers.mesh_mlp_params()
    opt = optax.adam(0.05)
    opt_state = opt.init(want)
    for win in windows:
        sl = slice(win[0], win[-1] + 1)
        g = mh._window_grad(want, *(a[sl] for a in data))
        u, opt_state = opt.update(g, opt_state, want)
        want = optax.apply_updates(want, u)
    chex.assert_trees_all_close(jax.device_get(params), want, **mh.TOL)


@pytest.mark.devices(8)
def test_jit_mesh_decides_without_a_collective():
    """On a ``jit`` mesh the window's weight is global already: the
    compiled micro-step has no more collectives over 'data' outside the
    window's branch with a budget than with a fixed ``every_k``."""
    mesh = mh._mesh("data8")
    opt = optax.adam(0.1)
    from optaxaccum._src import collectives

    def top(every_k):
        tx = oa.chain(oa.accumulate(every_k, axis_name="data"), opt)
        ops, _, _ = mh._compiled_census(mesh, tx, ours=True)
        return collectives.over(ops, "data", top=True)

    assert len(top(oa.every_weight(40))) == len(top(3))


# ------------------------------------------- BatchNorm windows follow


def _bn_batches(n, seed=5):
    """``(x, y, tokens)`` micro-batches of 6 rows, a random weight each."""
    rng = np.random.default_rng(seed)
    return [
        (
            (3.0 + 2.0 * rng.normal(size=(6, 4))).astype(np.float32),
            rng.normal(size=6).astype(np.float32),
            np.float32(rng.integers(1, 13)),
        )
        for _ in range(n)
    ]


def _reference_stats(batches, windows, momentum):
    """``nn.BatchNorm``'s running statistics over each concatenated
    window."""
    import flax.linen as nn

    ref = nn.BatchNorm(False, momentum=momentum)
    ref_vars = ref.init(jax.random.key(0), batches[0][0])
    stats = ref_vars["batch_stats"]
    for win in windows:
        _, upd = ref.apply(
            {**ref_vars, "batch_stats": stats},
            jnp.concatenate([batches[i][0] for i in win]),
            mutable=["batch_stats"],
        )
        stats = upd["batch_stats"]
    return stats


def _bn_tx():
    return oa.chain(oa.accumulate(oa.every_weight(20)), optax.sgd(0.1))


def test_trainstate_batchnorm_windows_follow_a_budget():
    """TrainState: the AccumBatchNorm windows (``accum_steps`` the
    longest) close on the calls where the budget closes the optimizer's,
    and the running statistics equal ``nn.BatchNorm`` on each window."""
    from optaxaccum.flax import TrainState
    from tests.flax_helpers import BNHead

    batches = _bn_batches(16)
    model = BNHead(accum_steps=20)
    variables = model.init(jax.random.key(0), batches[0][0], False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=_bn_tx(),
        batch_stats=variables["batch_stats"],
    )

    @jax.jit
    def step(state, x, y, w):
        def loss(params):
            out, upd = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                True,
                mutable=["batch_stats"],
            )
            return ((out - y) ** 2).mean(), upd["batch_stats"]

        grads, bs = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(
            grads=grads, batch_stats=bs, accum_weight=w
        )

    opt_closed, bn_closed = [], []
    for x, y, w in batches:
        state = step(state, x, y, w)
        opt_closed.append(bool(oa.has_updated(state.opt_state)))
        bn = state.batch_stats["AccumBatchNorm_0"]
        bn_closed.append(int(bn["window_step"]) == 0)
    windows, _ = _hand_windows([b[2] for b in batches], 20)
    assert opt_closed == [i in {w[-1] for w in windows} for i in range(16)]
    assert bn_closed == opt_closed
    assert len({len(w) for w in windows}) > 1, windows
    ref = _reference_stats(batches, windows, 0.8)
    for name in ("mean", "var"):
        np.testing.assert_allclose(bn[name], ref[name], **TOL)


def test_nnx_optimizer_batchnorm_windows_follow_a_budget():
    """The same with the nnx Optimizer and its AccumBatchNorm."""
    from flax import nnx

    from optaxaccum.flax import nnx as oa_nnx

    class Head(nnx.Module):
        def __init__(self, rngs):
            self.bn = oa_nnx.AccumBatchNorm(
                4, accum_steps=20, momentum=0.8, rngs=rngs
            )
            self.out = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(self.bn(x))[:, 0]

    batches = _bn_batches(16, seed=6)
    model = Head(nnx.Rngs(0))
    opt = oa_nnx.Optimizer(model, _bn_tx(), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y, w):
        grads = nnx.grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        opt.update(model, grads, accum_weight=w)

    closed = []
    for x, y, w in batches:
        step(model, opt, x, y, w)
        closed.append(int(model.bn.window_step[...]) == 0)
    windows, _ = _hand_windows([b[2] for b in batches], 20)
    assert closed == [i in {w[-1] for w in windows} for i in range(16)]
    ref = _reference_stats(batches, windows, 0.8)
    np.testing.assert_allclose(model.bn.mean[...], ref["mean"], **TOL)
    np.testing.assert_allclose(model.bn.var[...], ref["var"], **TOL)


# ------------------------------------------------ windows beyond 2**24


def _long_window_counts():
    """768 micro-batches of 8 sequences of about 4093 tokens: a window of
    25,149,691 tokens, where a float32 running sum drifts by 35."""
    return [8 * 4093 + (i % 7) for i in range(768)]


def test_window_weight_stays_exact_beyond_2_to_the_24():
    counts = _long_window_counts()
    tx = oa.chain(oa.accumulate(10**6), optax.sgd(1.0))
    params = jnp.zeros(2)
    step = jax.jit(
        lambda s, w: tx.update(jnp.ones(2), s, params, accum_weight=w)[1]
    )
    state = tx.init(params)
    for c in counts:
        state = step(state, jnp.float32(c))
    acc = state[0]
    held = np.float64(acc.weight) + np.float64(acc.weight_low)
    assert held == sum(counts), (held, sum(counts))


def test_every_weight_closes_on_the_micro_batch_that_reaches_total():
    """A budget 20 tokens under the window's exact total closes the window
    on its last micro-batch (a float32 running sum, 35 short, would not)."""
    counts = _long_window_counts()
    tx = oa.chain(
        oa.accumulate(oa.every_weight(sum(counts) - 20)), optax.sgd(1.0)
    )
    params = jnp.zeros(2)
    step = jax.jit(
        lambda s, w: tx.update(jnp.ones(2), s, params, accum_weight=w)[1]
    )
    state = tx.init(params)
    closed = []
    for c in counts:
        state = step(state, jnp.float32(c))
        closed.append(bool(oa.has_updated(state)))
    assert closed.index(True) == len(counts) - 1, closed.index(True)


@pytest.mark.parametrize(
    "total, weights, closes_at",
    [
        # 2**24 + 1 rounds down to 2**24 in float32: the budget's own low
        # part (1) keeps a window of 2**24 open; the next token closes it.
        (2**24 + 1, [2**24, 1, 1], 1),
        # 2**24 + 3 rounds up to 2**24 + 4: a window of 2**24 + 3 (float32
        # 2**24 + 4, low part -1) reaches it exactly.
        (2**24 + 3, [2**24, 2, 1, 1], 2),
    ],
    ids=["budget-rounds-down", "budget-rounds-up"],
)
def test_every_weight_budget_not_a_float32_closes_at_its_exact_value(
    total, weights, closes_at
):
    """A budget beyond 2**24 that float32 cannot hold is compared at its
    exact value (its rounding error beside it, as the window's weight):
    the window closes on the call whose exact total reaches it."""
    tx = oa.chain(oa.accumulate(oa.every_weight(total)), optax.sgd(1.0))
    params = jnp.zeros(2)
    step = jax.jit(
        lambda s, w: tx.update(jnp.ones(2), s, params, accum_weight=w)[1]
    )
    state = tx.init(params)
    closed = []
    for w in weights:
        state = step(state, jnp.float32(w))
        closed.append(bool(oa.has_updated(state)))
    assert closed.index(True) == closes_at, closed
    assert sum(weights[: closes_at + 1]) >= total > sum(weights[:closes_at])
