"""Pooled BatchNorm statistics over an accumulation window (pure JAX).

The arithmetic behind the linen and nnx ``AccumBatchNorm``, published for
any framework as :mod:`optaxaccum.batchnorm` (it imports no flax;
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

from optaxaccum._src import checks, numerics, windows

# Names of the extra ``batch_stats`` entries (linen) / attributes (nnx), one
# per field of :class:`Window`, in its order. They are stored in users'
# variables and checkpoints: keep them as they are (``window_step`` holds
# ``Window.micro_batches``).
WINDOW_KEYS = ("window_count", "window_mean", "window_m2", "window_step")
# Every statistic a training micro-batch changes: the running ones and the
# window's.
STAT_KEYS = ("mean", "var", *WINDOW_KEYS)
# The linen layer also records its momentum, so that a flush uses it.
MOMENTUM_KEY = "momentum"


class Window(NamedTuple):
    """The statistics of the current, not yet closed window.

    Attributes:
      count: per-feature number of elements seen, float32.
      mean: per-feature mean, float32.
      m2: per-feature sum of squared deviations from ``mean``, float32.
      micro_batches: number of micro-batches merged into the window, an
        int32 scalar (the Flax layers store it as ``window_step``).

    Examples:
      >>> from optaxaccum import batchnorm
      >>> window = batchnorm.empty_window(2)
      >>> window.mean, int(window.micro_batches)
      (Array([0., 0.], dtype=float32), 0)
    """

    # ``count`` hides tuple.count, on purpose: it is the name that
    # micro_batch_stats and the Flax layers' ``window_count`` give it.
    count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]
    mean: jax.Array
    m2: jax.Array
    micro_batches: jax.Array


class RunningStats(NamedTuple):
    """BatchNorm's running statistics and its open window, as
    :func:`step` and :func:`close` take and return them.

    Attributes:
      running_mean: the running mean.
      running_var: the running (biased) variance.
      window: the statistics of the window not yet folded into them.
    """

    running_mean: jax.Array
    running_var: jax.Array
    window: Window


def empty_window(feature_shape: int | Sequence[int]) -> Window:
    """A window that has seen nothing: zero counts, means and sums.

    Args:
      feature_shape: the shape of the per-feature statistics (the input's
        shape without its reduction axes): ``num_features`` or a tuple
        such as ``(num_features,)``.

    Returns:
      A :class:`Window` of float32 zeros of that shape and
      ``micro_batches`` 0.

    Raises:
      TypeError: if ``feature_shape`` is not an int or a sequence of ints.

    Examples:
      >>> from optaxaccum import batchnorm
      >>> batchnorm.empty_window((3,)).count
      Array([0., 0., 0.], dtype=float32)
    """
    shape = _feature_shape(feature_shape)
    # Three distinct buffers: one array used for three leaves could not be
    # donated (XLA refuses to donate the same buffer twice).
    return Window(
        *(jnp.zeros(shape, jnp.float32) for _ in range(3)),
        micro_batches=jnp.zeros([], jnp.int32),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _feature_shape(value: Any) -> tuple[int, ...]:
    """``empty_window``'s ``feature_shape`` as a tuple of ints."""
    if _is_int(value):
        return (int(value),)
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(_is_int(d) for d in value)
    ):
        return tuple(int(d) for d in value)
    raise TypeError(
        "empty_window: feature_shape must be an int or a sequence of ints, "
        f"got feature_shape={value!r}"
    )


def _check_real_input(x: jax.Array, who: str) -> None:
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(
            f"{who} supports real inputs only, got x of dtype {x.dtype}"
        )


def _checked_axes(
    ndim: int, axes: Any, name: str = "reduction_axes"
) -> tuple[int, ...]:
    """``axes`` (an int or a sequence of ints, the argument ``name``) as
    sorted non-negative ints of an array of rank ``ndim``."""
    if _is_int(axes):
        axes = (axes,)
    if not isinstance(axes, (tuple, list)) or not all(_is_int(a) for a in axes):
        raise TypeError(
            f"{name} must be an int or a tuple of ints, got {name}={axes!r}"
        )
    if not all(-ndim <= a < ndim for a in axes):
        raise ValueError(
            f"{name} must be axes of x (of rank {ndim}), got {name}={axes!r}"
        )
    return tuple(sorted({int(a) % ndim for a in axes}))


def _check_shapes(who: str, window: Window, **arrays: Any) -> None:
    """Raises ``ValueError`` where an array's shape is not the window's
    feature shape (``window.mean``'s): nothing is broadcast."""
    want = jnp.shape(window.mean)
    for name, value in arrays.items():
        if jnp.shape(value) != want:
            raise ValueError(
                f"{who}: {name} has shape {jnp.shape(value)}, but the "
                f"window's statistics have shape {want} (the feature shape)"
            )


def _check_momentum(momentum: Any) -> None:
    """Raises ``ValueError`` if a concrete ``momentum`` is outside [0, 1]
    (``TypeError`` if it is not a real number); a traced one passes."""
    if type(momentum) is float and 0.0 <= momentum <= 1.0:
        return  # the common case, without a trip through NumPy
    if isinstance(momentum, bool):
        raise TypeError(f"momentum must be a real number, got {momentum!r}")
    value = numerics.concrete(momentum)
    if value is None:  # traced: cannot be checked here
        return
    if value.dtype.kind not in "fiu":
        raise TypeError(
            f"momentum must be a real number, got momentum={momentum!r}"
        )
    if not np.all((value >= 0) & (value <= 1)):
        raise ValueError(
            "momentum must be in [0, 1] (the weight of the old running "
            f"average, as in flax), got momentum={momentum!r}"
        )


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
      use_fast_variance: :math:`E[x^2] - E[x]^2` (one pass) if true, else the
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
      >>> from optaxaccum import batchnorm
      >>> x = jnp.array([[0.0, 1.0], [2.0, 5.0]])
      >>> count, mean, var = batchnorm.micro_batch_stats(x, 0)
      >>> count
      Array([2., 2.], dtype=float32)
      >>> mean, var
      (Array([1., 3.], dtype=float32), Array([1., 4.], dtype=float32))
    """
    _check_real_input(x, "micro_batch_stats")
    return _micro_batch_stats(
        x,
        reduction_axes,
        dtype=dtype,
        mask=mask,
        axis_name=axis_name,
        axis_index_groups=axis_index_groups,
        use_fast_variance=use_fast_variance,
    )


def _micro_batch_stats(
    x: jax.Array,
    reduction_axes: Any,
    *,
    dtype: Any,
    mask: Any,
    axis_name: Any,
    axis_index_groups: Any,
    use_fast_variance: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`micro_batch_stats` of a real ``x``."""
    reduction_axes = _checked_axes(x.ndim, reduction_axes)
    dtype = numerics.widen(x.dtype if dtype is None else dtype)
    x = x.astype(dtype)
    if mask is None:
        feature_shape = [
            d for i, d in enumerate(x.shape) if i not in reduction_axes
        ]
        count = jnp.full(
            feature_shape,
            math.prod(x.shape[i] for i in reduction_axes),
            dtype,
        )
        weight = None
    else:
        weight = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
        weight = weight.astype(dtype)
        count = weight.sum(reduction_axes)

    def total(v):
        return (v if weight is None else v * weight).sum(reduction_axes)

    def psum(*vs):
        if axis_name is None:
            return vs
        out = lax.psum(
            jnp.stack(vs), axis_name, axis_index_groups=axis_index_groups
        )
        return tuple(out)

    def per_element(v, count):
        return numerics.divide_or(v, count, count > 0)

    if use_fast_variance:
        count, s1, s2 = psum(count, total(x), total(x * x))
        mean = per_element(s1, count)
        var = jnp.maximum(0.0, per_element(s2, count) - mean * mean)
    else:
        count, s1 = psum(count, total(x))
        mean = per_element(s1, count)
        dev = x - jnp.expand_dims(mean, reduction_axes)
        (ss,) = psum(total(dev * dev))
        var = per_element(ss, count)
    return count, mean, var


def merge(
    window: Window, count: jax.Array, mean: jax.Array, var: jax.Array
) -> Window:
    """Adds a micro-batch's statistics to the window (exact pooled variance).

    Args:
      window: the window so far.
      count: the micro-batch's per-feature element count.
      mean: its per-feature mean.
      var: its per-feature (biased) variance.

    Returns:
      The window with the micro-batch merged in and ``micro_batches`` one
      higher.

    Raises:
      ValueError: if ``count``, ``mean`` or ``var`` does not have the
        window's feature shape (nothing is broadcast).

    Examples:
      >>> import jax.numpy as jnp
      >>> from optaxaccum import batchnorm
      >>> window = batchnorm.empty_window(1)
      >>> for xb in (jnp.array([[0.0], [2.0]]), jnp.array([[10.0], [12.0]])):
      ...     stats = batchnorm.micro_batch_stats(xb, 0)
      ...     window = batchnorm.merge(window, *stats)
      >>> window.mean, window.m2 / window.count  # those of all four rows
      (Array([6.], dtype=float32), Array([26.], dtype=float32))
    """
    _check_shapes("merge", window, count=count, mean=mean, var=var)
    count, mean, var = (v.astype(jnp.float32) for v in (count, mean, var))
    total = window.count + count
    frac = numerics.divide_or(count, total, total > 0)
    delta = mean - window.mean
    return Window(
        count=total,
        mean=window.mean + delta * frac,
        m2=window.m2 + var * count + delta * delta * window.count * frac,
        micro_batches=window.micro_batches + 1,
    )


def close(
    running_mean: jax.Array,
    running_var: jax.Array,
    window: Window,
    *,
    momentum: float,
    where: Any = True,
) -> RunningStats:
    """Folds the pooled window into the running statistics where ``where``.

    Each running statistic becomes ``momentum * running + (1 - momentum) *
    pooled``, with the window's mean and pooled (biased) variance: flax's
    convention (``momentum`` weighs the old value; PyTorch's ``momentum``
    is ``1 -`` this one). A window that saw no element (everything masked,
    or nothing merged) leaves them unchanged, so closing an empty window is
    a no-op; at the end of an epoch, ``close`` folds in a partial window
    with its own count.

    Args:
      running_mean: the running mean.
      running_var: the running variance.
      window: the window to close.
      momentum: BatchNorm's momentum in [0, 1], a float (or an array, which
        takes the running statistics' dtype).
      where: whether to close, a bool or a boolean array (traced under
        ``jit``), e.g. :func:`closed`: the window then closes with the
        optimizer's.

    Returns:
      The :class:`RunningStats` ``(running_mean, running_var, window)``: the
      window is emptied where it closed; elsewhere all three come back
      unchanged.

    Raises:
      ValueError: if a concrete ``momentum`` is outside [0, 1], or
        ``running_mean`` or ``running_var`` does not have the window's
        feature shape.

    Examples:
      >>> import jax.numpy as jnp
      >>> from optaxaccum import batchnorm
      >>> stats = batchnorm.micro_batch_stats(jnp.array([[1.0], [3.0]]), 0)
      >>> window = batchnorm.merge(batchnorm.empty_window(1), *stats)
      >>> mean, var, window = batchnorm.close(
      ...     jnp.zeros(1), jnp.ones(1), window, momentum=0.5)
      >>> mean, var, int(window.micro_batches)
      (Array([1.], dtype=float32), Array([1.], dtype=float32), 0)
    """
    _check_momentum(momentum)
    _check_shapes(
        "close", window, running_mean=running_mean, running_var=running_var
    )
    seen = window.count > 0
    pooled_var = numerics.divide_or(window.m2, window.count, seen)
    use = where & seen

    def ema(running, stat):
        # A Python float stays weakly typed, exactly as in nn.BatchNorm; a
        # recorded (array) momentum takes the running statistic's dtype.
        m = momentum
        if not isinstance(m, (int, float)):
            m = jnp.asarray(m).astype(running.dtype)
        new = m * running + (1 - m) * stat.astype(running.dtype)
        return jnp.where(use, new, running).astype(running.dtype)

    new_mean = ema(running_mean, window.mean)
    new_var = ema(running_var, pooled_var)
    empty = empty_window(window.mean.shape)
    window = jax.tree.map(
        lambda e, w: jnp.where(where, e, w).astype(w.dtype), empty, window
    )
    return RunningStats(new_mean, new_var, window)


def step(
    running_mean: jax.Array,
    running_var: jax.Array,
    window: Window,
    stats: tuple[jax.Array, jax.Array, jax.Array],
    *,
    momentum: float,
    every_k: int,
) -> RunningStats:
    """One training micro-batch: :func:`merge` its ``stats``, then
    :func:`close` the window once it holds ``every_k`` micro-batches.

    The running statistics change only when the window closes, to
    ``momentum * running + (1 - momentum) * pooled`` (flax's convention,
    see :func:`close`).

    Args:
      running_mean: the running mean.
      running_var: the running variance.
      window: the window so far.
      stats: the micro-batch's ``(count, mean, var)``
        (:func:`micro_batch_stats`; stop their gradient first when called
        inside a loss).
      momentum: BatchNorm's momentum in [0, 1].
      every_k: micro-batches per window, a positive int (the layers'
        ``accum_steps``).

    Returns:
      The :class:`RunningStats` ``(running_mean, running_var, window)``
      after the micro-batch.

    Raises:
      TypeError, ValueError: if ``every_k`` is not a positive int, a
        concrete ``momentum`` is outside [0, 1], or a shape differs from
        the window's feature shape.

    Examples:
      >>> import jax.numpy as jnp
      >>> from optaxaccum import batchnorm
      >>> state = batchnorm.RunningStats(
      ...     jnp.zeros(1), jnp.ones(1), batchnorm.empty_window(1))
      >>> for xb in (jnp.array([[0.0], [2.0]]), jnp.array([[10.0], [12.0]])):
      ...     stats = batchnorm.micro_batch_stats(xb, 0)
      ...     state = batchnorm.step(*state, stats, momentum=0.0, every_k=2)
      >>> state.running_mean, state.running_var  # BatchNorm on the window
      (Array([6.], dtype=float32), Array([26.], dtype=float32))
    """
    every_k = checks.check_positive_int("every_k", every_k)
    window = merge(window, *stats)
    return close(
        running_mean,
        running_var,
        window,
        momentum=momentum,
        where=window.micro_batches >= every_k,
    )


def canonical_axes(ndim: int, axis: Any) -> tuple[int, ...]:
    """A layer's feature axes ``axis`` as sorted non-negative ints."""
    return _checked_axes(ndim, axis, "axis")


def train_step(
    module: Any,
    x: jax.Array,
    mask: jax.Array | None,
    running_mean: jax.Array,
    running_var: jax.Array,
    window: Window,
) -> RunningStats:
    """The running statistics after one training micro-batch ``x``.

    ``module`` is a linen or nnx ``AccumBatchNorm``: its ``axis``, ``dtype``,
    ``axis_name``, ``axis_index_groups``, ``use_fast_variance``, ``momentum``
    and ``accum_steps`` are read. Both layers pass ``x`` as their stock layer
    computes statistics on it: ``nnx.BatchNorm`` first casts it to ``dtype``,
    ``nn.BatchNorm`` does not; the statistics are then computed here alike.
    """
    feature_axes = canonical_axes(x.ndim, module.axis)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    _check_real_input(x, "AccumBatchNorm")
    stats = _micro_batch_stats(
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
        running_mean,
        running_var,
        window,
        stats,
        momentum=module.momentum,
        every_k=module.accum_steps,
    )


def keep_counted(
    old_opt_state: Any, new_opt_state: Any, *, old: Any, new: Any
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
      old: the statistics before the micro-batch's forward pass (any
        pytree, e.g. a :class:`RunningStats`).
      new: those after it, of the same structure.

    Returns:
      ``new`` where the call counted, else ``old`` (``new`` when the
      optimizer holds no window: every call counts).

    Raises:
      ValueError: if ``old`` and ``new`` differ in structure.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> from optaxaccum import batchnorm
      >>> tx = oa.chain(oa.accumulate(2, skip_nonfinite=True), optax.sgd(1.0))
      >>> s0 = tx.init(jnp.zeros(1))
      >>> _, s1 = tx.update(jnp.full(1, jnp.nan), s0)  # dropped
      >>> batchnorm.keep_counted(s0, s1, old=jnp.zeros(1), new=jnp.ones(1))
      Array([0.], dtype=float32)
    """
    checks.check_same_structure("new", new, old, "old")
    counted = windows.counted(old_opt_state, new_opt_state)
    if counted is True:  # no accumulate: every call counts
        return new
    return jax.tree.map(lambda n, o: jnp.where(counted, n, o), new, old)


def closed(old_opt_state: Any, new_opt_state: Any) -> Any:
    """Whether an optimizer call closed the optimizer's window.

    Pass it to :func:`close` as ``where`` after every optimizer call: the
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
      >>> from optaxaccum import batchnorm
      >>> tx = oa.chain(oa.accumulate(3), optax.sgd(1.0))
      >>> states = [tx.init(jnp.zeros(1))]
      >>> for _ in range(4):
      ...     states.append(tx.update(jnp.ones(1), states[-1])[1])
      >>> [bool(batchnorm.closed(*s)) for s in zip(states, states[1:])]
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

    known = numerics.concrete(early)
    if known is not None:
        fail(known)
        return
    lax.cond(
        jnp.any(early),
        lambda: jax.debug.callback(fail, early),
        lambda: None,
    )
