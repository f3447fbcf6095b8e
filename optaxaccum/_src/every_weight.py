"""``oa.every_weight``: windows that close on a weight budget (tokens).

An ``every_k`` for :func:`optaxaccum.accumulate` whose window closes on the
first counted micro-batch with which the window's total ``accum_weight``
(over the data axes with ``axis_name``) reaches a budget, instead of after a
fixed number of micro-batches. The decision reads the window's running
weight, which the accumulate keeps anyway (``AccumulateState.weight``): the
budget adds no state, so checkpoints, ``oa.flush`` and ``oa.reshard_state``
follow it as they follow any window.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

from optaxaccum._src import checks

__all__ = ["EveryWeight", "every_weight"]


class EveryWeight(NamedTuple):
    """The ``every_k`` made by :func:`every_weight` (static).

    Attributes:
      total: the window's weight budget, finite and > 0.
      max_k: the most micro-batches a window holds, or ``None`` (no cap).
    """

    total: float
    max_k: int | None = None

    def closes(
        self, mini_step: jax.Array, weight: jax.Array, low: Any = None
    ) -> jax.Array:
        """Whether a window holding ``mini_step`` counted micro-batches of
        total (global) ``weight`` (plus ``low``, what its rounding left out)
        closes: the weight reached ``total``, or is not a number (a traced
        invalid weight: the window closes and passes it on rather than
        never closing), or ``max_k`` is reached. ``total`` is split the same
        way, so the comparison is exact beyond ``2**24``."""
        head = np.asarray(self.total, weight.dtype)
        tail = np.asarray(self.total - float(head), weight.dtype)
        gap = weight - head  # exact where it matters: weight near total
        if low is not None:
            gap = gap + (low - tail)
        else:
            gap = gap - tail
        reached = ~(gap < 0)
        if self.max_k is None:
            return reached
        return reached | (mini_step >= self.max_k)


def every_weight(total: float, *, max_k: int | None = None) -> EveryWeight:
    """An ``every_k`` that closes each window on a total weight.

    The window closes on the first counted micro-batch with which the
    window's total ``accum_weight`` (e.g. its tokens; summed over the
    devices with ``axis_name``) reaches ``total``. The micro-batch that
    crosses ``total`` counts whole: a window's weight lies in ``[total,
    total + w_max)`` for micro-batches of weight at most ``w_max``. ``max_k``
    closes a window after that many micro-batches whatever its weight.

    The budget is a global weight: a run resumed with
    :func:`reshard_state` on a mesh with another number of data devices
    keeps closing windows at the same total weight. Under ``jax.jit`` on a
    mesh the weight is global already (no collective); under ``pmap`` and
    ``shard_map`` each device holds its own, and deciding costs one scalar
    ``psum`` per micro-batch. The sum is kept in the window weight's dtype
    (float32 by default) with its rounding error beside it: integer weights
    stay exact far beyond ``2**24`` on one device and on ``jax.jit`` meshes;
    under ``pmap``/``shard_map`` the one scalar sum over the devices rounds
    as float32 does (exact up to ``2**24`` in all).

    Args:
      total: the window's weight budget, a finite real > 0.
      max_k: ``None``, or the most micro-batches in a window, an int >= 1.

    Returns:
      An ``every_k`` for :func:`accumulate` (and ``every_k_schedule`` of
      :class:`MultiSteps`).

    Raises:
      TypeError, ValueError: for a bad argument, naming it.

    Examples:
      >>> import jax.numpy as jnp, optax, optaxaccum as oa
      >>> tx = oa.chain(oa.accumulate(oa.every_weight(100)), optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(1))
      >>> closed = []
      >>> for tokens in (40, 50, 30):   # 40 + 50 < 100 <= 40 + 50 + 30
      ...   _, state = tx.update(jnp.ones(1), state, accum_weight=tokens)
      ...   closed.append(bool(oa.has_updated(state)))
      >>> closed, int(state[0].gradient_step)
      ([False, False, True], 1)
    """
    number = checks.check_real("total", total)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"total must be finite and > 0, got total={total!r}")
    if max_k is not None:
        max_k = checks.check_positive_int("max_k", max_k)
    return EveryWeight(number, max_k)
