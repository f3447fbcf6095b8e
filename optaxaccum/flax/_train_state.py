"""A Flax ``TrainState`` taking the fused accumulation path."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import optax
from flax.training import train_state
from flax.training.train_state import OVERWRITE_WITH_GRADIENT

from optaxaccum._src import accumulate as accumulate_lib
from optaxaccum._src import chain as chain_lib
from optaxaccum.flax import _stats

# Extra args of this package's chain elements; a keyword close to one of these
# or to a field name is taken for a typo rather than passed on.
_KNOWN_EXTRA_ARGS = ("accum_weight",)


def _check_spelling(kwargs: Mapping[str, Any], fields: set[str]) -> None:
    known = sorted(fields) + list(_KNOWN_EXTRA_ARGS)
    for key in kwargs:
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if close:
            raise TypeError(
                f"TrainState.apply_gradients got an unexpected keyword "
                f"argument {key!r}; did you mean {close[0]!r}? (Keywords that "
                "are not fields of the state are passed to the chain.)"
            )


def _with_windows_like(old: Any, new: Any) -> Any:
    """``old`` batch_stats with the empty BN windows that only ``new`` has.

    Variables of a plain ``nn.BatchNorm`` have no window entries; the first
    training call of :class:`AccumBatchNorm` adds them.
    """
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return old
    out = {k: _with_windows_like(v, new.get(k)) for k, v in old.items()}
    if all(k in new for k in _stats.WINDOW_KEYS) and not any(
        k in old for k in _stats.WINDOW_KEYS
    ):
        empty = _stats.empty_window(jax.numpy.shape(new["window_mean"]))
        out.update(zip(_stats.WINDOW_KEYS, empty, strict=True))
    return out if type(old) is dict else type(old)(out)


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
      batch_stats: the model's ``batch_stats`` collection, or ``None``.

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
          When the chain holds an :func:`optaxaccum.accumulate` and this call
          was not taken into its window (a loss-scale gate or
          ``skip_nonfinite`` dropped the micro-batch), a ``batch_stats``
          passed here is not kept either, so the BatchNorm window of
          :class:`AccumBatchNorm` stays aligned with the optimizer's window.
        """
        fields = {f.name for f in dataclasses.fields(self)}
        _check_spelling(kwargs, fields)
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
            counted = accumulate_lib.counted(self.opt_state, new_opt_state)
            if counted is not True:
                new_bs = replace["batch_stats"]
                old_bs = _with_windows_like(self.batch_stats, new_bs)
                replace["batch_stats"] = optax.tree.where(
                    counted, new_bs, old_bs
                )
        return self.replace(
            step=self.step + 1,
            params=new_params,
            opt_state=new_opt_state,
            **replace,
        )

    def flush(self, *, batch_stats_momentum: float | None = None) -> TrainState:
        """Closes the last, partial window (end of an epoch).

        Args:
          batch_stats_momentum: the ``momentum`` of the model's
            :class:`AccumBatchNorm` layers; required when ``batch_stats``
            holds their windows, which are then closed too with
            :func:`flush_batch_stats`, so both windows stay aligned.

        Returns:
          The state after :func:`optaxaccum.flush`: params stepped with the
          true mean of the partial window (unchanged for an empty window);
          ``step`` unchanged.

        Raises:
          ValueError: if ``batch_stats`` holds BatchNorm windows and
            ``batch_stats_momentum`` is not given.
        """
        params, owg = _split_owg(self.params)
        updates, opt_state = chain_lib.flush(self.tx, self.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if owg:
            new_params = {**self.params, "params": new_params}
        new = self.replace(params=new_params, opt_state=opt_state)
        if self.batch_stats is not None and _has_windows(self.batch_stats):
            if batch_stats_momentum is None:
                raise ValueError(
                    "TrainState.flush: batch_stats holds AccumBatchNorm "
                    "windows; pass batch_stats_momentum (the layers' "
                    "momentum) so that they are closed with the optimizer's "
                    "window"
                )
            new = new.replace(
                batch_stats=flush_batch_stats(
                    self.batch_stats, batch_stats_momentum
                )
            )
        return new


def _has_windows(batch_stats: Any) -> bool:
    if not isinstance(batch_stats, Mapping):
        return False
    return all(k in batch_stats for k in _stats.WINDOW_KEYS) or any(
        _has_windows(v) for v in batch_stats.values()
    )


def flush_batch_stats(batch_stats: Any, momentum: float) -> Any:
    """Closes the partial window of every linen :class:`AccumBatchNorm`.

    Folds the pooled statistics of a window that has fewer than
    ``accum_steps`` micro-batches into the running ``mean``/``var`` (with the
    true count, not the full window's) and empties the window. Layers with an
    empty window, and plain ``nn.BatchNorm`` layers, are left unchanged.

    Args:
      batch_stats: the ``batch_stats`` collection (a nested mapping).
      momentum: the ``momentum`` of the :class:`AccumBatchNorm` layers.

    Returns:
      The new ``batch_stats``, of the same structure.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from optaxaccum.flax import AccumBatchNorm, flush_batch_stats
      >>> bn = AccumBatchNorm(use_running_average=False, momentum=0.0,
      ...                     accum_steps=4)
      >>> v = bn.init(jax.random.key(0), jnp.ones((2, 1)))
      >>> _, upd = bn.apply(v, jnp.array([[1.0], [3.0]]),
      ...                   mutable=["batch_stats"])
      >>> flush_batch_stats(upd["batch_stats"], momentum=0.0)["mean"]
      Array([2.], dtype=float32)
    """
    if not isinstance(batch_stats, Mapping):
        raise TypeError(
            "flush_batch_stats expects the batch_stats mapping, got "
            f"{type(batch_stats).__name__}"
        )
    if isinstance(momentum, numbers.Real) and not 0 <= momentum <= 1:
        raise ValueError(f"momentum must be in [0, 1], got {momentum=}")
    out = {}
    for key, value in batch_stats.items():
        out[key] = (
            flush_batch_stats(value, momentum)
            if isinstance(value, Mapping)
            else value
        )
    if all(k in out for k in _stats.WINDOW_KEYS):
        window = _stats.Window(*(out[k] for k in _stats.WINDOW_KEYS))
        out["mean"], out["var"], window = _stats.flush(
            window, out["mean"], out["var"], momentum
        )
        out.update(zip(_stats.WINDOW_KEYS, window, strict=True))
    return out if type(batch_stats) is dict else type(batch_stats)(out)
