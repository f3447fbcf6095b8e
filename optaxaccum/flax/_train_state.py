"""A Flax ``TrainState`` taking the fused accumulation path."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import optax
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

from optaxaccum._src import batch_stats as stats_lib
from optaxaccum._src import chain as chain_lib
from optaxaccum._src import keywords, numerics, windows
from optaxaccum.flax import _linen


def _split_owg(params: Any) -> tuple[Any, bool]:
    """The params the optimizer sees, and whether flax's
    overwrite-with-gradient entry is present."""
    owg = isinstance(params, Mapping) and OVERWRITE_WITH_GRADIENT in params
    return (params["params"] if owg else params), owg


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` on the fused path.

    A subclass of flax's ``TrainState`` whose :meth:`apply_gradients` calls
    :func:`optaxaccum.apply_gradients`: on a micro-step that does not close
    the window the params come back untouched and no zero-update tree is
    built. It adds one field, ``batch_stats`` (default ``None``), for models
    with BatchNorm.

    Attributes:
      batch_stats: the model's ``batch_stats`` collection, or ``None``. For
        variables of a plain ``nn.BatchNorm``, pass them through
        :func:`convert_batch_stats` first, so that the state's structure is
        fixed from the first step (``jax.lax.scan``).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import flax.linen as nn
      >>> import optaxaccum as oa
      >>> from optaxaccum.flax import TrainState
      >>> model = nn.Dense(1)
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
      >>> state = TrainState.create(
      ...     apply_fn=model.apply, params=params,
      ...     tx=oa.chain(oa.accumulate(2), optax.sgd(0.1)))
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> state = state.apply_gradients(grads=grads, accum_weight=3.0)
      >>> int(state.step), bool(oa.has_updated(state.opt_state))
      (1, False)
    """

    batch_stats: Any = None

    @property
    def optimizer_step(self) -> Any:
        """How many times the optimizer stepped (an int32 scalar array):
        :func:`optaxaccum.optimizer_step` of ``opt_state``. ``step`` counts
        micro-batches; give this one to a learning-rate schedule or a log.
        """
        return windows.optimizer_step(self.opt_state)

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Applies one micro-batch's gradients through the fused path.

        Args:
          grads: gradients with the structure of ``params``.
          **kwargs: keywords naming fields of the state (``batch_stats``, or
            fields of a subclass) replace them, as in flax; all others
            (``accum_weight``, ...) are passed to the chain as extra args.

        Returns:
          The new state, with ``step`` incremented by one (``step`` counts
          calls, i.e. micro-batches; see :func:`optaxaccum.has_updated` for
          windows).

        .. note::
          When the chain holds an :func:`optaxaccum.accumulate`, the
          :class:`AccumBatchNorm` windows in a ``batch_stats`` passed here
          follow the optimizer's window: where this call was not taken into
          it (a loss-scale gate or ``skip_nonfinite`` dropped the
          micro-batch) the ``batch_stats`` are not kept, and where the call
          closed it the BatchNorm windows close too (any window length, a
          callable ``every_k`` such as
          :func:`optaxaccum.critical_batch_every_k` included).
        """
        fields = {f.name for f in dataclasses.fields(self)}
        keywords.check_extra_args(
            kwargs,
            fields | keywords.declared_extra_args(self.tx),
            "it is neither a field of TrainState nor taken by its chain",
        )
        replace = {k: v for k, v in kwargs.items() if k in fields}
        extra_args = {k: v for k, v in kwargs.items() if k not in fields}
        opt_grads, owg = _split_owg(grads)  # as flax: decided by the grads
        params = self.params["params"] if owg else self.params
        new_params, new_opt_state = chain_lib.apply_gradients(
            self.tx, opt_grads, self.opt_state, params, **extra_args
        )
        if owg:
            new_params = {
                "params": new_params,
                OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT],
            }
        if "batch_stats" in replace and self.batch_stats is not None:
            replace["batch_stats"] = _follow_window(
                self.batch_stats,
                replace["batch_stats"],
                self.opt_state,
                new_opt_state,
            )
        return self.replace(
            step=self.step + 1,
            params=new_params,
            opt_state=new_opt_state,
            **replace,
        )

    def flush(self, **extra_args: Any) -> TrainState:
        """Closes the last, partial windows (end of an epoch).

        Closes the optimizer's window with :func:`optaxaccum.flush` and, when
        ``batch_stats`` holds :class:`AccumBatchNorm` windows, those too, each
        with its layer's own momentum (recorded in ``batch_stats``), so the
        two windows stay aligned.

        Args:
          **extra_args: passed to the chain's elements after the accumulation
            (e.g. ``value=`` for ``optax.contrib.reduce_on_plateau``).
            ``batch_stats_momentum`` is deprecated: no longer needed; a value
            that is not a layer's momentum raises ``ValueError`` (outside
            ``jit``).

        Returns:
          The state after :func:`optaxaccum.flush`: params stepped with the
          true mean of the partial window (unchanged for an empty window);
          ``step`` unchanged.

        Raises:
          ValueError: if ``batch_stats`` holds a window without its layer's
            momentum (batch_stats of an older optaxaccum: convert them with
            :func:`convert_batch_stats`).
        """
        momentum = extra_args.pop("batch_stats_momentum", None)
        if momentum is not None:
            _linen.warn_deprecated("TrainState.flush(batch_stats_momentum=...)")
        params, owg = _split_owg(self.params)
        updates, opt_state = chain_lib.flush(
            self.tx, self.opt_state, params, **extra_args
        )
        new_params = optax.apply_updates(params, updates)
        if owg:
            new_params = {**self.params, "params": new_params}
        new = self.replace(params=new_params, opt_state=opt_state)
        if self.batch_stats is not None and _linen.has_windows(
            self.batch_stats
        ):
            new = new.replace(
                batch_stats=_linen.flush_windows(self.batch_stats, momentum)
            )
        return new


def _follow_window(old: Any, new: Any, old_opt: Any, new_opt: Any) -> Any:
    """The ``new`` batch_stats where the optimizer counted the call that
    turned ``old_opt`` into ``new_opt`` (else ``old``'s), their windows
    closed where that call closed the optimizer's window."""
    kept = stats_lib.keep_counted(
        old_opt, new_opt, old=_linen.with_windows_like(old, new), new=new
    )
    closed = stats_lib.closed(old_opt, new_opt)
    _check_steps(old, new, old_opt, new_opt, closed)
    known = numerics.concrete(closed)
    if (known is not None and not known) or not _linen.has_windows(kept):
        return kept
    if _linen.lacks_momentum(kept):
        warnings.warn(
            "batch_stats of an older optaxaccum (no recorded momentum): their "
            "AccumBatchNorm windows close on accum_steps only, not with the "
            f"optimizer's window; {_linen.CONVERT_ADVICE}",
            UserWarning,
            stacklevel=3,
        )
        return kept
    return _linen.flush_windows(kept, None, where=closed)


def _check_steps(old: Any, new: Any, old_opt: Any, new_opt: Any, closed):
    """Raises where a layer closed its window on its own ``accum_steps``
    (shorter than the optimizer's window) on this call."""
    before = _linen.window_steps(old)
    after = {p: s for p, s in _linen.window_steps(new).items() if p in before}
    stats_lib.check_closed_with(
        [f"at batch_stats{p}" for p in after],
        [before[p] for p in after],
        list(after.values()),
        windows.counted(old_opt, new_opt),
        closed,
    )
