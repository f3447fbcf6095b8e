"""Tests for optaxaccum.flax: AccumBatchNorm (linen, nnx), TrainState,
nnx.Optimizer and orbax checkpoints in the middle of a window.

References are flax's own ``nn.BatchNorm`` / ``nnx.BatchNorm`` run on the
concatenated window, and the same model trained on the big batch.
"""

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state

import optaxaccum as oa
from optaxaccum import flax as oa_flax
from optaxaccum.flax import AccumBatchNorm, TrainState, flush_batch_stats
from optaxaccum.flax import nnx as oa_nnx
from tests.flax_helpers import BNHead, bn_trainstate_steps

TOL = dict(rtol=2e-5, atol=2e-6)
_WINDOW_KEYS = ("window_count", "window_mean", "window_m2", "window_step")


def _data(sizes, shape, dtype=jnp.float32, seed=0):
    """Micro-batches of the given sizes, not centred, with a feature spread."""
    keys = jax.random.split(jax.random.key(seed), len(sizes))
    return [
        (3.0 + 2.0 * jax.random.normal(k, (n, *shape))).astype(dtype)
        for k, n in zip(keys, sizes)
    ]


def _run_linen(module, variables, batches, **kw):
    stats = variables["batch_stats"]
    outs = []
    for xb in batches:
        y, upd = module.apply(
            {**variables, "batch_stats": stats},
            xb,
            mutable=["batch_stats"],
            **kw,
        )
        stats = upd["batch_stats"]
        outs.append(y)
    return outs, stats


# ---------------------------------------------------------------- linen BN --


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(5,), (4, 4, 3)], ids=["2d", "4d"])
@pytest.mark.parametrize(
    "sizes", [(8, 8, 8), (3, 11, 6)], ids=["equal", "unequal"]
)
def test_linen_running_stats_equal_batchnorm_on_concatenation(
    dtype, shape, sizes
):
    k = len(sizes)
    windows = [_data(sizes, shape, dtype, seed=s) for s in range(3)]
    ours = AccumBatchNorm(
        use_running_average=False, momentum=0.8, accum_steps=k
    )
    ref = nn.BatchNorm(use_running_average=False, momentum=0.8)
    variables = ours.init(jax.random.key(0), windows[0][0])
    ref_stats = ref.init(jax.random.key(0), windows[0][0])["batch_stats"]
    stats = variables["batch_stats"]
    for window in windows:
        # Inside a window the running averages do not move.
        for i, xb in enumerate(window):
            before = stats
            _, stats = _run_linen(
                ours, {**variables, "batch_stats": stats}, [xb]
            )
            if i < k - 1:
                chex.assert_trees_all_equal(stats["mean"], before["mean"])
                chex.assert_trees_all_equal(stats["var"], before["var"])
        _, upd = ref.apply(
            {"params": variables["params"], "batch_stats": ref_stats},
            jnp.concatenate(window),
            mutable=["batch_stats"],
        )
        ref_stats = upd["batch_stats"]
        np.testing.assert_allclose(stats["mean"], ref_stats["mean"], **TOL)
        np.testing.assert_allclose(stats["var"], ref_stats["var"], **TOL)
        assert int(stats["window_step"]) == 0
    assert stats["mean"].dtype == ref_stats["mean"].dtype == jnp.float32


@pytest.mark.parametrize("use_fast_variance", [True, False])
def test_linen_training_outputs_equal_batchnorm_per_micro_batch(
    use_fast_variance,
):
    batches = _data((6, 10), (4, 4, 3))
    ours = AccumBatchNorm(
        use_running_average=False,
        accum_steps=2,
        use_fast_variance=use_fast_variance,
    )
    ref = nn.BatchNorm(
        use_running_average=False, use_fast_variance=use_fast_variance
    )
    variables = ours.init(jax.random.key(0), batches[0])
    ref_vars = ref.init(jax.random.key(0), batches[0])
    outs, _ = _run_linen(ours, variables, batches)
    for xb, y in zip(batches, outs):
        y_ref, _ = ref.apply(ref_vars, xb, mutable=["batch_stats"])
        chex.assert_trees_all_equal(y, y_ref)


def _assert_masked_window_is_the_concatenated_batch(ours, ref, batches, masks):
    """Running statistics of ``ours`` (an AccumBatchNorm closing its window
    on the last of ``batches``) equal those of ``ref`` (``nn.BatchNorm``) on
    the concatenated, masked window."""
    variables = ours.init(jax.random.key(0), batches[0])
    stats = variables["batch_stats"]
    for xb, m in zip(batches, masks):
        _, upd = ours.apply(
            {**variables, "batch_stats": stats},
            xb,
            mask=m,
            mutable=["batch_stats"],
        )
        stats = upd["batch_stats"]
    _, ref_upd = ref.apply(
        ref.init(jax.random.key(0), batches[0]),
        jnp.concatenate(batches),
        mask=jnp.concatenate(masks),
        mutable=["batch_stats"],
    )
    np.testing.assert_allclose(
        stats["mean"], ref_upd["batch_stats"]["mean"], **TOL
    )
    np.testing.assert_allclose(
        stats["var"], ref_upd["batch_stats"]["var"], **TOL
    )


def test_linen_mask_pools_only_unmasked_elements():
    batches = _data((6, 10), (3,))
    masks = [
        jax.random.bernoulli(jax.random.key(i), 0.7, xb.shape)
        for i, xb in enumerate(batches)
    ]
    ours = AccumBatchNorm(
        use_running_average=False, momentum=0.0, accum_steps=2
    )
    ref = nn.BatchNorm(use_running_average=False, momentum=0.0)
    _assert_masked_window_is_the_concatenated_batch(ours, ref, batches, masks)


def test_linen_eval_mode_uses_running_stats():
    (x,) = _data((8,), (3,))
    bn = AccumBatchNorm(accum_steps=2)
    variables = bn.init(jax.random.key(0), x, use_running_average=True)
    stats = {
        **variables["batch_stats"],
        "mean": jnp.array([1.0, 2.0, 3.0]),
        "var": jnp.array([4.0, 1.0, 0.25]),
    }
    y = bn.apply(
        {**variables, "batch_stats": stats}, x, use_running_average=True
    )
    expected = (x - stats["mean"][None]) / jnp.sqrt(
        stats["var"][None] + bn.epsilon
    )
    np.testing.assert_allclose(y, expected, **TOL)


def test_linen_accum_steps_one_is_batchnorm_bit_for_bit():
    batches = _data((8, 8, 5), (4, 4, 3))
    ours = AccumBatchNorm(use_running_average=False, momentum=0.9)
    ref = nn.BatchNorm(use_running_average=False, momentum=0.9)
    variables = ours.init(jax.random.key(0), batches[0])
    ref_vars = ref.init(jax.random.key(0), batches[0])
    chex.assert_trees_all_equal(variables, ref_vars)
    outs, stats = _run_linen(ours, variables, batches)
    ref_outs, ref_stats = _run_linen(ref, ref_vars, batches)
    chex.assert_trees_all_equal((outs, stats), (ref_outs, ref_stats))


def test_linen_loads_pretrained_batchnorm_variables():
    batches = _data((8, 8), (3,))
    ref = nn.BatchNorm(use_running_average=False, momentum=0.5)
    ref_vars = ref.init(jax.random.key(0), batches[0])
    _, ref_vars_trained = _run_linen(ref, ref_vars, batches)
    ref = nn.BatchNorm(momentum=0.5)
    pretrained = {
        "params": {"scale": jnp.array([1.0, 2.0, 0.5]), "bias": jnp.ones(3)},
        "batch_stats": ref_vars_trained,
    }
    ours = AccumBatchNorm(momentum=0.5, accum_steps=2)
    # Evaluation: same output as nn.BatchNorm, from the same variables.
    y = ours.apply(pretrained, batches[0], use_running_average=True)
    y_ref = ref.apply(pretrained, batches[0], use_running_average=True)
    chex.assert_trees_all_equal(y, y_ref)
    # Training: the window entries are created on the first call.
    _, upd = ours.apply(
        pretrained,
        batches[0],
        use_running_average=False,
        mutable=["batch_stats"],
    )
    assert set(upd["batch_stats"]) == {
        "mean",
        "var",
        "momentum",
        "window_count",
        "window_mean",
        "window_m2",
        "window_step",
    }
    chex.assert_trees_all_equal(
        upd["batch_stats"]["mean"], ref_vars_trained["mean"]
    )


@pytest.mark.devices(4)
def test_linen_axis_name_pools_across_devices():
    n_dev = 4
    per_device = _data((4,) * n_dev * 3, (3,))  # 3 micro-batches per device
    ours = AccumBatchNorm(
        use_running_average=False,
        momentum=0.0,
        accum_steps=3,
        axis_name="batch",
    )
    variables = ours.init(jax.random.key(0), per_device[0])
    rep = jax.tree.map(lambda v: jnp.stack([v] * n_dev), variables)

    @functools.partial(jax.pmap, axis_name="batch")
    def step(v, xb):
        _, upd = ours.apply(v, xb, mutable=["batch_stats"])
        return {**v, "batch_stats": upd["batch_stats"]}

    for i in range(3):
        xb = jnp.stack(per_device[i * n_dev : (i + 1) * n_dev])
        rep = step(rep, xb)
    ref = nn.BatchNorm(use_running_average=False, momentum=0.0)
    _, ref_upd = ref.apply(
        ref.init(jax.random.key(0), per_device[0]),
        jnp.concatenate(per_device),
        mutable=["batch_stats"],
    )
    for d in range(n_dev):
        np.testing.assert_allclose(
            rep["batch_stats"]["mean"][d], ref_upd["batch_stats"]["mean"], **TOL
        )
        np.testing.assert_allclose(
            rep["batch_stats"]["var"][d], ref_upd["batch_stats"]["var"], **TOL
        )


def test_pooled_variance_versus_tf_package_average_of_variances():
    """GradientAccumulator (TF) averages per-micro-batch variances; that
    misses the spread of the micro-batch means and is biased low. Ours is the
    variance of the whole window. Figures derived here, not hard-coded."""
    # Micro-batches whose means differ (e.g. a sorted or drifting stream).
    batches = [
        jnp.asarray(
            np.random.default_rng(i).normal(loc=2.0 * i, size=(16, 1)),
            jnp.float32,
        )
        for i in range(4)
    ]
    full = jnp.concatenate(batches)
    true_var = jnp.var(full, axis=0)
    averaged = jnp.mean(
        jnp.stack([jnp.var(b, axis=0) for b in batches]), axis=0
    )
    bn = AccumBatchNorm(use_running_average=False, momentum=0.0, accum_steps=4)
    variables = bn.init(jax.random.key(0), batches[0])
    _, stats = _run_linen(bn, variables, batches)
    np.testing.assert_allclose(stats["var"], true_var, **TOL)
    # The average of variances falls short by the variance of the means.
    means = jnp.stack([jnp.mean(b, axis=0) for b in batches])
    np.testing.assert_allclose(
        true_var - averaged, jnp.var(means, axis=0), rtol=1e-4
    )
    assert float(averaged[0]) < 0.5 * float(true_var[0])


@pytest.mark.parametrize(
    "accum_steps, exc",
    [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)],
)
def test_accum_steps_validated(accum_steps, exc):
    with pytest.raises(exc, match="accum_steps"):
        AccumBatchNorm(accum_steps=accum_steps)
    with pytest.raises(exc, match="accum_steps"):
        oa_nnx.AccumBatchNorm(3, accum_steps=accum_steps, rngs=nnx.Rngs(0))


def test_flush_batch_stats_uses_true_count():
    batches = _data((5, 7), (3,))
    bn = AccumBatchNorm(use_running_average=False, momentum=0.5, accum_steps=4)
    variables = bn.init(jax.random.key(0), batches[0])
    _, stats = _run_linen(bn, variables, batches)
    flushed = flush_batch_stats({"bn": stats, "other": {"mean": jnp.ones(1)}})
    ref = nn.BatchNorm(use_running_average=False, momentum=0.5)
    _, ref_upd = ref.apply(
        ref.init(jax.random.key(0), batches[0]),
        jnp.concatenate(batches),
        mutable=["batch_stats"],
    )
    np.testing.assert_allclose(
        flushed["bn"]["mean"], ref_upd["batch_stats"]["mean"], **TOL
    )
    np.testing.assert_allclose(
        flushed["bn"]["var"], ref_upd["batch_stats"]["var"], **TOL
    )
    assert int(flushed["bn"]["window_step"]) == 0
    chex.assert_trees_all_equal(flushed["other"], {"mean": jnp.ones(1)})
    # An empty window: nothing changes.
    chex.assert_trees_all_equal(flush_batch_stats(flushed), flushed)
    with pytest.raises(TypeError, match="batch_stats"):
        flush_batch_stats(jnp.ones(1))


# ------------------------------------------------------------------ nnx BN --


@pytest.mark.parametrize("shape", [(5,), (4, 4, 3)], ids=["2d", "4d"])
@pytest.mark.parametrize(
    "sizes", [(8, 8), (3, 11, 6)], ids=["equal", "unequal"]
)
def test_nnx_running_stats_equal_batchnorm_on_concatenation(shape, sizes):
    k = len(sizes)
    feats = shape[-1]
    ours = oa_nnx.AccumBatchNorm(
        feats, accum_steps=k, momentum=0.8, rngs=nnx.Rngs(0)
    )
    ref = nnx.BatchNorm(feats, momentum=0.8, rngs=nnx.Rngs(0))
    for seed in range(2):
        window = _data(sizes, shape, seed=seed)
        for i, xb in enumerate(window):
            before = ours.mean[...]
            y = ours(xb)
            y_ref = nnx.BatchNorm(feats, momentum=0.8, rngs=nnx.Rngs(0))(xb)
            chex.assert_trees_all_equal(y, y_ref)
            if i < k - 1:
                chex.assert_trees_all_equal(ours.mean[...], before)
        ref(jnp.concatenate(window))
        np.testing.assert_allclose(ours.mean[...], ref.mean[...], **TOL)
        np.testing.assert_allclose(ours.var[...], ref.var[...], **TOL)
    # Eval mode uses the running statistics.
    x = window[0]
    chex.assert_trees_all_close(
        ours(x, use_running_average=True),
        ref(x, use_running_average=True),
        **TOL,
    )


def test_nnx_accum_steps_one_is_batchnorm_and_flush():
    batches = _data((8, 8, 5), (3,))
    ours = oa_nnx.AccumBatchNorm(3, rngs=nnx.Rngs(0))
    ref = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    for xb in batches:
        chex.assert_trees_all_equal(ours(xb), ref(xb))
    chex.assert_trees_all_equal(nnx.state(ours), nnx.state(ref))
    part = oa_nnx.AccumBatchNorm(
        3, accum_steps=4, momentum=0.0, rngs=nnx.Rngs(0)
    )
    model = nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(1)), part)
    for xb in batches[:2]:
        part(xb)
    oa_nnx.flush_batch_stats(model)
    full = jnp.concatenate(batches[:2])
    np.testing.assert_allclose(part.mean[...], full.mean(0), **TOL)
    np.testing.assert_allclose(part.var[...], full.var(0), **TOL)
    assert int(part.window_step[...]) == 0


# --------------------------------------------------------- training: linen --


class CNN(nn.Module):
    bn: type = nn.BatchNorm
    bn_kwargs: tuple = ()

    @nn.compact
    def __call__(self, x, train: bool):
        # No conv bias: BN removes it, its gradient is rounding noise that
        # Adam would blow up to full-size steps.
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        # An explicit name keeps the variable paths of both models equal.
        x = self.bn(
            use_running_average=not train,
            momentum=0.9,
            name="bn",
            **dict(self.bn_kwargs),
        )(x)
        x = nn.relu(x)
        x = x.mean(axis=(1, 2))
        return nn.Dense(10)(x)


def _images(n, seed):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, 8, 8, 1)), jax.random.randint(
        ky, (n,), 0, 10
    )


def _ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _make_step(model):
    @jax.jit
    def step(state, x, y, **kw):
        def loss_fn(params):
            logits, upd = model.apply(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                True,
                mutable=["batch_stats"],
            )
            return _ce(logits, y), upd["batch_stats"]

        grads, bs = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=bs, **kw)

    return step


def test_trainstate_cnn_accumulate_matches_ghost_batch_reference():
    """accumulate(4) on micro-batches of 16 with AccumBatchNorm equals, per
    window, one Adam step on the mean of the 4 micro-batch gradients (each
    normalized by its own micro-batch, as BN does) with running stats of
    nn.BatchNorm on the 64 examples -- all computed with stock flax."""
    k, micro, windows = 4, 16, 3
    ours = CNN(bn=AccumBatchNorm, bn_kwargs=(("accum_steps", k),))
    ref = CNN()
    x0, _ = _images(micro, 0)
    variables = ours.init(jax.random.key(0), x0, False)
    state = TrainState.create(
        apply_fn=ours.apply,
        params=variables["params"],
        tx=oa.chain(oa.accumulate(k), optax.adam(1e-2)),
        batch_stats=variables["batch_stats"],
    )
    step = _make_step(ours)
    ref_params = variables["params"]
    ref_bs = {
        "bn": {n: variables["batch_stats"]["bn"][n] for n in ("mean", "var")}
    }
    adam = optax.adam(1e-2)
    ref_opt = adam.init(ref_params)
    for w in range(windows):
        x, y = _images(k * micro, 100 + w)
        for i in range(k):
            sl = slice(i * micro, (i + 1) * micro)
            state = step(state, x[sl], y[sl])
        assert bool(oa.has_updated(state.opt_state))

        def micro_loss(p, xb, yb):
            logits, _ = ref.apply(
                {"params": p, "batch_stats": ref_bs},
                xb,
                True,
                mutable=["batch_stats"],
            )
            return _ce(logits, yb)

        grads = [
            jax.grad(micro_loss)(
                ref_params,
                x[i * micro : (i + 1) * micro],
                y[i * micro : (i + 1) * micro],
            )
            for i in range(k)
        ]
        g = jax.tree.map(lambda *gs: sum(gs) / k, *grads)
        _, upd = ref.apply(
            {"params": ref_params, "batch_stats": ref_bs},
            x,
            True,
            mutable=["batch_stats"],
        )
        ref_bs = upd["batch_stats"]
        u, ref_opt = adam.update(g, ref_opt, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
        chex.assert_trees_all_close(
            state.params, ref_params, rtol=1e-5, atol=1e-6
        )
        got = state.batch_stats["bn"]
        np.testing.assert_allclose(got["mean"], ref_bs["bn"]["mean"], **TOL)
        np.testing.assert_allclose(got["var"], ref_bs["bn"]["var"], **TOL)
    assert int(state.step) == k * windows


def test_trainstate_cnn_tracks_big_batch_training():
    """Against the model trained on batches of 64 with nn.BatchNorm: the first
    window's running stats are equal, and afterwards the two runs stay much
    closer to each other than either is to its starting point."""
    k, micro = 4, 16
    ours = CNN(bn=AccumBatchNorm, bn_kwargs=(("accum_steps", k),))
    ref = CNN()
    x0, _ = _images(micro, 0)
    variables = ours.init(jax.random.key(0), x0, False)
    p0 = variables["params"]
    big = flax_train_state.TrainState.create(
        apply_fn=ref.apply, params=p0, tx=optax.adam(1e-3)
    )
    big_bs = {
        "bn": {n: variables["batch_stats"]["bn"][n] for n in ("mean", "var")}
    }
    state = TrainState.create(
        apply_fn=ours.apply,
        params=p0,
        tx=oa.chain(oa.accumulate(k), optax.adam(1e-3)),
        batch_stats=variables["batch_stats"],
    )
    step = _make_step(ours)

    @jax.jit
    def big_step(s, bs, x, y):
        def loss_fn(params):
            logits, upd = ref.apply(
                {"params": params, "batch_stats": bs},
                x,
                True,
                mutable=["batch_stats"],
            )
            return _ce(logits, y), upd["batch_stats"]

        grads, bs = jax.grad(loss_fn, has_aux=True)(s.params)
        return s.apply_gradients(grads=grads), bs

    for w in range(8):
        x, y = _images(k * micro, 200 + w)
        big, big_bs = big_step(big, big_bs, x, y)
        for i in range(k):
            state = step(
                state,
                x[i * micro : (i + 1) * micro],
                y[i * micro : (i + 1) * micro],
            )
        if w == 0:
            got = state.batch_stats["bn"]
            np.testing.assert_allclose(got["mean"], big_bs["bn"]["mean"], **TOL)
            np.testing.assert_allclose(got["var"], big_bs["bn"]["var"], **TOL)
    dist = optax.tree.norm(optax.tree.sub(state.params, big.params))
    moved = optax.tree.norm(optax.tree.sub(big.params, p0))
    assert float(dist) < 0.25 * float(moved), (float(dist), float(moved))


def test_trainstate_fused_path_and_kwargs():
    model = nn.Dense(2)
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    tx = oa.chain(oa.accumulate(2), optax.sgd(1.0))
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    g1 = jax.tree.map(jnp.ones_like, params)
    g2 = jax.tree.map(lambda p: 5 * jnp.ones_like(p), params)
    s1 = state.apply_gradients(grads=g1, accum_weight=3.0)
    chex.assert_trees_all_equal(s1.params, params)  # non-closing: untouched
    s2 = s1.apply_gradients(grads=g2, accum_weight=1.0)
    expected = jax.tree.map(lambda p: p - (3 * 1 + 1 * 5) / 4, params)
    chex.assert_trees_all_close(s2.params, expected)
    assert int(s2.step) == 2
    # Stock flax TrainState works unchanged with an oa.chain.
    stock = flax_train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx
    )
    stock = stock.apply_gradients(grads=g1).apply_gradients(grads=g1)
    chex.assert_trees_all_close(
        stock.params, jax.tree.map(lambda p: p - 1.0, params)
    )
    # flush: the partial window's true mean.
    s3 = s2.apply_gradients(grads=g2).flush()
    chex.assert_trees_all_close(
        s3.params, jax.tree.map(lambda p: p - 5.0, s2.params)
    )


def test_trainstate_drops_batch_stats_of_a_dropped_micro_batch():
    """An overflowing micro-batch is dropped by the loss-scale gate; its
    batch_stats are dropped too, so the BN window stays aligned."""
    model = CNN(bn=AccumBatchNorm, bn_kwargs=(("accum_steps", 2),))
    x, y = _images(8, 0)
    variables = model.init(jax.random.key(0), x, False)
    tx = oa.chain(
        oa.dynamic_loss_scale(2.0**10), oa.accumulate(2), optax.sgd(0.1)
    )
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )
    new_bs = jax.tree.map(lambda v: v + 1, state.batch_stats)
    bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), state.params)
    dropped = state.apply_gradients(grads=bad, batch_stats=new_bs)
    chex.assert_trees_all_equal(dropped.batch_stats, state.batch_stats)
    good = jax.tree.map(jnp.zeros_like, state.params)
    kept = state.apply_gradients(grads=good, batch_stats=new_bs)
    chex.assert_trees_all_equal(kept.batch_stats, new_bs)


# ----------------------------------------------------------- training: nnx --


class NNXCNN(nnx.Module):
    def __init__(self, bn_cls, rngs, **bn_kwargs):
        self.conv = nnx.Conv(1, 8, (3, 3), use_bias=False, rngs=rngs)
        self.bn = bn_cls(8, momentum=0.9, rngs=rngs, **bn_kwargs)
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.conv(x))).mean(axis=(1, 2)))


def test_nnx_optimizer_accumulate_matches_ghost_batch_reference():
    k, micro = 4, 16
    model = NNXCNN(oa_nnx.AccumBatchNorm, nnx.Rngs(0), accum_steps=k)
    ref = NNXCNN(nnx.BatchNorm, nnx.Rngs(0))
    opt = nnx.Optimizer(
        model, oa.chain(oa.accumulate(k), optax.adam(1e-2)), wrt=nnx.Param
    )
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        grads = nnx.grad(lambda m: _ce(m(x), y))(model)
        opt.update(model, grads, accum_weight=1.0)

    for w in range(2):
        x, y = _images(k * micro, 300 + w)
        for i in range(k):
            step(
                model,
                opt,
                x[i * micro : (i + 1) * micro],
                y[i * micro : (i + 1) * micro],
            )
        # Reference: mean of micro-batch gradients (each normalized by its own
        # micro-batch), running stats from the whole window.
        grads = []
        for i in range(k):
            r = nnx.clone(ref)  # a copy: its BN updates do not reach ref
            grads.append(
                nnx.grad(
                    lambda m: _ce(
                        m(x[i * micro : (i + 1) * micro]),
                        y[i * micro : (i + 1) * micro],
                    )
                )(r)
            )
        g = jax.tree.map(lambda *gs: sum(gs) / k, *grads)
        ref(x)  # running statistics of the whole window
        ref_opt.update(ref, g)
        chex.assert_trees_all_close(
            nnx.state(model, nnx.Param),
            nnx.state(ref, nnx.Param),
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_allclose(model.bn.mean[...], ref.bn.mean[...], **TOL)
        np.testing.assert_allclose(model.bn.var[...], ref.bn.var[...], **TOL)


# ------------------------------------------------------------- checkpoints --


def test_orbax_checkpoint_mid_window_resumes_bit_identically(tmp_path):
    k, micro = 4, 8
    model = CNN(bn=AccumBatchNorm, bn_kwargs=(("accum_steps", k),))
    x0, _ = _images(micro, 0)
    variables = model.init(jax.random.key(0), x0, False)
    tx = oa.chain(
        oa.dynamic_loss_scale(2.0**8, period=3),
        oa.agc(0.05),
        oa.accumulate(k),
        optax.adam(1e-2),
    )

    def fresh():
        return TrainState.create(
            apply_fn=model.apply,
            params=variables["params"],
            tx=tx,
            batch_stats=variables["batch_stats"],
        )

    @jax.jit
    def step(state, x, y):
        def loss_fn(params):
            logits, upd = model.apply(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                True,
                mutable=["batch_stats"],
            )
            return _ce(logits, y), upd["batch_stats"]

        (_, bs), grads = oa.scaled_value_and_grad(
            loss_fn, state.opt_state, has_aux=True
        )(state.params)
        return state.apply_gradients(grads=grads, batch_stats=bs)

    batches = [_images(micro, 400 + i) for i in range(2 * k + 2)]
    stop = k + 2  # mid-window

    full = fresh()
    for xb, yb in batches:
        full = step(full, xb, yb)

    first = fresh()
    for xb, yb in batches[:stop]:
        first = step(first, xb, yb)
    assert int(first.opt_state[2].mini_step) == 2  # mid-window
    assert int(first.batch_stats["bn"]["window_step"]) == 2
    assert float(oa.loss_scale(first.opt_state)) > 2.0**8  # the scale moved
    to_save = {
        "step": first.step,
        "params": first.params,
        "opt_state": first.opt_state,
        "batch_stats": first.batch_stats,
    }
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", to_save)
    ckptr.wait_until_finished()
    template = fresh()
    target = {
        "step": template.step,
        "params": template.params,
        "opt_state": template.opt_state,
        "batch_stats": template.batch_stats,
    }
    restored = ckptr.restore(tmp_path / "ckpt", target)
    chex.assert_trees_all_equal_structs(restored, target)
    chex.assert_trees_all_equal(restored, to_save)
    resumed = template.replace(**restored)
    for xb, yb in batches[stop:]:
        resumed = step(resumed, xb, yb)
    chex.assert_trees_all_equal(resumed.params, full.params)
    chex.assert_trees_all_equal(resumed.batch_stats, full.batch_stats)
    chex.assert_trees_all_equal(resumed.opt_state, full.opt_state)


def test_microbatched_value_and_grad_threads_accum_batchnorm_state():
    """The documented recipe: batch_stats threaded through the scan with
    state_argnums; AccumBatchNorm(accum_steps=n) updates the running stats
    once per step, as nn.BatchNorm on the whole batch does, and the gradient
    is the mean of the micro-batch gradients."""
    n, micro = 4, 8
    model = CNN(bn=AccumBatchNorm, bn_kwargs=(("accum_steps", n),))
    ref = CNN()
    x, y = _images(n * micro, 7)
    variables = model.init(jax.random.key(0), x[:micro], False)
    params, bs = variables["params"], variables["batch_stats"]

    def loss_fn(params, batch, batch_stats):
        logits, upd = model.apply(
            {"params": params, "batch_stats": batch_stats},
            batch["x"],
            True,
            mutable=["batch_stats"],
        )
        return _ce(logits, batch["y"]), upd["batch_stats"]

    step = jax.jit(oa.microbatched_value_and_grad(loss_fn, n, state_argnums=2))
    (_, new_bs), grads = step(params, {"x": x, "y": y}, bs)
    ref_bs = {"bn": {k: bs["bn"][k] for k in ("mean", "var")}}
    _, upd = ref.apply(
        {"params": params, "batch_stats": ref_bs},
        x,
        True,
        mutable=["batch_stats"],
    )
    np.testing.assert_allclose(
        new_bs["bn"]["mean"], upd["batch_stats"]["bn"]["mean"], **TOL
    )
    np.testing.assert_allclose(
        new_bs["bn"]["var"], upd["batch_stats"]["bn"]["var"], **TOL
    )
    assert int(new_bs["bn"]["window_step"]) == 0

    def micro_grad(i):
        sl = slice(i * micro, (i + 1) * micro)
        return jax.grad(lambda p: loss_fn(p, {"x": x[sl], "y": y[sl]}, bs)[0])(
            params
        )

    expected = jax.tree.map(
        lambda *gs: sum(gs) / n, *[micro_grad(i) for i in range(n)]
    )
    chex.assert_trees_all_close(grads, expected, rtol=1e-5, atol=1e-6)


def test_fresh_state_can_be_donated():
    """Regression: the window entries were one array used three times, so a
    donating step right after an eager init failed ("donate the same buffer
    twice")."""
    bn = AccumBatchNorm(use_running_average=False, accum_steps=4)
    x = jnp.ones((4, 3))
    variables = bn.init(jax.random.key(0), x)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(variables, x):
        _, upd = bn.apply(variables, x, mutable=["batch_stats"])
        return {**variables, **upd}

    assert int(step(variables, x)["batch_stats"]["window_step"]) == 1
    nbn = oa_nnx.AccumBatchNorm(3, accum_steps=4, rngs=nnx.Rngs(0))
    nnx.jit(lambda m, x: m(x), donate_argnums=0)(nbn, x)
    assert int(nbn.window_step[...]) == 1


# ------------------------------------------------ review findings (edge cases) --


@pytest.mark.parametrize("use_fast_variance", [True, False])
def test_empty_masks_add_nothing_to_the_window(use_fast_variance):
    """A fully masked micro-batch, or a feature masked out in one micro-batch
    (e.g. a padding-only last micro-batch), must not poison the window."""
    batches = _data((3, 3, 4), (2,))
    masks = [
        jnp.ones((3, 2), bool),
        jnp.zeros((3, 2), bool),
        jnp.array([[True, False]] * 4),
    ]
    ours = AccumBatchNorm(
        use_running_average=False,
        momentum=0.0,
        accum_steps=3,
        use_fast_variance=use_fast_variance,
    )
    ref = nn.BatchNorm(
        use_running_average=False,
        momentum=0.0,
        use_fast_variance=use_fast_variance,
    )
    _assert_masked_window_is_the_concatenated_batch(ours, ref, batches, masks)


def test_window_with_every_element_masked_leaves_running_stats_alone():
    """A window in which every element of a feature is masked out leaves
    that feature's running mean and variance exactly as they were (it saw
    no element: nothing to average in); the other features follow
    ``nn.BatchNorm`` on the masked window. A window in which everything is
    masked, closed by its last micro-batch or by a flush, changes no
    running statistic and is emptied."""
    batches = _data((4,) * 7, (2,))  # one shape: one trace
    ours = AccumBatchNorm(
        use_running_average=False, momentum=0.8, accum_steps=2
    )
    ref = nn.BatchNorm(use_running_average=False, momentum=0.8)
    variables = ours.init(jax.random.key(0), batches[0])
    ref_stats = ref.init(jax.random.key(0), batches[0])["batch_stats"]

    @jax.jit
    def apply(stats, xb, m):
        variables_ = {**variables, "batch_stats": stats}
        return ours.apply(variables_, xb, mask=m, mutable=["batch_stats"])[1]

    def run(stats, xs, masks):
        for xb, m in zip(xs, masks, strict=True):
            stats = apply(stats, xb, m)["batch_stats"]
        return stats

    def ref_run(stats, xs, masks):
        _, upd = ref.apply(
            {"params": variables["params"], "batch_stats": stats},
            jnp.concatenate(xs),
            mask=jnp.concatenate(masks),
            mutable=["batch_stats"],
        )
        return upd["batch_stats"]

    # A first window with every element: the running stats move off 0 and 1.
    full = [jnp.ones(xb.shape, bool) for xb in batches[:2]]
    stats = run(variables["batch_stats"], batches[:2], full)
    ref_stats = ref_run(ref_stats, batches[:2], full)
    first = stats
    # Feature 0 masked out in both micro-batches of the second window.
    masks = [jnp.array([[False, True]] * xb.shape[0]) for xb in batches[2:4]]
    stats = run(stats, batches[2:4], masks)
    ref_stats = ref_run(ref_stats, batches[2:4], masks)
    assert int(stats["window_step"]) == 0
    for name in ("mean", "var"):
        assert float(first[name][0]) != {"mean": 0.0, "var": 1.0}[name]
        np.testing.assert_array_equal(stats[name][0], first[name][0])
        np.testing.assert_allclose(stats[name][1], ref_stats[name][1], **TOL)
        assert stats[name][1] != first[name][1]
    # Every element masked: a closed window, then a flushed partial one.
    before = stats
    none = [jnp.zeros(xb.shape, bool) for xb in batches[4:]]
    stats = run(stats, batches[4:6], none[:2])
    assert int(stats["window_step"]) == 0
    stats = flush_batch_stats(run(stats, batches[6:], none[2:]))
    assert int(stats["window_step"]) == 0
    for name in ("mean", "var"):
        np.testing.assert_array_equal(stats[name], before[name])


@pytest.mark.parametrize("axis", [1, (1, 2), (-1, 1)])
@pytest.mark.parametrize("use_fast_variance", [True, False])
def test_feature_axes_and_two_pass_variance(axis, use_fast_variance):
    batches = _data((5, 9), (4, 3, 2))
    kw = dict(
        use_running_average=False,
        momentum=0.5,
        axis=axis,
        use_fast_variance=use_fast_variance,
    )
    ours = AccumBatchNorm(accum_steps=2, **kw)
    ref = nn.BatchNorm(**kw)
    variables = ours.init(jax.random.key(0), batches[0])
    _, stats = _run_linen(ours, variables, batches)
    _, ref_stats = _run_linen(
        ref, ref.init(jax.random.key(0), batches[0]), [jnp.concatenate(batches)]
    )
    np.testing.assert_allclose(stats["mean"], ref_stats["mean"], **TOL)
    np.testing.assert_allclose(stats["var"], ref_stats["var"], **TOL)


def test_nnx_statistics_follow_the_compute_dtype():
    """nnx.BatchNorm computes statistics on x promoted to ``dtype``."""
    batches = _data((8, 8), (3,))
    ours = oa_nnx.AccumBatchNorm(
        3, accum_steps=2, momentum=0.0, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )
    ref = nnx.BatchNorm(3, momentum=0.0, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    for xb in batches:
        ours(xb)
    ref(jnp.concatenate(batches))
    np.testing.assert_allclose(ours.mean[...], ref.mean[...], **TOL)
    np.testing.assert_allclose(ours.var[...], ref.var[...], **TOL)


def test_complex_input_is_rejected():
    bn = AccumBatchNorm(use_running_average=False, accum_steps=2)
    x = jnp.ones((4, 2), jnp.complex64)
    variables = bn.init(jax.random.key(0), x.real)
    with pytest.raises(TypeError, match="real inputs"):
        bn.apply(variables, x, mutable=["batch_stats"])


def test_accum_steps_error_names_value_and_numpy_ints_are_converted():
    with pytest.raises(ValueError, match=r"accum_steps=0"):
        AccumBatchNorm(accum_steps=0)
    assert type(AccumBatchNorm(accum_steps=np.int64(3)).accum_steps) is int
    nbn = oa_nnx.AccumBatchNorm(2, accum_steps=np.int64(3), rngs=nnx.Rngs(0))
    assert type(nbn.accum_steps) is int


def test_trainstate_with_pretrained_plain_batchnorm_variables():
    """Variables of a plain nn.BatchNorm model (no window entries) train
    through TrainState: the first call adds the windows."""
    ref = CNN()
    x, y = _images(8, 0)
    plain = ref.init(jax.random.key(0), x, False)
    model = CNN(bn=AccumBatchNorm, bn_kwargs=(("accum_steps", 2),))
    state = TrainState.create(
        apply_fn=model.apply,
        params=plain["params"],
        tx=oa.chain(oa.accumulate(2), optax.sgd(0.1)),
        batch_stats=plain["batch_stats"],
    )
    step = _make_step(model)
    state = step(state, x, y)
    assert set(state.batch_stats["bn"]) == {
        "mean",
        "var",
        "momentum",
        *_WINDOW_KEYS,
    }
    state = step(state, x, y)
    assert int(state.batch_stats["bn"]["window_step"]) == 0
    assert bool(oa.has_updated(state.opt_state))


def test_trainstate_rejects_misspelled_keywords():
    model = nn.Dense(1)
    params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    state = TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=oa.chain(oa.accumulate(2), optax.sgd(0.1)),
    )
    g = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(TypeError, match="did you mean 'batch_stats'"):
        state.apply_gradients(grads=g, batch_stat={})
    with pytest.raises(TypeError, match="did you mean 'accum_weight'"):
        state.apply_gradients(grads=g, acum_weight=2.0)


def test_trainstate_flush_with_overwrite_with_gradient_and_bn_windows():
    from flax.training.train_state import OVERWRITE_WITH_GRADIENT as OWG

    params = {"params": {"w": jnp.zeros(2)}, OWG: {"fp8": jnp.ones(1)}}
    state = TrainState.create(
        apply_fn=None,
        params=params,
        tx=oa.chain(oa.accumulate(4), optax.sgd(1.0)),
    )
    grads = {
        "params": {"w": jnp.array([2.0, 4.0])},
        OWG: {"fp8": jnp.full(1, 7.0)},
    }
    state = state.apply_gradients(grads=grads)
    chex.assert_trees_all_equal(state.params[OWG], grads[OWG])
    flushed = state.flush()
    np.testing.assert_allclose(flushed.params["params"]["w"], [-2.0, -4.0])
    chex.assert_trees_all_equal(flushed.params[OWG], grads[OWG])
    # With AccumBatchNorm windows, closed with the layer's own momentum.
    bn = AccumBatchNorm(use_running_average=False, accum_steps=2)
    v = bn.init(jax.random.key(0), jnp.ones((2, 1)))
    _, upd = bn.apply(v, jnp.ones((2, 1)), mutable=["batch_stats"])
    with_bn = state.replace(batch_stats=upd["batch_stats"])
    assert int(with_bn.batch_stats["window_step"]) == 1
    assert int(with_bn.flush().batch_stats["window_step"]) == 0


def test_flush_batch_stats_keeps_mapping_type_and_works_under_jit():
    import collections

    bn = AccumBatchNorm(use_running_average=False, momentum=0.0, accum_steps=4)
    v = bn.init(jax.random.key(0), jnp.ones((2, 1)))
    _, upd = bn.apply(v, jnp.array([[1.0], [3.0]]), mutable=["batch_stats"])
    od = collections.OrderedDict(upd["batch_stats"])
    out = flush_batch_stats(od)
    assert type(out) is collections.OrderedDict
    jitted = jax.jit(flush_batch_stats)(upd["batch_stats"])
    np.testing.assert_allclose(jitted["mean"], [2.0])
    # The deprecated momentum, traced: not checkable, used as before.
    with pytest.warns(DeprecationWarning):
        jitted = jax.jit(flush_batch_stats)(upd["batch_stats"], 0.5)
    np.testing.assert_allclose(jitted["mean"], [1.0])


# ---------------------------------------- bad input, dtypes of the statistics --


class TwoBN(nn.Module):
    """Two AccumBatchNorm layers with different momenta on the same input
    (``plain``: the same model with nn.BatchNorm)."""

    k: int
    plain: bool = False

    @nn.compact
    def __call__(self, x, train: bool):
        def bn(momentum, name):
            kw = dict(
                use_running_average=not train, momentum=momentum, name=name
            )
            if self.plain:
                return nn.BatchNorm(**kw)
            return AccumBatchNorm(accum_steps=self.k, **kw)

        return nn.Dense(1)(bn(0.5, "bn_a")(x) + bn(0.9, "bn_b")(x))


def _two_bn_state(k, variables=None):
    model = TwoBN(k)
    if variables is None:
        variables = model.init(jax.random.key(0), jnp.ones((4, 3)), False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=oa.chain(oa.accumulate(k), optax.sgd(0.1)),
        batch_stats=variables["batch_stats"],
    )

    @jax.jit
    def step(state, x):
        def loss_fn(params):
            y, upd = model.apply(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                True,
                mutable=["batch_stats"],
            )
            return jnp.mean(y**2), upd["batch_stats"]

        grads, bs = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=bs)

    return state, step


def test_trainstate_flush_uses_each_layers_own_momentum():
    """``flush()`` needs no momentum; each layer's window is
    folded in with that layer's momentum, as stock nn.BatchNorm with that
    momentum does on the concatenated (partial) window."""
    k = 4
    state, step = _two_bn_state(k)
    batches = _data((6,) * 6, (3,))  # a full window, then 2 of 4
    for xb in batches:
        state = step(state, xb)
    assert int(state.batch_stats["bn_a"]["window_step"]) == 2
    flushed = state.flush()
    assert bool(oa.has_updated(flushed.opt_state))
    for name, momentum in (("bn_a", 0.5), ("bn_b", 0.9)):
        ref = nn.BatchNorm(use_running_average=False, momentum=momentum)
        ref_vars = ref.init(jax.random.key(0), batches[0])
        _, ref_stats = _run_linen(
            ref,
            ref_vars,
            [jnp.concatenate(batches[:k]), jnp.concatenate(batches[k:])],
        )
        got = flushed.batch_stats[name]
        np.testing.assert_allclose(got["mean"], ref_stats["mean"], **TOL)
        np.testing.assert_allclose(got["var"], ref_stats["var"], **TOL)
        assert int(got["window_step"]) == 0
    # The same under jit, and the standalone helper agrees.
    chex.assert_trees_all_close(
        jax.jit(TrainState.flush)(state).batch_stats, flushed.batch_stats
    )
    chex.assert_trees_all_close(
        flush_batch_stats(state.batch_stats), flushed.batch_stats
    )


def test_trainstate_flush_passes_extra_args_to_the_chain():
    """``flush(value=...)`` reaches reduce_on_plateau, exactly
    as oa.flush(tx, ..., value=...) driven by hand."""
    model = nn.Dense(2)
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    tx = oa.chain(
        oa.accumulate(3),
        optax.sgd(1.0),
        optax.contrib.reduce_on_plateau(patience=1, factor=0.5),
    )
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    for i in range(5):  # a full window (value 1.0), then 2 of 3
        g = jax.tree.map(lambda p: (i + 1.0) * jnp.ones_like(p), params)
        state = state.apply_gradients(grads=g, value=jnp.float32(1.0))
    scale = []
    for value in (0.5, 2.0):  # better, then worse than the best (1.0)
        got = state.flush(value=jnp.float32(value))
        updates, opt_state = oa.flush(
            tx, state.opt_state, state.params, value=jnp.float32(value)
        )
        chex.assert_trees_all_equal(got.opt_state, opt_state)
        chex.assert_trees_all_equal(
            got.params, optax.apply_updates(state.params, updates)
        )
        scale.append(float(got.opt_state[2].scale))
    # The value made a difference: a worse value halves the plateau scale.
    assert scale == [1.0, 0.5]


def test_flush_batch_stats_momentum_is_deprecated_and_checked():
    """The old keyword still works, with a DeprecationWarning; a value that
    is not the layer's own momentum raises instead of shifting the stats."""
    state, step = _two_bn_state(4)
    for xb in _data((6, 6), (3,)):
        state = step(state, xb)
    one = {"bn_a": state.batch_stats["bn_a"]}
    with pytest.warns(DeprecationWarning, match="batch_stats_momentum"):
        same = state.replace(batch_stats=one).flush(batch_stats_momentum=0.5)
    chex.assert_trees_all_equal(
        same.batch_stats, state.replace(batch_stats=one).flush().batch_stats
    )
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ValueError, match=r"bn_b.*0\.9"),
    ):
        state.flush(batch_stats_momentum=0.5)
    with (
        pytest.warns(DeprecationWarning, match="momentum"),
        pytest.raises(ValueError, match=r"bn_a.*0\.5"),
    ):
        flush_batch_stats(state.batch_stats, 0.9)
    # batch_stats without a recorded momentum (an older optaxaccum): the
    # deprecated keyword is used; without it, a clear error.
    old = {"bn_a": {k: v for k, v in one["bn_a"].items() if k != "momentum"}}
    with pytest.raises(ValueError, match="convert_batch_stats"):
        state.replace(batch_stats=old).flush()
    with pytest.warns(DeprecationWarning):
        legacy = state.replace(batch_stats=old).flush(batch_stats_momentum=0.5)
    for key in ("mean", "var"):
        chex.assert_trees_all_equal(
            legacy.batch_stats["bn_a"][key], same.batch_stats["bn_a"][key]
        )


def test_convert_batch_stats_gives_the_full_structure_for_scan():
    """Plain nn.BatchNorm variables change the state's tree
    structure on the first training call, so lax.scan with the TrainState as
    carry fails; converted up front, the scan runs and equals step by step."""
    k, n = 2, 5
    xs = jnp.stack(_data((6,) * n, (3,)))
    plain = TwoBN(k, plain=True).init(jax.random.key(0), xs[0], False)
    state, step = _two_bn_state(k, plain)

    def body(state, x):
        return step(state, x), None

    with pytest.raises(TypeError, match="carry"):
        jax.lax.scan(body, state, xs)
    template = TwoBN(k).init(jax.random.key(1), xs[0], False)["batch_stats"]
    converted = oa_flax.convert_batch_stats(plain["batch_stats"], template)
    chex.assert_trees_all_equal_structs(converted, template)
    for name in ("bn_a", "bn_b"):
        for key in ("mean", "var"):
            chex.assert_trees_all_equal(
                converted[name][key], plain["batch_stats"][name][key]
            )
    scanned, _ = jax.lax.scan(body, state.replace(batch_stats=converted), xs)
    for x in xs:
        state = step(state, x)
    chex.assert_trees_all_close(
        scanned.params, state.params, rtol=1e-5, atol=1e-6
    )
    chex.assert_trees_all_close(
        scanned.batch_stats, state.batch_stats, rtol=1e-5, atol=1e-6
    )
    assert int(scanned.batch_stats["bn_a"]["window_step"]) == 1
    # Idempotent; an older optaxaccum's batch_stats get the momentum entry.
    chex.assert_trees_all_equal(
        oa_flax.convert_batch_stats(converted, template), converted
    )
    older = {
        name: {key: v for key, v in layer.items() if key != "momentum"}
        for name, layer in converted.items()
    }
    chex.assert_trees_all_equal(
        oa_flax.convert_batch_stats(older, template), converted
    )


def test_convert_batch_stats_rejects_what_does_not_match():
    model = TwoBN(2)
    template = model.init(jax.random.key(0), jnp.ones((4, 3)), False)[
        "batch_stats"
    ]
    plain = {
        name: {"mean": jnp.zeros(3), "var": jnp.ones(3)}
        for name in ("bn_a", "bn_b")
    }
    with pytest.raises(ValueError, match="bn_b"):
        oa_flax.convert_batch_stats({"bn_a": plain["bn_a"]}, template)
    with pytest.raises(ValueError, match="extra"):
        oa_flax.convert_batch_stats({**plain, "extra": plain["bn_a"]}, template)
    with pytest.raises(ValueError, match=r"bn_a.*mean.*\(4,\)"):
        oa_flax.convert_batch_stats(
            {**plain, "bn_a": {"mean": jnp.zeros(4), "var": jnp.ones(3)}},
            template,
        )
    with pytest.raises(TypeError, match="jax.eval_shape"):
        oa_flax.convert_batch_stats(plain, jax.eval_shape(lambda: template))
    # A mid-window template gives an empty window, not its own.
    state, step = _two_bn_state(2)
    state = step(state, jnp.ones((4, 3)))
    out = oa_flax.convert_batch_stats(plain, state.batch_stats)
    assert int(out["bn_a"]["window_step"]) == 0
    chex.assert_trees_all_equal(out["bn_a"]["window_count"], jnp.zeros(3))
    np.testing.assert_allclose(out["bn_b"]["momentum"], 0.9)


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("dtype", [None, "x"])
def test_linen_and_nnx_statistics_agree_for_half_precision_inputs(
    x_dtype, dtype
):
    """For half-precision inputs the linen and nnx layers pool the
    same statistics, equal to their stock layers on the concatenation."""
    dtype = x_dtype if dtype == "x" else dtype
    batches = _data((6, 10), (3,), x_dtype)
    lin = AccumBatchNorm(
        use_running_average=False, momentum=0.0, accum_steps=2, dtype=dtype
    )
    _, lin_stats = _run_linen(
        lin, lin.init(jax.random.key(0), batches[0]), batches
    )
    nbn = oa_nnx.AccumBatchNorm(
        3, accum_steps=2, momentum=0.0, dtype=dtype, rngs=nnx.Rngs(0)
    )
    for xb in batches:
        nbn(xb)
    chex.assert_trees_all_equal(
        (lin_stats["mean"], lin_stats["var"]), (nbn.mean[...], nbn.var[...])
    )
    ref = nn.BatchNorm(use_running_average=False, momentum=0.0, dtype=dtype)
    _, ref_stats = _run_linen(
        ref, ref.init(jax.random.key(0), batches[0]), [jnp.concatenate(batches)]
    )
    np.testing.assert_allclose(lin_stats["mean"], ref_stats["mean"], **TOL)
    np.testing.assert_allclose(lin_stats["var"], ref_stats["var"], **TOL)


@pytest.mark.parametrize(
    "x_dtype, kw",
    [
        (jnp.float32, {}),
        (
            jnp.bfloat16,
            dict(param_dtype=jnp.bfloat16, force_float32_reductions=False),
        ),
    ],
    ids=["f32", "bf16-no-f32-reductions"],
)
def test_linen_accum_batchnorm_under_strict_dtype_promotion(x_dtype, kw):
    """Where stock nn.BatchNorm runs under
    jax_numpy_dtype_promotion='strict', AccumBatchNorm (and its flush) does
    too, with the results of the standard mode."""
    batches = _data((6, 10, 4), (3,), x_dtype)
    bn = AccumBatchNorm(
        use_running_average=False, momentum=0.5, accum_steps=2, **kw
    )

    @jax.jit
    def run(batches):
        variables = bn.init(jax.random.key(0), batches[0])
        _, stats = _run_linen(bn, variables, batches)
        return stats, flush_batch_stats(stats)

    standard = run(batches)
    with jax.numpy_dtype_promotion("strict"):
        ref = nn.BatchNorm(use_running_average=False, **kw)
        ref.apply(
            ref.init(jax.random.key(0), batches[0]),
            batches[0],
            mutable=["batch_stats"],
        )  # stock flax runs here
        strict = run(batches)
    chex.assert_trees_all_equal(strict, standard)
    assert (
        strict[1]["mean"].dtype
        == ref.init(jax.random.key(0), batches[0])["batch_stats"]["mean"].dtype
    )


def test_recorded_momentum_follows_the_layer():
    """The momentum entry is the training layer's, also for batch_stats
    saved by a layer with another momentum (e.g. a checkpoint)."""
    x = jnp.ones((4, 3))
    old = AccumBatchNorm(use_running_average=False, momentum=0.5, accum_steps=2)
    variables = old.init(jax.random.key(0), x)
    np.testing.assert_allclose(variables["batch_stats"]["momentum"], 0.5)
    new = AccumBatchNorm(use_running_average=False, momentum=0.9, accum_steps=2)
    _, upd = new.apply(variables, x, mutable=["batch_stats"])
    assert upd["batch_stats"]["momentum"].dtype == jnp.float32
    np.testing.assert_allclose(upd["batch_stats"]["momentum"], 0.9)


# ------------------------------- BatchNorm windows follow the optimizer's --


def _critical_batch_tx():
    """Windows of 2 to 5 micro-batches, sized from the noise scale."""
    every_k = oa.critical_batch_every_k(2, 5, micro_batch_weight=1)
    return oa.chain(
        oa.accumulate(every_k, noise_scale_decay=0.0), optax.sgd(0.1)
    )


def _windows_of(closed):
    """The calls of each window, from the calls that closed one."""
    ends = [i for i, c in enumerate(closed) if c]
    return [range(a + 1, b + 1) for a, b in zip([-1, *ends], ends)]


@pytest.mark.parametrize("jit", [False, True])
def test_trainstate_batchnorm_windows_close_with_a_critical_batch_window(jit):
    """With ``every_k=oa.critical_batch_every_k(...)`` the optimizer's
    windows change length; the AccumBatchNorm windows (``accum_steps`` the
    longest) close exactly on the calls where the optimizer's closes, and
    the running statistics equal ``nn.BatchNorm`` on each concatenated
    window."""
    model = BNHead(accum_steps=5)
    batches = [
        (
            3.0 + 2.0 * jax.random.normal(jax.random.key(i), (6, 4)),
            jax.random.normal(jax.random.key(100 + i), (6,)),
        )
        for i in range(18)
    ]
    variables = model.init(jax.random.key(0), batches[0][0], False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=_critical_batch_tx(),
        batch_stats=variables["batch_stats"],
    )

    def step(state, x, y):
        def loss(params):
            out, upd = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                True,
                mutable=["batch_stats"],
            )
            return ((out - y) ** 2).mean(), upd["batch_stats"]

        grads, bs = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=bs)

    step = jax.jit(step) if jit else step
    opt_closed, bn_closed = [], []
    for x, y in batches:
        state = step(state, x, y)
        opt_closed.append(bool(oa.has_updated(state.opt_state)))
        bn = state.batch_stats["AccumBatchNorm_0"]
        bn_closed.append(int(bn["window_step"]) == 0)
    windows = _windows_of(opt_closed)
    assert len({len(w) for w in windows}) > 1, windows  # lengths change
    assert bn_closed == opt_closed
    ref = nn.BatchNorm(False, momentum=0.8)
    ref_vars = ref.init(jax.random.key(0), batches[0][0])
    ref_stats = ref_vars["batch_stats"]
    for w in windows:
        _, upd = ref.apply(
            {**ref_vars, "batch_stats": ref_stats},
            jnp.concatenate([batches[i][0] for i in w]),
            mutable=["batch_stats"],
        )
        ref_stats = upd["batch_stats"]
    for name in ("mean", "var"):
        np.testing.assert_allclose(bn[name], ref_stats[name], **TOL)


def _with_older_batch_stats(tx):
    """A ``TrainState`` of ``tx`` whose ``batch_stats`` come from an older
    optaxaccum (a window, no recorded momentum); those ``batch_stats``; and
    gradients of ones."""
    model = BNHead(accum_steps=2)
    x = jax.random.normal(jax.random.key(0), (4, 4))
    variables = model.init(jax.random.key(0), x, False)
    layer = variables["batch_stats"]["AccumBatchNorm_0"]
    older = {
        "AccumBatchNorm_0": {k: v for k, v in layer.items() if k != "momentum"}
    }
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=older,
    )
    return state, older, jax.tree.map(jnp.ones_like, state.params)


def test_every_message_about_older_batch_stats_gives_one_advice():
    """The error, the deprecation and the warning about ``batch_stats`` to
    convert all give the same advice, with the call to make."""
    from optaxaccum.flax import _linen

    advice = _linen.CONVERT_ADVICE
    assert "convert_batch_stats(batch_stats, model.init(" in advice
    state, older, grads = _with_older_batch_stats(
        oa.chain(oa.accumulate(1), optax.sgd(0.1))
    )
    with pytest.raises(ValueError) as error:
        flush_batch_stats(older)
    with pytest.warns(DeprecationWarning) as deprecation:
        flush_batch_stats(older, 0.5)
    with pytest.warns(UserWarning) as warning:
        state.apply_gradients(grads=grads, batch_stats=older)
    for message in (error.value, deprecation[0].message, warning[0].message):
        assert advice in str(message), message


@pytest.mark.parametrize("jit", [False, True])
def test_trainstate_keeps_stepping_batch_stats_without_a_momentum(jit):
    """``batch_stats`` of an older optaxaccum (windows, no recorded
    momentum) still step through ``apply_gradients``: the layers keep
    closing their windows on ``accum_steps`` (they cannot close with the
    optimizer's window without the momentum), and a warning says how to
    convert them (convert_batch_stats)."""
    state, older, grads = _with_older_batch_stats(
        oa.chain(oa.accumulate(2), optax.sgd(0.1))
    )

    def step(state):
        return state.apply_gradients(grads=grads, batch_stats=older)

    step = jax.jit(step) if jit else step
    with pytest.warns(UserWarning, match="convert_batch_stats"):
        for _ in range(2):
            state = step(state)
    assert bool(oa.has_updated(state.opt_state))
    chex.assert_trees_all_equal(state.batch_stats, older)


@pytest.mark.parametrize("plain", [False, True], ids=["accumulate", "optax"])
def test_trainstate_warns_about_older_batch_stats_only_where_a_close_is_due(
    plain,
):
    """The warning about ``batch_stats`` without a recorded momentum comes
    where the optimizer's window closes (calls 2 and 4 of four with
    ``oa.accumulate(2)``: where the layers would have closed with it), not
    on every call, and never with a plain optax optimizer (no window to
    follow: the layers close on ``accum_steps``, as they always did)."""
    tx = optax.sgd(0.1)
    tx = tx if plain else oa.chain(oa.accumulate(2), tx)
    state, older, grads = _with_older_batch_stats(tx)
    warned = []
    for _ in range(4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = state.apply_gradients(grads=grads, batch_stats=older)
        texts = [str(w.message) for w in caught]
        assert all("convert_batch_stats" in t for t in texts), texts
        warned.append(len(texts))
    assert warned == ([0] * 4 if plain else [0, 1, 0, 1])


@pytest.mark.parametrize("jit", [False, True])
def test_trainstate_batchnorm_accum_steps_shorter_than_the_window_raises(jit):
    """AccumBatchNorm(accum_steps=4) under a TrainState whose windows are 6
    long closed its window after 4 micro-batches and again with the
    optimizer's (after 2 more): running statistics 0.55 away from
    BatchNorm on the windows, silently. The call where it closes on its own
    raises ValueError naming the layer and the mismatch (under jit when the
    step runs); accum_steps equal to the window, or longer, steps on."""
    match = r"AccumBatchNorm at batch_stats\['AccumBatchNorm_0'\].*accum_steps"
    with pytest.raises(Exception, match=match):
        bn_trainstate_steps(4, 6, 5, jit)
    bn_trainstate_steps(4, 6, 3, jit)  # before the 4th: nothing yet
    for accum_steps in (6, 7):
        state = bn_trainstate_steps(accum_steps, 6, 8, jit)
        bn = state.batch_stats["AccumBatchNorm_0"]
        assert int(bn["window_step"]) == 2
