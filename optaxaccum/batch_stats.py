"""BatchNorm statistics pooled over the optimizer's window, for any framework.

The arithmetic of :class:`optaxaccum.flax.AccumBatchNorm`, in plain JAX
(no flax needed): a BatchNorm layer written in another framework (Equinox,
Haiku, your own) keeps a :class:`Window` beside its running ``mean`` and
``var`` and updates them once per window with the pooled statistics of the
whole window, so they equal BatchNorm's on the concatenated window. Per
training micro-batch, inside the loss::

    stats = batch_stats.micro_batch_stats(x, reduction_axes)
    stats = jax.tree.map(jax.lax.stop_gradient, stats)
    mean, var, window = batch_stats.step(
        window, mean, var, stats, momentum=momentum, every_k=max_k)

and after the optimizer's call (``old_opt``/``new_opt``: its states before
and after), to keep the windows aligned with the optimizer's::

    mean, var, window = batch_stats.keep_counted(
        old_opt, new_opt, (mean, var, window), old_stats)
    closed = batch_stats.closed(old_opt, new_opt)
    mean, var, window = batch_stats.flush(window, mean, var, momentum, closed)

``examples/equinox_batchnorm.py`` builds such a layer in Equinox;
docs/concepts.md ("BatchNorm: what accumulation can and cannot give") says
what pooled statistics can and cannot give.
"""

from optaxaccum._src.batch_stats import (
    Window,
    close,
    closed,
    empty_window,
    flush,
    keep_counted,
    merge,
    micro_batch_stats,
    step,
)

__all__ = [
    "Window",
    "close",
    "closed",
    "empty_window",
    "flush",
    "keep_counted",
    "merge",
    "micro_batch_stats",
    "step",
]
