"""BatchNorm statistics pooled over the optimizer's window, for any framework.

The arithmetic of :class:`optaxaccum.flax.AccumBatchNorm`, in plain JAX
(no flax needed): a BatchNorm layer written in another framework (Equinox,
Haiku, your own) keeps a :class:`Window` beside its running mean and
variance, a :class:`RunningStats`, and updates them once per window with the
pooled statistics of the whole window, so they equal BatchNorm's on the
concatenated window. Per training micro-batch, inside the loss::

    stats = batchnorm.micro_batch_stats(x, reduction_axes)
    stats = jax.tree.map(jax.lax.stop_gradient, stats)
    new = batchnorm.step(*old, stats, momentum=momentum, every_k=max_k)

(``old``, ``new``: :class:`RunningStats`), and after the optimizer's call
(``old_opt``/``new_opt``: its states before and after), to keep the windows
aligned with the optimizer's::

    kept = batchnorm.keep_counted(old_opt, new_opt, old=old, new=new)
    closed = batchnorm.closed(old_opt, new_opt)
    new = batchnorm.close(*kept, momentum=momentum, where=closed)

``step`` and ``close`` take the running statistics and the window in the
order :class:`RunningStats` holds them, and return one. ``close`` also ends
an epoch: it folds in a partial window with its own count (an empty window
changes nothing). ``examples/equinox_batchnorm.py`` builds such a layer in
Equinox; docs/concepts.md ("BatchNorm: what accumulation can and cannot
give") says what pooled statistics can and cannot give.
"""

from optaxaccum._src.batch_stats import (
    RunningStats,
    Window,
    close,
    closed,
    empty_window,
    keep_counted,
    merge,
    micro_batch_stats,
    step,
)

__all__ = [
    "RunningStats",
    "Window",
    "close",
    "closed",
    "empty_window",
    "keep_counted",
    "merge",
    "micro_batch_stats",
    "step",
]
