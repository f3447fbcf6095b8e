"""``AccumBatchNorm`` for ``flax.nnx``."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from optaxaccum._src import utils
from optaxaccum.flax import _stats

__all__ = ["AccumBatchNorm", "flush_batch_stats"]


class AccumBatchNorm(nnx.BatchNorm):
    """``flax.nnx.BatchNorm`` whose running statistics see the whole window.

    Mirrors :class:`flax.nnx.BatchNorm` (same arguments, same variables:
    ``scale``, ``bias`` params; running statistics in ``.mean`` and ``.var``)
    and adds ``accum_steps``. In training mode each micro-batch is normalized
    with its own statistics, exactly as ``nnx.BatchNorm`` does; ``.mean`` and
    ``.var`` are updated once per ``accum_steps`` micro-batches with the
    pooled statistics of the whole window (exact parallel variance in
    float32), so they equal ``nnx.BatchNorm`` run once on the concatenated
    window. The window is held in ``nnx.BatchStat`` attributes
    ``window_count``, ``window_mean``, ``window_m2`` and ``window_step``
    (present only when ``accum_steps > 1``). ``accum_steps=1`` is exactly
    ``nnx.BatchNorm``. Under ``axis_name`` devices are weighted by their
    number of (unmasked) elements, as for the linen
    :class:`optaxaccum.flax.AccumBatchNorm`.

    Args:
      num_features: the number of features.
      accum_steps: micro-batches per window, an int >= 1 (keyword). Keep it
        equal to the ``every_k`` of :func:`optaxaccum.accumulate`.
      rngs: the ``nnx.Rngs`` for the parameters.
      **kwargs: every other ``nnx.BatchNorm`` keyword (``momentum``,
        ``epsilon``, ``axis_name``, ``use_running_average``, ...).

    Raises:
      ValueError, TypeError: if ``accum_steps`` is not a positive int.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from optaxaccum.flax.nnx import AccumBatchNorm
      >>> bn = AccumBatchNorm(2, accum_steps=2, momentum=0.0,
      ...                     rngs=nnx.Rngs(0))
      >>> x = jnp.arange(8.0).reshape(4, 2)
      >>> _ = bn(x[:2]); _ = bn(x[2:])
      >>> bn.mean[...], bn.var[...]
      (Array([3., 4.], dtype=float32), Array([5., 5.], dtype=float32))
    """

    def __init__(
        self,
        num_features: int,
        *,
        accum_steps: int = 1,
        rngs: nnx.Rngs,
        **kwargs: Any,
    ):
        accum_steps = utils.check_positive_int("accum_steps", accum_steps)
        super().__init__(num_features, rngs=rngs, **kwargs)
        self.accum_steps = accum_steps
        if accum_steps > 1:
            window = _stats.empty_window(self.mean[...].shape)
            for key, value in zip(_stats.WINDOW_KEYS, window):
                setattr(self, key, nnx.BatchStat(value))

    def _window(self) -> _stats.Window:
        return _stats.Window(
            *(getattr(self, key)[...] for key in _stats.WINDOW_KEYS)
        )

    def _set(self, mean, var, window: _stats.Window) -> None:
        self.mean[...] = mean
        self.var[...] = var
        for key, value in zip(_stats.WINDOW_KEYS, window):
            getattr(self, key)[...] = value

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """Normalizes ``x``; see :class:`flax.nnx.BatchNorm`.

        Args:
          x: the input.
          use_running_average: if true, normalize with the running statistics;
            overrides the attribute of the same name.
          mask: optional boolean array broadcastable to ``x``: which elements
            count toward the statistics.

        Returns:
          The normalized input, of the same shape.
        """
        if self.accum_steps == 1:
            return super().__call__(x, use_running_average, mask=mask)
        use_ra = (
            use_running_average
            if use_running_average is not None
            else self.use_running_average
        )
        if use_ra is None or use_ra:
            return super().__call__(x, use_running_average, mask=mask)
        ra_mean, ra_var = self.mean[...], self.var[...]
        y = super().__call__(x, use_running_average, mask=mask)
        # nnx.BatchNorm computes its statistics on x promoted to self.dtype.
        (x,) = self.promote_dtype((x,), dtype=self.dtype)
        # Replace the per-micro-batch update that nnx.BatchNorm just made.
        self._set(
            *_stats.train_step(self, x, mask, self._window(), ra_mean, ra_var)
        )
        return y

    def flush(self) -> None:
        """Closes a partial window (end of an epoch); no-op when empty."""
        if self.accum_steps > 1:
            self._set(
                *_stats.flush(
                    self._window(), self.mean[...], self.var[...], self.momentum
                )
            )


def flush_batch_stats(model: nnx.Module) -> None:
    """Calls :meth:`AccumBatchNorm.flush` on every such layer of ``model``.

    Args:
      model: an ``nnx.Module``, changed in place.

    Returns:
      ``None``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from optaxaccum.flax.nnx import AccumBatchNorm, flush_batch_stats
      >>> bn = AccumBatchNorm(1, accum_steps=4, momentum=0.0, rngs=nnx.Rngs(0))
      >>> _ = bn(jnp.array([[1.0], [3.0]]))
      >>> flush_batch_stats(bn)
      >>> bn.mean[...]
      Array([2.], dtype=float32)
    """
    for _, module in nnx.iter_modules(model):
        if isinstance(module, AccumBatchNorm):
            module.flush()
