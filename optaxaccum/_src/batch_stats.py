"""Pooled BatchNorm statistics over an accumulation window (pure JAX).

Shared by the linen and nnx ``AccumBatchNorm`` and usable from any framework:
it imports no flax (examples/equinox_batchnorm.py uses it with Equinox). A
window's statistics are kept as per-feature ``count``, ``mean`` and ``m2``
(sum of squared deviations from the mean) in float32 and merged micro-batch
by micro-batch with the parallel-variance formula of Chan, Golub and
LeVeque, so the pooled variance is exact for micro-batches of any sizes --
not an average of variances.
"""

from __future__ import annotations

import math
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
    """

    elements: jax.Array
    mean: jax.Array
    m2: jax.Array
    step: jax.Array


def empty_window(feature_shape: Sequence[int]) -> Window:
    # Three distinct buffers: one array used for three leaves could not be
    # donated (XLA refuses to donate the same buffer twice).
    shape = tuple(feature_shape)
    return Window(
        *(jnp.zeros(shape, jnp.float32) for _ in range(3)),
        step=jnp.zeros([], jnp.int32),
    )


def micro_batch_stats(
    x: jax.Array,
    reduction_axes: tuple[int, ...],
    *,
    dtype: Any,
    mask: jax.Array | None,
    axis_name: Any,
    axis_index_groups: Any,
    use_fast_variance: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(count, mean, var)`` of one micro-batch, in float32 (or wider).

    As flax's ``_compute_stats``: computed in ``dtype`` (``x``'s when
    ``None``) widened to at least float32. Counts are summed over
    ``axis_name`` (so devices with different numbers of examples are weighted
    by their size), with one collective for the fast variance and two for the
    two-pass one. A feature with no element (all masked) gets count 0, mean 0
    and variance 0, so it adds nothing to the window.
    """
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(
            f"AccumBatchNorm supports real inputs only, got dtype {x.dtype}"
        )
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
    """Adds a micro-batch with ``n`` elements, ``mean`` and ``var``."""
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

    A window that saw no element (everything masked) leaves the running
    averages unchanged. Returns ``(ra_mean, ra_var, window)``; the window is
    emptied where it closed.
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
    """One training micro-batch: merge its ``stats``, close a full window of
    ``every_k`` micro-batches (the core's name for the window length; the
    layers' public argument is ``accum_steps``)."""
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
    """Closes a partial window where ``where`` (no-op for an empty one)."""
    return close(
        window,
        ra_mean,
        ra_var,
        momentum,
        jnp.logical_and(where, window.step > 0),
    )


def keep_counted(old_opt_state: Any, new_opt_state: Any, new: Any, old: Any):
    """``new`` statistics if the chain counted the micro-batch that turned
    ``old_opt_state`` into ``new_opt_state``, else ``old`` ones (as they
    were before its forward pass): the BatchNorm windows stay aligned with
    the optimizer's (docs/concepts.md). Used by linen's ``TrainState`` and nnx's
    ``Optimizer`` alike."""
    counted = windows.counted(old_opt_state, new_opt_state)
    if counted is True:  # no accumulate: every call counts
        return new
    return jax.tree.map(lambda n, o: jnp.where(counted, n, o), new, old)


def closes_with(old_opt_state: Any, new_opt_state: Any) -> Any:
    """Where the BatchNorm windows close because the call that turned
    ``old_opt_state`` into ``new_opt_state`` closed the optimizer's window
    (:func:`windows.closed`): the layers then follow any window length, a
    callable ``every_k`` included. ``False`` when the state holds no window
    (the layers close on their own ``accum_steps``)."""
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
