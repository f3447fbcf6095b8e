"""The public framework-neutral BatchNorm layer, ``optaxaccum.batch_stats``:
its statistics against NumPy on the concatenated window, its input checks,
and its alignment with the optimizer's window."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxaccum as oa
from optaxaccum import batch_stats

MOMENTUM = 0.7


def _run(batches, masks, every_k):
    """The running statistics after ``batches`` through ``step``."""
    features = batches[0].shape[-1]
    window = batch_stats.empty_window((features,))
    mean, var = jnp.zeros(features), jnp.ones(features)
    for x, m in zip(batches, masks, strict=True):
        stats = batch_stats.micro_batch_stats(
            jnp.asarray(x), (0,), mask=None if m is None else jnp.asarray(m)
        )
        mean, var, window = batch_stats.step(
            window, mean, var, stats, momentum=MOMENTUM, every_k=every_k
        )
    return mean, var, window


def _reference(batches, masks, every_k):
    """BatchNorm's running statistics, updated once per window on the
    concatenated (unmasked) rows, in float64."""
    mean = np.zeros(batches[0].shape[-1])
    var = np.ones_like(mean)
    for start in range(0, len(batches) - every_k + 1, every_k):
        rows = [
            x if m is None else x[m[:, 0]]
            for x, m in zip(
                batches[start : start + every_k],
                masks[start : start + every_k],
                strict=True,
            )
        ]
        x = np.concatenate(rows).astype(np.float64)
        mean = MOMENTUM * mean + (1 - MOMENTUM) * x.mean(0)
        var = MOMENTUM * var + (1 - MOMENTUM) * x.var(0)
    return mean, var


def test_step_equals_batchnorm_on_the_concatenated_window():
    """Micro-batches of different sizes, one partly masked: the running
    statistics are BatchNorm's on each whole window, not an average of
    the micro-batches' variances."""
    rng = np.random.default_rng(0)
    sizes = (3, 5, 2, 6, 4, 1)
    batches = [
        (rng.normal(size=(n, 3)) * (i + 1) + i).astype(np.float32)
        for i, n in enumerate(sizes)
    ]
    masks = [None] * len(batches)
    masks[3] = np.array([[True], [False], [True], [True], [False], [True]])
    mean, var, window = _run(batches, masks, every_k=3)
    ref_mean, ref_var = _reference(batches, masks, every_k=3)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(var, ref_var, rtol=1e-5, atol=1e-5)
    assert int(window.step) == 0  # two whole windows: closed


def test_flush_closes_a_partial_window_with_its_own_count():
    rng = np.random.default_rng(1)
    batches = [rng.normal(size=(4, 2)).astype(np.float32) for _ in range(2)]
    mean, var, window = _run(batches, [None, None], every_k=5)
    mean, var, window = batch_stats.flush(window, mean, var, MOMENTUM)
    ref_mean, ref_var = _reference(batches, [None, None], every_k=2)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, ref_var, rtol=1e-5, atol=1e-6)
    again = batch_stats.flush(window, mean, var, MOMENTUM)  # empty: no-op
    np.testing.assert_array_equal(again[0], mean)
    np.testing.assert_array_equal(again[1], var)


@pytest.mark.parametrize(
    "axes, error",
    [
        (2, ValueError),
        ((0, -3), ValueError),
        (0.5, TypeError),
        ("0", TypeError),
    ],
)
def test_micro_batch_stats_names_bad_reduction_axes(axes, error):
    with pytest.raises(error, match="reduction_axes"):
        batch_stats.micro_batch_stats(jnp.ones((4, 3)), axes)


def test_micro_batch_stats_takes_an_int_or_negative_axes():
    x = jnp.arange(12.0).reshape(4, 3)
    want = batch_stats.micro_batch_stats(x, (0,))
    for axes in (0, -2, (-2,), [0]):
        got = batch_stats.micro_batch_stats(x, axes)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("every_k", [0, -1, 2.0, True])
def test_step_names_a_bad_every_k(every_k):
    stats = batch_stats.micro_batch_stats(jnp.ones((2, 1)), 0)
    with pytest.raises((TypeError, ValueError), match="every_k"):
        batch_stats.step(
            batch_stats.empty_window((1,)),
            jnp.zeros(1),
            jnp.ones(1),
            stats,
            momentum=MOMENTUM,
            every_k=every_k,
        )


def test_windows_follow_the_optimizer_under_jit():
    """keep_counted drops a micro-batch the chain drops (a non-finite
    gradient), and closed closes the BatchNorm window exactly where the
    optimizer's closes, inside one jitted step."""
    tx = oa.chain(oa.accumulate(2, skip_nonfinite=True), optax.sgd(0.1))

    @jax.jit
    def train_step(params, opt_state, bn, x, bad):
        mean, var, window = bn
        stats = batch_stats.micro_batch_stats(x, 0)
        new = batch_stats.step(
            window, mean, var, stats, momentum=MOMENTUM, every_k=2
        )
        grads = jnp.where(bad, jnp.nan, x.mean(0))
        params, new_opt = oa.apply_gradients(tx, grads, opt_state, params)
        kept = batch_stats.keep_counted(opt_state, new_opt, new, bn)
        closed = batch_stats.closed(opt_state, new_opt)
        bn = batch_stats.flush(kept[2], kept[0], kept[1], MOMENTUM, closed)
        return params, new_opt, bn

    params = jnp.zeros(2)
    opt_state = tx.init(params)
    bn = (jnp.zeros(2), jnp.ones(2), batch_stats.empty_window((2,)))
    rng = np.random.default_rng(2)
    xs = [rng.normal(size=(4, 2)).astype(np.float32) for _ in range(5)]
    bad = [False, True, False, False, False]  # the second is dropped
    for x, b in zip(xs, bad, strict=True):
        params, opt_state, bn = train_step(params, opt_state, bn, x, b)
    counted = [x for x, b in zip(xs, bad, strict=True) if not b]
    ref_mean, ref_var = _reference(counted, [None] * 4, every_k=2)
    np.testing.assert_allclose(bn[0], ref_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn[1], ref_var, rtol=1e-5, atol=1e-6)
    assert int(bn[2].step) == 0
