"""The public framework-neutral BatchNorm arithmetic, ``optaxaccum.batchnorm``:
its statistics against NumPy on the concatenated window, its input checks,
and its alignment with the optimizer's window."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxaccum as oa
from optaxaccum import batchnorm

MOMENTUM = 0.7


def _run(batches, masks, every_k):
    """The running statistics after ``batches`` through ``step``."""
    features = batches[0].shape[-1]
    window = batchnorm.empty_window((features,))
    mean, var = jnp.zeros(features), jnp.ones(features)
    for x, m in zip(batches, masks, strict=True):
        stats = batchnorm.micro_batch_stats(
            jnp.asarray(x), (0,), mask=None if m is None else jnp.asarray(m)
        )
        mean, var, window = batchnorm.step(
            mean, var, window, stats, momentum=MOMENTUM, every_k=every_k
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
    assert int(window.micro_batches) == 0  # two whole windows: closed


def test_close_ends_a_partial_window_with_its_own_count():
    rng = np.random.default_rng(1)
    batches = [rng.normal(size=(4, 2)).astype(np.float32) for _ in range(2)]
    mean, var, window = _run(batches, [None, None], every_k=5)
    mean, var, window = batchnorm.close(mean, var, window, momentum=MOMENTUM)
    ref_mean, ref_var = _reference(batches, [None, None], every_k=2)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, ref_var, rtol=1e-5, atol=1e-6)
    again = batchnorm.close(mean, var, window, momentum=MOMENTUM)  # a no-op
    np.testing.assert_array_equal(again.running_mean, mean)
    np.testing.assert_array_equal(again.running_var, var)


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
        batchnorm.micro_batch_stats(jnp.ones((4, 3)), axes)


def test_micro_batch_stats_takes_an_int_or_negative_axes():
    x = jnp.arange(12.0).reshape(4, 3)
    want = batchnorm.micro_batch_stats(x, (0,))
    for axes in (0, -2, (-2,), [0]):
        got = batchnorm.micro_batch_stats(x, axes)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("every_k", [0, -1, 2.0, True])
def test_step_names_a_bad_every_k(every_k):
    stats = batchnorm.micro_batch_stats(jnp.ones((2, 1)), 0)
    with pytest.raises((TypeError, ValueError), match="every_k"):
        batchnorm.step(
            jnp.zeros(1),
            jnp.ones(1),
            batchnorm.empty_window((1,)),
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
        stats = batchnorm.micro_batch_stats(x, 0)
        new = batchnorm.step(*bn, stats, momentum=MOMENTUM, every_k=2)
        grads = jnp.where(bad, jnp.nan, x.mean(0))
        params, new_opt = oa.apply_gradients(tx, grads, opt_state, params)
        kept = batchnorm.keep_counted(opt_state, new_opt, old=bn, new=new)
        closed = batchnorm.closed(opt_state, new_opt)
        bn = batchnorm.close(*kept, momentum=MOMENTUM, where=closed)
        return params, new_opt, bn

    params = jnp.zeros(2)
    opt_state = tx.init(params)
    bn = batchnorm.RunningStats(
        jnp.zeros(2), jnp.ones(2), batchnorm.empty_window((2,))
    )
    rng = np.random.default_rng(2)
    xs = [rng.normal(size=(4, 2)).astype(np.float32) for _ in range(5)]
    bad = [False, True, False, False, False]  # the second is dropped
    for x, b in zip(xs, bad, strict=True):
        params, opt_state, bn = train_step(params, opt_state, bn, x, b)
    counted = [x for x, b in zip(xs, bad, strict=True) if not b]
    ref_mean, ref_var = _reference(counted, [None] * 4, every_k=2)
    np.testing.assert_allclose(bn[0], ref_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn[1], ref_var, rtol=1e-5, atol=1e-6)
    assert int(bn.window.micro_batches) == 0


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_closed_is_false_on_a_call_dropped_right_after_a_close(jit):
    """A non-finite micro-batch dropped right after the closing call leaves
    the window at position 0, as the close did; it closed nothing
    ([1, 1, nan, 1, 1] with windows of 2: closes on the 2nd and 5th)."""
    tx = oa.chain(oa.accumulate(2, skip_nonfinite=True), optax.sgd(1.0))
    update = jax.jit(tx.update) if jit else tx.update
    states = [tx.init(jnp.zeros(1))]
    for g in (1.0, 1.0, jnp.nan, 1.0, 1.0):
        states.append(update(jnp.array([g]), states[-1])[1])
    got = [bool(batchnorm.closed(*s)) for s in zip(states, states[1:])]
    assert got == [False, True, False, False, True]


def test_keep_counted_takes_old_and_new_by_keyword():
    """Positional statistics could be swapped silently (both have the same
    structure); by keyword, a dropped micro-batch keeps ``old``."""
    tx = oa.chain(oa.accumulate(2, skip_nonfinite=True), optax.sgd(1.0))
    s0 = tx.init(jnp.zeros(1))
    _, s1 = tx.update(jnp.full(1, jnp.nan), s0)  # dropped: not counted
    old, new = jnp.zeros(1), jnp.ones(1)
    with pytest.raises(TypeError):
        batchnorm.keep_counted(s0, s1, old, new)  # pyright: ignore[reportCallIssue]
    kept = batchnorm.keep_counted(s0, s1, new=new, old=old)
    np.testing.assert_array_equal(kept, old)
    with pytest.raises(ValueError, match="old"):
        batchnorm.keep_counted(s0, s1, old=(old,), new=(new, new))


def test_step_and_close_return_running_stats_in_input_order():
    stats = batchnorm.micro_batch_stats(jnp.array([[1.0], [3.0]]), 0)
    start = batchnorm.RunningStats(
        jnp.zeros(1), jnp.ones(1), batchnorm.empty_window(1)
    )
    out = batchnorm.step(*start, stats, momentum=0.5, every_k=2)
    assert isinstance(out, batchnorm.RunningStats)
    assert int(out.window.micro_batches) == 1  # open: nothing folded in
    np.testing.assert_array_equal(out.running_mean, start.running_mean)
    closed = batchnorm.close(*out, momentum=0.5, where=True)
    assert isinstance(closed, batchnorm.RunningStats)
    np.testing.assert_allclose(closed.running_mean, [1.0])  # 0.5*0 + 0.5*2
    np.testing.assert_allclose(closed.running_var, [1.0])  # 0.5*1 + 0.5*1
    kept = batchnorm.close(*out, momentum=0.5, where=False)
    assert int(kept.window.micro_batches) == 1
    with pytest.raises(TypeError):  # momentum is keyword-only
        batchnorm.close(*out, 0.5)  # pyright: ignore[reportCallIssue]


@pytest.mark.parametrize(
    "feature_shape, shape", [(3, (3,)), ((3,), (3,)), ([2, 3], (2, 3))]
)
def test_empty_window_takes_an_int_or_a_shape(feature_shape, shape):
    window = batchnorm.empty_window(feature_shape)
    assert window.count.shape == window.mean.shape == shape
    assert window.micro_batches.shape == ()


@pytest.mark.parametrize("feature_shape", ["3", 2.0, (2, 1.5), None])
def test_empty_window_names_a_bad_feature_shape(feature_shape):
    with pytest.raises(TypeError, match="feature_shape"):
        batchnorm.empty_window(feature_shape)


def test_merge_names_a_shape_that_is_not_the_windows():
    stats = batchnorm.micro_batch_stats(jnp.ones((4, 2, 3)), 0)  # (2, 3)
    with pytest.raises(ValueError, match=r"merge: count has shape \(2, 3\)"):
        batchnorm.merge(batchnorm.empty_window((3,)), *stats)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3,\)"):
        batchnorm.step(
            jnp.zeros(3),
            jnp.ones(3),
            batchnorm.empty_window((3,)),
            stats,
            momentum=MOMENTUM,
            every_k=2,
        )


def test_close_names_running_statistics_of_another_shape():
    window = batchnorm.empty_window(3)
    with pytest.raises(ValueError, match=r"running_var has shape \(1,\)"):
        batchnorm.close(jnp.zeros(3), jnp.ones(1), window, momentum=MOMENTUM)


@pytest.mark.parametrize("momentum", [1.7, -0.1, float("nan"), np.float32(2)])
def test_a_momentum_outside_0_1_is_named(momentum):
    stats = batchnorm.micro_batch_stats(jnp.ones((2, 1)), 0)
    start = (jnp.zeros(1), jnp.ones(1), batchnorm.empty_window(1))
    with pytest.raises(ValueError, match="momentum"):
        batchnorm.step(*start, stats, momentum=momentum, every_k=1)
    with pytest.raises(ValueError, match="momentum"):
        batchnorm.close(*start, momentum=momentum)


@pytest.mark.parametrize("momentum", ["0.5", True, None])
def test_a_momentum_that_is_not_a_number_is_named(momentum):
    with pytest.raises(TypeError, match="momentum"):
        batchnorm.close(
            jnp.zeros(1),
            jnp.ones(1),
            batchnorm.empty_window(1),
            momentum=momentum,
        )


def test_a_traced_momentum_is_taken_and_bounds_are_inclusive():
    stats = batchnorm.micro_batch_stats(jnp.array([[1.0], [3.0]]), 0)
    start = (jnp.zeros(1), jnp.ones(1), batchnorm.empty_window(1))

    @jax.jit
    def run(m):
        return batchnorm.step(*start, stats, momentum=m, every_k=1)

    np.testing.assert_allclose(run(jnp.float32(0.5)).running_mean, [1.0])
    for m in (0, 0.0, 1, 1.0, np.float32(1.0), jnp.asarray(0.25)):
        batchnorm.step(*start, stats, momentum=m, every_k=1)


def test_micro_batch_stats_names_itself_and_the_dtype_of_complex_x():
    with pytest.raises(TypeError, match=r"micro_batch_stats.*x.*complex64"):
        batchnorm.micro_batch_stats(jnp.ones((2, 1), jnp.complex64), 0)


def test_window_and_running_stats_field_names():
    """One name per quantity (the Flax layers store the window under
    their own names, ``window_count`` ... ``window_step``)."""
    assert batchnorm.Window._fields == ("count", "mean", "m2", "micro_batches")
    assert batchnorm.RunningStats._fields == (
        "running_mean",
        "running_var",
        "window",
    )
