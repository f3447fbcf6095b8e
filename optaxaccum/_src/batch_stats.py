"""Pooled BatchNorm statistics over an accumulation window (pure JAX).

The arithmetic behind the linen and nnx ``AccumBatchNorm``, published for
any framework as :mod:`optaxaccum.batch_stats` (it imports no flax;
examples/equinox_batchnorm.py builds an Equinox layer on it). A window's
statistics are kept as per-feature ``count``, ``mean`` and ``m2`` (sum of
squared deviations from the mean) in float32 and merged micro-batch by
micro-batch with the parallel-variance formula of Chan, Golub and LeVeque,
so the pooled variance is exact for micro-batches of any sizes -- not an
average of variances. The names without an underscore below that the public
module does not export (the entry names, ``train_step``,
``check_closed_with``) are the Flax layers' own.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optaxaccum._src import utils, windows

# Names of the extra ``batch_stats`` entries (linen) / attributes (nnx).
WINDOW_KEYS = ("window_count", "window_mean", "window_m2", "window_step")
# Every statistic a training micro-batch changes: the running ones and the
# window's.
STAT_KEYS = ("mean", "var", *WINDOW_KEYS)
# The linen layer also records its momentum, so that a flush uses it.
MOMENTUM_KEY = "momentum"


class Window(NamedTuple):
    """The statistics of the current, not yet closed window.

    Attributes:
      elements: per-feature number of elements seen, float32.
      mean: per-feature mean, float32.
      m2: per-feature sum of squared deviations from ``mean``, float32.
      step: number of micro-batches in the window, int32 scalar.

    Examples:
      >>> from optaxaccum import batch_stats
      >>> window = batch_stats.empty_window((2,))
      >>> window.mean, int(window.step)
      (Array([0., 0.], dtype=float32), 0)
    """

    elements: jax.Array
    mean: jax.Array
    m2: jax.Array
    step: jax.Array


def empty_window(feature_shape: Sequence[int]) -> Window:
    """A window that has seen nothing: zero counts, means and sums.

    Args:
      feature_shape: the shape of the per-feature statistics (the input's
        shape without its reduction axes), e.g. ``(num_features,)``.

    Returns:
      A :class:`Window` of float32 zeros of that shape and ``step`` 0.

    Examples:
      >>> from optaxaccum import batch_stats
      >>> batch_stats.empty_window((3,)).elements
      Array([0., 0., 0.], dtype=float32)
    """
    # Three distinct buffers: one array used for three leaves could not be
    # donated (XLA refuses to donate the same buffer twice).
    shape = tuple(feature_shape)
    return Window(
        *(jnp.zeros(shape, jnp.float32) for _ in range(3)),
        step=jnp.zeros([], jnp.int32),
    )


def _checked_axes(ndim: int, axes: Any) -> tuple[int, ...]:
    """``axes`` (an int or a sequence of ints) as sorted non-negative ints
    of an array of rank ``ndim``."""
    if isinstance(axes, numbers.Integral) and not isinstance(axes, bool):
        axes = (axes,)
    if not isinstance(axes, (tuple, list)) or not all(
        isinstance(a, numbers.Integral) and not isinstance(a, bool)
        for a in axes
    ):
        raise TypeError(
            "reduction_axes must be an int or a tuple of ints, got "
            f"reduction_axes={axes!r}"
        )
    if not all(-ndim <= a < ndim for a in axes):
        raise ValueError(
            f"reduction_axes must be axes of x (of rank {ndim}), got "
            f"reduction_axes={axes!r}"
        )
    return tuple(sorted({int(a) % ndim for a in axes}))


def micro_batch_stats(
    x: jax.Array,
    reduction_axes: int | tuple[int, ...],
    *,
    dtype: Any = None,
    mask: jax.Array | None = None,
    axis_name: Any = None,
    axis_index_groups: Any = None,
    use_fast_variance: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The element count, mean and variance of one micro-batch, per feature.

    As flax's ``BatchNorm`` computes them: in ``dtype`` (``x``'s when
    ``None``) widened to at least float32. Counts are summed over
    ``axis_name`` (so devices with different numbers of examples are
    weighted by their size), with one collective for the fast variance and
    two for the two-pass one. A feature with no element (all masked) gets
    count 0, mean 0 and variance 0, so it adds nothing to a window.

    Args:
      x: the micro-batch, a real array.
      reduction_axes: the axes to reduce over (the batch axes; every axis
        but the features'), an int or a tuple of ints.
      dtype: the dtype to compute in, widened to at least float32.
      mask: optional boolean array broadcastable to ``x``: which elements
        count.
      axis_name: optional mapped axis (``pmap``/``shard_map``) to pool the
        statistics over; ``axis_index_groups`` as in ``lax.psum``.
      axis_index_groups: see ``axis_name``.
      use_fast_variance: ``E[x^2] - E[x]^2`` (one pass) if true, else the
        two-pass variance.

    Returns:
      ``(count, mean, var)``, each of the feature shape; the variance is
      the biased one (divided by the count), as BatchNorm's.

    Raises:
      TypeError: if ``x`` is complex, or ``reduction_axes`` is not an int or
        a tuple of ints.
      ValueError: if an axis of ``reduction_axes`` is not an axis of ``x``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from optaxaccum import batch_stats
      >>> x = jnp.array([[0.0, 1.0], [2.0, 5.0]])
      >>> count, mean, var = batch_stats.micro_batch_stats(x, 0)
      >>> count
      Array([2., 2.], dtype=float32)
      >>> mean, var
      (Array([1., 3.], dtype=float32), Array([1., 4.], dtype=float32))
    """
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(
            f"AccumBatchNorm supports real inputs only, got dtype {x.dtype}"
        )
    reduction_axes = _checked_axes(x.ndim, reduction_axes)
    dtype = utils.widen(x.dtype if dtype is None else dtype)
    x = x.astype(dtype)
    if mask is None:
        feature_shape = [
            d for i, d in enumerate(x.shape) if i not in reduction_axes
        ]
        n = jnp.full(
            feature_shape,
            math.prod(x.shape[i] for i in reduction_axes),
            dtype,
        )
        weight = None
    else:
        weight = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
        weight = weight.astype(dtype)
        n = weight.sum(reduction_axes)

    def total(v):
        return (v if weight is None else v * weight).sum(reduction_axes)

    def psum(*vs):
        if axis_name is None:
            return vs
        out = lax.psum(
            jnp.stack(vs), axis_name, axis_index_groups=axis_index_groups
        )
        return tuple(out)

    def per_element(v, n):
        return utils.divide_or(v, n, n > 0)

    if use_fast_variance:
        n, s1, s2 = psum(n, total(x), total(x * x))
        mean = per_element(s1, n)
        var = jnp.maximum(0.0, per_element(s2, n) - mean * mean)
    else:
        n, s1 = psum(n, total(x))
        mean = per_element(s1, n)
        dev = x - jnp.expand_dims(mean, reduction_axes)
        (ss,) = psum(total(dev * dev))
        var = per_element(ss, n)
    return n, mean, var


def merge(
    window: Window, n: jax.Array, mean: jax.Array, var: jax.Array
) -> Window:
    """Adds a micro-batch's statistics to the window (exact pooled variance).

    Args:
      window: the window so far.
      n: the micro-batch's per-feature element count.
      mean: its per-feature mean.
      var: its per-feature (biased) variance.

    Returns:
      The window with the micro-batch merged in and ``step`` one higher.

    Examples:
      >>> import jax.numpy as jnp
      >>> from optaxaccum import batch_stats
      >>> window = batch_stats.empty_window((1,))
      >>> for xb in (jnp.array([[0.0], [2.0]]), jnp.array([[10.0], [12.0]])):
      ...     stats = batch_stats.micro_batch_stats(xb, 0)
      ...     window = batch_stats.merge(window, *stats)
      >>> window.mean, window.m2 / window.elements  # those of all four rows
      (Array([6.], dtype=float32), Array([26.], dtype=float32))
    """
    n, mean, var = (v.astype(jnp.float32) for v in (n, mean, var))
    total = window.elements + n
    frac = utils.divide_or(n, total, total > 0)
    delta = mean - window.mean
    return Window(
        elements=total,
        mean=window.mean + delta * frac,
        m2=window.m2 + var * n + delta * delta * window.elements * frac,
        step=window.step + 1,
    )


def close(
    window: Window,
    ra_mean: jax.Array,
    ra_var: jax.Array,
    momentum: float,
    do_close: jax.Array,
) -> tuple[jax.Array, jax.Array, Window]:
    """Folds the pooled window into the running averages where ``do_close``.

    The running averages become ``momentum * ra + (1 - momentum) * stat``
    with the window's mean and pooled (biased) variance, as BatchNorm's
    once per micro-batch. A window that saw no element (everything masked)
    leaves them unchanged.

    Args:
      window: the window to close.
      ra_mean: the running mean.
      ra_var: the running variance.
      momentum: BatchNorm's momentum, a float (or an array, which takes the
        running averages' dtype).
      do_close: whether to close, a bool or a boolean array (traced under
        ``jit``).

    Returns:
      ``(ra_mean, ra_var, window)``: the window is emptied where it closed;
      elsewhere all three come back unchanged.

    Examples:
      >>> import jax.numpy as jnp
      >>> from optaxaccum import batch_stats
      >>> stats = batch_stats.micro_batch_stats(jnp.array([[1.0], [3.0]]), 0)
      >>> window = batch_stats.merge(batch_stats.empty_window((1,)), *stats)
      >>> mean, var, window = batch_stats.close(
      ...     window, jnp.zeros(1), jnp.ones(1), momentum=0.5, do_close=True)
      >>> mean, var, int(window.step)
      (Array([1.], dtype=float32), Array([1.], dtype=float32), 0)
    """
    seen = window.elements > 0
    pooled_var = utils.divide_or(window.m2, window.elements, seen)
    use = do_close & seen

    def ema(ra, stat):
        # A Python float stays weakly typed, exactly as in nn.BatchNorm; a
        # recorded (array) momentum takes the running average's dtype.
        m = momentum
        if not isinstance(m, (int, float)):
            m = jnp.asarray(m).astype(ra.dtype)
        new = m * ra + (1 - m) * stat.astype(ra.dtype)
        return jnp.where(use, new, ra).astype(ra.dtype)

    new_mean, new_var = ema(ra_mean, window.mean), ema(ra_var, pooled_var)
    empty = empty_window(window.mean.shape)
    window = jax.tree.map(
        lambda e, w: jnp.where(do_close, e, w).astype(w.dtype), empty, window
    )
    return new_mean, new_var, window


def step(
    window: Window,
    ra_mean: jax.Array,
    ra_var: jax.Array,
    stats: tuple[jax.Array, jax.Array, jax.Array],
    *,
    momentum: float,
    every_k: int,
) -> tuple[jax.Array, jax.Array, Window]:
    """One training micro-batch: :func:`merge` its ``stats``, then
    :func:`close` the window once it holds ``every_k`` micro-batches.

    Args:
      window: the window so far.
      ra_mean: the running mean.
      ra_var: the running variance.
      stats: the micro-batch's ``(count, mean, var)``
        (:func:`micro_batch_stats`; stop their gradient first when called
        inside a loss).
      momentum: BatchNorm's momentum.
      every_k: micro-batches per window, a positive int (the layers'
        ``accum_steps``).

    Returns:
      ``(ra_mean, ra_var, window)`` after the micro-batch.

    Raises:
      TypeError, ValueError: if ``every_k`` is not a positive int.

    Examples:
      >>> import jax.numpy as jnp
      >>> from optaxaccum import batch_stats
      >>> state = (batch_stats.empty_window((1,)), jnp.zeros(1), jnp.ones(1))
      >>> for xb in (jnp.array([[0.0], [2.0]]), jnp.array([[10.0], [12.0]])):
      ...     stats = batch_stats.micro_batch_stats(xb, 0)
      ...     mean, var, window = batch_stats.step(
      ...         state[0], *state[1:], stats, momentum=0.0, every_k=2)
      ...     state = (window, mean, var)
      >>> mean, var  # BatchNorm on the concatenated window
      (Array([6.], dtype=float32), Array([26.], dtype=float32))
    """
    every_k = utils.check_positive_int("every_k", every_k)
    window = merge(window, *stats)
    return close(window, ra_mean, ra_var, momentum, window.step >= every_k)


def canonical_axes(ndim: int, axis: Any) -> tuple[int, ...]:
    """Feature axes as sorted non-negative ints."""
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(sorted({a % ndim for a in axes}))


def train_step(
    module: Any,
    x: jax.Array,
    mask: jax.Array | None,
    window: Window,
    ra_mean: jax.Array,
    ra_var: jax.Array,
) -> tuple[jax.Array, jax.Array, Window]:
    """The running statistics after one training micro-batch ``x``.

    ``module`` is a linen or nnx ``AccumBatchNorm``: its ``axis``, ``dtype``,
    ``axis_name``, ``axis_index_groups``, ``use_fast_variance``, ``momentum``
    and ``accum_steps`` are read. Both layers pass ``x`` as their stock layer
    computes statistics on it: ``nnx.BatchNorm`` first casts it to ``dtype``,
    ``nn.BatchNorm`` does not; the statistics are then computed here alike.
    """
    feature_axes = canonical_axes(x.ndim, module.axis)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    stats = micro_batch_stats(
        x,
        reduction_axes,
        dtype=module.dtype,
        mask=mask,
        axis_name=module.axis_name,
        axis_index_groups=module.axis_index_groups,
        use_fast_variance=module.use_fast_variance,
    )
    stats = jax.tree.map(lax.stop_gradient, stats)
    return step(
        window,
        ra_mean,
        ra_var,
        stats,
        momentum=module.momentum,
        every_k=module.accum_steps,
    )


def flush(
    window: Window,
    ra_mean: jax.Array,
    ra_var: jax.Array,
    momentum: float,
    where: Any = True,
) -> tuple[jax.Array, jax.Array, Window]:
    """Closes a partial window (end of an epoch) where ``where``.

    As :func:`close`, with the window's own count (fewer than ``every_k``
    micro-batches); an empty window changes nothing.

    Args:
      window: the window to close.
      ra_mean: the running mean.
      ra_var: the running variance.
      momentum: BatchNorm's momentum.
      where: whether to close, a bool or a boolean array, e.g.
        :func:`closed`: the window then closes with the optimizer's.

    Returns:
      ``(ra_mean, ra_var, window)``, the window emptied where it closed.

    Examples:
      >>> import jax.numpy as jnp
      >>> from optaxaccum import batch_stats
      >>> stats = batch_stats.micro_batch_stats(jnp.array([[1.0], [3.0]]), 0)
      >>> mean, var, window = batch_stats.step(
      ...     batch_stats.empty_window((1,)), jnp.zeros(1), jnp.ones(1), stats,
      ...     momentum=0.0, every_k=4)  # 1 of 4: the window stays open
      >>> batch_stats.flush(window, mean, var, momentum=0.0)[0]
      Array([2.], dtype=float32)
    """
    return close(
        window,
        ra_mean,
        ra_var,
        momentum,
        jnp.logical_and(where, window.step > 0),
    )


def keep_counted(
    old_opt_state: Any, new_opt_state: Any, new: Any, old: Any
) -> Any:
    """The statistics as the optimizer counted the last micro-batch.

    Keeps the BatchNorm windows aligned with the optimizer's: where the
    chain did not take the micro-batch into its window (a loss scale caught
    an overflow, ``skip_nonfinite`` dropped it), the statistics stay as they
    were before its forward pass (docs/concepts.md). The Flax
    ``TrainState`` and nnx ``Optimizer`` do this for their layers.

    Args:
      old_opt_state: the optimizer's state before the call.
      new_opt_state: its state after the call.
      new: the statistics after the micro-batch's forward pass (any pytree).
      old: those before it, of the same structure.

    Returns:
      ``new`` where the call counted, else ``old`` (``new`` when the
      optimizer holds no window: every call counts).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> from optaxaccum import batch_stats
      >>> tx = oa.chain(oa.accumulate(2, skip_nonfinite=True), optax.sgd(1.0))
      >>> s0 = tx.init(jnp.zeros(1))
      >>> _, s1 = tx.update(jnp.full(1, jnp.nan), s0)  # dropped
      >>> batch_stats.keep_counted(s0, s1, jnp.ones(1), jnp.zeros(1))
      Array([0.], dtype=float32)
    """
    counted = windows.counted(old_opt_state, new_opt_state)
    if counted is True:  # no accumulate: every call counts
        return new
    return jax.tree.map(lambda n, o: jnp.where(counted, n, o), new, old)


def closed(old_opt_state: Any, new_opt_state: Any) -> Any:
    """Whether an optimizer call closed the optimizer's window.

    Pass it to :func:`flush` as ``where`` after every optimizer call: the
    BatchNorm windows then close with the optimizer's, whatever its window
    length (a callable ``every_k`` such as
    :func:`optaxaccum.critical_batch_every_k` included); give :func:`step`
    the longest length as ``every_k``.

    Args:
      old_opt_state: the optimizer's state before the call.
      new_opt_state: its state after the call.

    Returns:
      A boolean scalar array; the literal ``False`` when the state holds no
      window (the layers close on their own ``every_k``).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> from optaxaccum import batch_stats
      >>> tx = oa.chain(oa.accumulate(3), optax.sgd(1.0))
      >>> states = [tx.init(jnp.zeros(1))]
      >>> for _ in range(4):
      ...     states.append(tx.update(jnp.ones(1), states[-1])[1])
      >>> [bool(batch_stats.closed(*s)) for s in zip(states, states[1:])]
      [False, False, True, False]
    """
    return windows.closed(old_opt_state, new_opt_state)


def check_closed_with(
    names: Sequence[str],
    old_steps: Sequence[Any],
    new_steps: Sequence[Any],
    counted: Any,
    closed: Any,
) -> None:
    """Raises ``ValueError`` (under ``jit``: when the step runs, from a
    callback taken only then) where a BatchNorm window closed on its own
    ``accum_steps`` on a call that counted but did not close the
    optimizer's window: its ``accum_steps`` is shorter than that window,
    and its running statistics would pool other windows than the
    optimizer's, silently.

    Args:
      names: the layers, for the message.
      old_steps: each layer's ``window_step`` before the call.
      new_steps: each one's after the forward pass (before the optimizer's
        close): 0 after a step of a non-empty window, where it closed.
      counted: whether the optimizer took the call into its window.
      closed: whether the call closed the optimizer's window.
    """
    if not names or closed is False:
        return
    early = jnp.stack(
        [(n == 0) & (o > 0) for o, n in zip(old_steps, new_steps, strict=True)]
    )
    early = early & counted & jnp.logical_not(closed)

    def fail(flags: Any) -> None:
        bad = [name for name, f in zip(names, np.asarray(flags)) if f]
        if bad:
            raise ValueError(
                f"AccumBatchNorm {', '.join(bad)} closed its window on its "
                "own accum_steps on a call that did not close the "
                "optimizer's window: accum_steps is shorter than the "
                "optimizer's window (oa.accumulate's every_k), so the "
                "running statistics would pool windows the optimizer does "
                "not see. Give the layer accum_steps equal to the "
                "optimizer's window, or the longest of a changing one (its "
                "window then closes with the optimizer's)."
            )

    known = utils.concrete(early)
    if known is not None:
        fail(known)
        return
    lax.cond(
        jnp.any(early),
        lambda: jax.debug.callback(fail, early),
        lambda: None,
    )
