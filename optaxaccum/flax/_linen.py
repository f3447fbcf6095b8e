"""``AccumBatchNorm`` for ``flax.linen``."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import module as linen_module

from optaxaccum._src import batch_stats as stats_lib
from optaxaccum._src import utils
from optaxaccum.flax import _shared


class AccumBatchNorm(nn.BatchNorm):
    """``flax.linen.BatchNorm`` whose running statistics see the whole window.

    A drop-in for :class:`flax.linen.BatchNorm` (the same constructor
    arguments in the same order, plus ``accum_steps``; the same variables,
    so pretrained ``nn.BatchNorm`` variables load unchanged). Each
    micro-batch is normalized with its own statistics, as ``nn.BatchNorm``
    does; the running ``mean``/``var`` are updated once per ``accum_steps``
    micro-batches with the pooled statistics of the window (exact
    parallel-variance merge in float32), so they equal those of
    ``nn.BatchNorm`` on the concatenated window. The window lives in extra
    ``batch_stats`` entries; ``accum_steps=1`` is exactly ``nn.BatchNorm``.
    Details (the entries, ``axis_name``, dtypes, costs): docs/concepts.md,
    "BatchNorm: what accumulation can and cannot give".

    Args:
      use_running_average: as in ``nn.BatchNorm``.
      accum_steps: micro-batches per window, an int >= 1 (keyword); under
        :class:`optaxaccum.flax.TrainState` the window also closes with the
        optimizer's (give the longest of a changing length); one shorter
        than the optimizer's window raises ``ValueError`` where the layer
        closes on its own.
      **kwargs: every other ``nn.BatchNorm`` field, with its meaning.

    Raises:
      ValueError, TypeError: if ``accum_steps`` is not a positive int.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from optaxaccum.flax import AccumBatchNorm
      >>> bn = AccumBatchNorm(use_running_average=False, momentum=0.0,
      ...                     accum_steps=2)
      >>> x = jnp.arange(8.0).reshape(4, 2)
      >>> variables = bn.init(jax.random.key(0), x[:2])
      >>> stats = variables["batch_stats"]
      >>> for xb in (x[:2], x[2:]):
      ...   _, upd = bn.apply({**variables, "batch_stats": stats}, xb,
      ...                     mutable=["batch_stats"])
      ...   stats = upd["batch_stats"]
      >>> stats["mean"], stats["var"]  # of all four rows
      (Array([3., 4.], dtype=float32), Array([5., 5.], dtype=float32))
    """

    accum_steps: int = 1

    def __post_init__(self):
        # Frozen dataclass: store the checked value (e.g. np.int64 -> int).
        object.__setattr__(
            self,
            "accum_steps",
            utils.check_positive_int("accum_steps", self.accum_steps),
        )
        super().__post_init__()

    __call__ = nn.compact(_shared.accum_call())

    def _stock_call(self, x, use_running_average, mask):
        return super().__call__(x, use_running_average, mask=mask)

    def _pools(self, use_running_average: bool | None) -> bool:
        """Whether this call updates the window: in training, and at init
        (which creates the window's variables)."""
        training = not linen_module.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        return self.is_initializing() or training

    def _pooled_call(self, x, use_running_average, mask):
        feature_shape = tuple(
            x.shape[i] for i in stats_lib.canonical_axes(x.ndim, self.axis)
        )
        # Created by init, or on the first training call for variables
        # of a plain nn.BatchNorm (see flax.convert_batch_stats).
        empty = stats_lib.empty_window(feature_shape)
        window_vars = [
            self.variable("batch_stats", key, lambda v=v: v)
            for key, v in zip(stats_lib.WINDOW_KEYS, empty)
        ]
        momentum = jnp.asarray(self.momentum, jnp.float32)
        momentum_var = self.variable(
            "batch_stats", stats_lib.MOMENTUM_KEY, lambda: momentum
        )
        if self.is_initializing():
            return super().__call__(x, use_running_average, mask=mask)

        ra_mean = self.get_variable("batch_stats", "mean")
        ra_var = self.get_variable("batch_stats", "var")
        y = super().__call__(x, use_running_average, mask=mask)
        window = stats_lib.Window(*(v.value for v in window_vars))
        new_mean, new_var, window = stats_lib.train_step(
            self, x, mask, window, ra_mean, ra_var
        )
        # Replace the per-micro-batch update that nn.BatchNorm just made.
        self.put_variable("batch_stats", "mean", new_mean)
        self.put_variable("batch_stats", "var", new_var)
        for var, value in zip(window_vars, window):
            var.value = value
        # Rewritten on every training call: a flush closes the window with
        # the momentum of the layer that filled it.
        momentum_var.value = momentum
        return y
