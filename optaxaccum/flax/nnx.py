"""``flax.nnx`` integration: ``AccumBatchNorm`` and a fused ``Optimizer``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import filterlib

import optaxaccum as oa
from optaxaccum._src import batch_stats as stats_lib
from optaxaccum._src import chain as chain_lib
from optaxaccum._src import checks, windows
from optaxaccum.flax._shared import CALL_DOC

__all__ = ["AccumBatchNorm", "Optimizer", "flush_batch_stats"]

# Prefix of the attributes holding the last counted statistics.
_COUNTED = "counted_"


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
    ``window_count``, ``window_mean``, ``window_m2`` and ``window_step``,
    and the statistics as of the last micro-batch the optimizer counted in
    ``counted_*`` copies, restored by :meth:`Optimizer.update` when the
    chain refuses a micro-batch (all present only when ``accum_steps > 1``).
    ``accum_steps=1`` is exactly ``nnx.BatchNorm``. Under ``axis_name``
    devices are weighted by their number of (unmasked) elements.

    Args:
      num_features: the number of features.
      accum_steps: micro-batches per window, an int >= 1 (keyword); under
        :class:`Optimizer` the window also closes with the optimizer's
        (give the longest of a changing length); one shorter than the
        optimizer's window raises ``ValueError`` where the layer closes on
        its own (under ``jax.jit``: ``jax.errors.JaxRuntimeError`` with
        that message, when the step runs).
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
        accum_steps = checks.check_positive_int("accum_steps", accum_steps)
        super().__init__(num_features, rngs=rngs, **kwargs)
        self.accum_steps = accum_steps
        if accum_steps > 1:
            window = stats_lib.empty_window(self.mean[...].shape)
            for key, value in zip(stats_lib.WINDOW_KEYS, window):
                setattr(self, key, nnx.BatchStat(value))
            # The statistics as the optimizer last counted them (see
            # keep_counted): restored when it refuses a micro-batch.
            for key, value in zip(stats_lib.STAT_KEYS, self._stats()):
                setattr(self, _COUNTED + key, nnx.BatchStat(jnp.copy(value)))

    def _window(self) -> stats_lib.Window:
        return stats_lib.Window(
            *(getattr(self, key)[...] for key in stats_lib.WINDOW_KEYS)
        )

    def _stats(self, prefix: str = "") -> list[jax.Array]:
        return [getattr(self, prefix + k)[...] for k in stats_lib.STAT_KEYS]

    def keep_counted(self, old_opt_state: Any, new_opt_state: Any) -> None:
        """Keeps this layer's window aligned with the optimizer's: where the
        chain did not count the micro-batch (the call that turned
        ``old_opt_state`` into ``new_opt_state``), restores the statistics
        to those of the last counted one; where the call closed the
        optimizer's window, closes this layer's too (so it follows any
        window length, :func:`optaxaccum.critical_batch_every_k`
        included); then records them as counted. Called by
        :meth:`Optimizer.update` on every layer."""
        if self.accum_steps == 1:
            return
        stats_lib.check_closed_with(
            [f"(accum_steps={self.accum_steps})"],
            [getattr(self, _COUNTED + "window_step")[...]],
            [self._window().micro_batches],
            windows.counted(old_opt_state, new_opt_state),
            stats_lib.closed(old_opt_state, new_opt_state),
        )
        stats = stats_lib.keep_counted(
            old_opt_state,
            new_opt_state,
            old=self._stats(_COUNTED),
            new=self._stats(),
        )
        for key, value in zip(stats_lib.STAT_KEYS, stats):
            getattr(self, key)[...] = value
        closed = stats_lib.closed(old_opt_state, new_opt_state)
        if closed is not False:
            self._flush(closed)
        self._record(self._stats())

    def _record(self, stats: list[jax.Array]) -> None:
        """Sets the statistics and records them as counted."""
        for key, value in zip(stats_lib.STAT_KEYS, stats):
            getattr(self, key)[...] = value
            # A buffer of its own: a leaf shared by two variables could not
            # be donated to a jitted step.
            getattr(self, _COUNTED + key)[...] = jnp.copy(value)

    def _set(self, mean, var, window: stats_lib.Window) -> None:
        self.mean[...] = mean
        self.var[...] = var
        for key, value in zip(stats_lib.WINDOW_KEYS, window):
            getattr(self, key)[...] = value

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        running = use_running_average
        if running is None:
            running = self.use_running_average
        # In training the window pools the micro-batch.
        if self.accum_steps > 1 and running is not None and not running:
            return self._pooled_call(x, use_running_average, mask)
        return super().__call__(x, use_running_average, mask=mask)

    __call__.__doc__ = CALL_DOC

    def _pooled_call(self, x, use_running_average, mask):
        ra_mean, ra_var = self.mean[...], self.var[...]
        y = super().__call__(x, use_running_average, mask=mask)
        # nnx.BatchNorm computes its statistics on x promoted to self.dtype.
        (x,) = self.promote_dtype((x,), dtype=self.dtype)
        # Replace the per-micro-batch update that nnx.BatchNorm just made.
        self._set(
            *stats_lib.train_step(
                self, x, mask, ra_mean, ra_var, self._window()
            )
        )
        return y

    def _flush(self, where: Any = True) -> None:
        self._set(
            *stats_lib.close(
                self.mean[...],
                self.var[...],
                self._window(),
                momentum=self.momentum,
                where=where,
            )
        )

    def flush(self) -> None:
        """Closes a partial window (end of an epoch); no-op when empty."""
        if self.accum_steps > 1:
            self._flush()
            self._record(self._stats())  # a flush always counts


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


class Optimizer(nnx.Optimizer):
    """``flax.nnx.Optimizer`` on the fused accumulation path.

    A subclass of :class:`flax.nnx.Optimizer` (same constructor, same
    ``step``, ``tx``, ``opt_state`` and ``wrt`` attributes, so
    ``nnx.state(optimizer)`` checkpoints as before). :meth:`update` calls
    :func:`optaxaccum.apply_gradients`: on a micro-step where the gate of
    ``tx`` (an :func:`optaxaccum.chain` holding an
    :func:`optaxaccum.accumulate` or a loss scale) stays closed, the model's
    parameters are not written and no update tree is built. :meth:`flush`
    closes the partial window at the end of an epoch, for the optimizer and
    for the model's :class:`AccumBatchNorm` layers together. Results equal
    ``nnx.Optimizer(model, tx, wrt=wrt)`` with the plain protocol.

    Args:
      model: the ``nnx.Module`` whose variables ``wrt`` selects.
      tx: any optax transformation; the fast path needs a gate.
      wrt: the filter of the variables to optimize (default ``nnx.Param``;
        e.g. ``nnx.LoRAParam``); it must match the ``wrt`` of ``nnx.grad``.
      graph: as for :class:`flax.nnx.Optimizer`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import optaxaccum as oa
      >>> from optaxaccum.flax.nnx import Optimizer
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> opt = Optimizer(model, oa.chain(oa.accumulate(4), optax.sgd(0.1)))
      >>> loss = lambda m, x: (m(x) ** 2).mean()
      >>> for i in range(3):  # 3 of a window of 4: the last of an epoch
      ...     _ = opt.update(model, nnx.grad(loss)(model, jnp.ones((1, 2))))
      >>> before = model.kernel[...]
      >>> opt.flush(model)  # steps SGD with the mean of the 3
      >>> bool((model.kernel[...] != before).all()), int(opt.step[...])
      (True, 3)
    """

    def __init__(
        self,
        model: Any,
        tx: optax.GradientTransformation,
        *,
        wrt: filterlib.Filter = nnx.Param,
        graph: bool | None = None,
    ):
        super().__init__(model, tx, wrt=wrt, graph=graph)

    def _pure(self, model: Any) -> tuple[Any, Any]:
        params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
        return params, nnx.as_pure(self.opt_state)

    def _store(self, model: Any, params: Any, opt_state: Any) -> None:
        nnx.update(model, params)
        nnx.update(self.opt_state, nnx.state(opt_state, graph=self.graph))

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        """One micro-batch through :func:`optaxaccum.apply_gradients`.

        Args:
          model: the model, updated in place.
          grads: the gradients from ``nnx.grad`` (filtered by ``wrt``).
          **kwargs: extra args for ``tx`` (e.g. ``accum_weight``).

        Returns:
          The updates applied, as :meth:`flax.nnx.Optimizer.update` returns
          them (zeros on a micro-step where the gate stays closed). Under
          ``nnx.jit`` a step that does not use them pays nothing for them
          (XLA drops the unused output).
        """
        params, old_opt_state = self._pure(model)
        grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
        params, opt_state, updates = chain_lib.apply_gradients(
            self.tx,
            grads,
            old_opt_state,
            params,
            return_updates=True,
            **nnx.as_pure(kwargs),
        )
        self._store(model, params, opt_state)
        for _, module in nnx.iter_modules(model):
            if isinstance(module, AccumBatchNorm):
                module.keep_counted(old_opt_state, opt_state)
        self.step[...] += 1
        return updates

    def flush(self, model: Any, /, **kwargs: Any) -> None:
        """Closes the partial windows at the end of an epoch.

        The optimizer's window is closed with :func:`optaxaccum.flush` and
        the update applied to ``model``; every :class:`AccumBatchNorm` of
        ``model`` is closed with its own momentum
        (:func:`flush_batch_stats`). Empty windows are left unchanged;
        ``step`` (which counts micro-batches) does not move.

        Args:
          model: the model, updated in place.
          **kwargs: extra args for the elements after the accumulation.

        Returns:
          ``None``.

        Raises:
          ValueError: if ``tx`` holds no :func:`optaxaccum.accumulate` that
            :func:`optaxaccum.flush` can reach.
        """
        params, opt_state = self._pure(model)
        updates, opt_state = oa.flush(
            self.tx, opt_state, params, **nnx.as_pure(kwargs)
        )
        flush_batch_stats(model)
        self._store(model, optax.apply_updates(params, updates), opt_state)
