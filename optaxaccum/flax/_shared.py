"""What the linen and the nnx ``AccumBatchNorm`` share beyond the window
arithmetic (``optaxaccum._src.batch_stats``): their ``__call__``."""

from __future__ import annotations

from collections.abc import Callable

import jax


def accum_call() -> Callable[..., jax.Array]:
    """A new ``__call__`` for an ``AccumBatchNorm`` class (a function of its
    own per class: linen marks its copy compact). It asks the layer three
    things: ``_pools(use_running_average)`` (whether this call updates the
    window), ``_stock_call`` (the stock ``BatchNorm``) and ``_pooled_call``
    (a training call that updates the window)."""

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """Normalizes ``x`` as the stock ``BatchNorm`` does (same arguments);
        in training the running statistics see whole windows.

        Args:
          x: the input.
          use_running_average: if true, normalize with the running statistics
            (evaluation); overrides the field of the same name.
          mask: optional boolean array broadcastable to ``x``: which elements
            count toward the statistics.

        Returns:
          The normalized input, of the same shape.
        """
        if self.accum_steps == 1 or not self._pools(use_running_average):
            return self._stock_call(x, use_running_average, mask)
        return self._pooled_call(x, use_running_average, mask)

    return __call__
