"""A Flax ``TrainState`` taking the fused accumulation path."""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, cast

import jax
import numpy as np
import optax
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

from optaxaccum._src import batch_stats as stats_lib
from optaxaccum._src import chain as chain_lib
from optaxaccum._src import utils, windows


def _rebuild(like: Mapping, out: dict[str, Any]) -> Any:
    """``out`` as a mapping of ``like``'s type (a dict, a FrozenDict)."""
    return out if type(like) is dict else cast(Any, type(like))(out)


def _with_windows_like(old: Any, new: Any) -> Any:
    """``old`` batch_stats with the AccumBatchNorm entries only ``new`` has.

    Variables of a plain ``nn.BatchNorm`` (or of an older optaxaccum, without
    ``momentum``) lack some; the first training call adds them.
    """
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return old
    out = {k: _with_windows_like(v, new.get(k)) for k, v in old.items()}
    out.update(_missing_extras(old, new))
    return _rebuild(old, out)


def _missing_extras(old: Mapping, like: Mapping) -> dict[str, Any]:
    """The AccumBatchNorm entries of layer ``like`` that ``old`` lacks: an
    empty window, ``like``'s momentum."""
    if not all(k in like for k in stats_lib.WINDOW_KEYS):
        return {}
    extras: dict[str, Any] = dict(
        zip(
            stats_lib.WINDOW_KEYS,
            stats_lib.empty_window(jax.numpy.shape(like["window_mean"])),
            strict=True,
        )
    )
    if stats_lib.MOMENTUM_KEY in like:
        extras[stats_lib.MOMENTUM_KEY] = like[stats_lib.MOMENTUM_KEY]
    return {k: v for k, v in extras.items() if k not in old}


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
        utils.check_extra_args(
            kwargs,
            fields | utils.declared_extra_args(self.tx),
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
            _warn_deprecated("TrainState.flush(batch_stats_momentum=...)")
        params, owg = _split_owg(self.params)
        updates, opt_state = chain_lib.flush(
            self.tx, self.opt_state, params, **extra_args
        )
        new_params = optax.apply_updates(params, updates)
        if owg:
            new_params = {**self.params, "params": new_params}
        new = self.replace(params=new_params, opt_state=opt_state)
        if self.batch_stats is not None and _has_windows(self.batch_stats):
            new = new.replace(
                batch_stats=_flush_batch_stats(self.batch_stats, momentum, "")
            )
        return new


def _follow_window(old: Any, new: Any, old_opt: Any, new_opt: Any) -> Any:
    """The ``new`` batch_stats where the optimizer counted the call that
    turned ``old_opt`` into ``new_opt`` (else ``old``'s), their windows
    closed where that call closed the optimizer's window."""
    kept = stats_lib.keep_counted(
        old_opt, new_opt, new, _with_windows_like(old, new)
    )
    closed = stats_lib.closed(old_opt, new_opt)
    _check_steps(old, new, old_opt, new_opt, closed)
    known = utils.concrete(closed)
    if (known is not None and not known) or not _has_windows(kept):
        return kept
    if _lacks_momentum(kept):
        warnings.warn(
            "batch_stats of an older optaxaccum (no recorded momentum): their "
            "AccumBatchNorm windows close on accum_steps only, not with the "
            "optimizer's window; convert them with optaxaccum.flax."
            "convert_batch_stats(batch_stats, model.init(...)['batch_stats'])",
            UserWarning,
            stacklevel=3,
        )
        return kept
    return _flush_batch_stats(kept, None, "", where=closed)


def _check_steps(old: Any, new: Any, old_opt: Any, new_opt: Any, closed):
    """Raises where a layer closed its window on its own ``accum_steps``
    (shorter than the optimizer's window) on this call."""
    before = dict(_window_steps(old))
    pairs = [(p, s) for p, s in _window_steps(new) if p in before]
    stats_lib.check_closed_with(
        [f"at batch_stats{p}" for p, _ in pairs],
        [before[p] for p, _ in pairs],
        [s for _, s in pairs],
        windows.counted(old_opt, new_opt),
        closed,
    )


def _window_steps(batch_stats: Any, path: str = "") -> list[tuple[str, Any]]:
    """``(path, window_step)`` of every layer window in ``batch_stats``."""
    if not isinstance(batch_stats, Mapping):
        return []
    found = []
    if all(k in batch_stats for k in stats_lib.WINDOW_KEYS):
        found.append((path, batch_stats["window_step"]))
    for key, value in batch_stats.items():
        found += _window_steps(value, f"{path}[{key!r}]")
    return found


def _lacks_momentum(batch_stats: Any) -> bool:
    """Whether a layer of ``batch_stats`` holds a window but no momentum."""
    if not isinstance(batch_stats, Mapping):
        return False
    if all(k in batch_stats for k in stats_lib.WINDOW_KEYS):
        return stats_lib.MOMENTUM_KEY not in batch_stats
    return any(_lacks_momentum(v) for v in batch_stats.values())


def _has_windows(batch_stats: Any) -> bool:
    if not isinstance(batch_stats, Mapping):
        return False
    return all(k in batch_stats for k in stats_lib.WINDOW_KEYS) or any(
        _has_windows(v) for v in batch_stats.values()
    )


def _warn_deprecated(what: str) -> None:
    warnings.warn(
        f"{what} is deprecated: every AccumBatchNorm layer records its own "
        "momentum in batch_stats, and flushing uses it. Drop the argument "
        "(convert batch_stats of an older optaxaccum with "
        "optaxaccum.flax.convert_batch_stats). Until then the value passed "
        "is used, and one that differs from a layer's recorded momentum "
        "raises ValueError where it can be checked (outside jit).",
        DeprecationWarning,
        stacklevel=3,
    )


def _layer_momentum(recorded: Any, given: Any, path: str) -> Any:
    """The momentum that closes the window of the layer at ``path``."""
    if given is None:
        if recorded is None:
            raise ValueError(
                f"batch_stats{path} holds an AccumBatchNorm window but not "
                "the layer's momentum (batch_stats of an older optaxaccum); "
                "convert them with optaxaccum.flax.convert_batch_stats("
                "batch_stats, model.init(...)['batch_stats'])"
            )
        return recorded
    if recorded is not None:
        r, g = (
            utils.concrete(recorded, np.float32),
            utils.concrete(given, np.float32),
        )
        if r is not None and g is not None and r != g:
            raise ValueError(
                f"the momentum passed ({given!r}) is not the momentum of the "
                f"AccumBatchNorm layer at batch_stats{path} ({float(r):g}); "
                "drop the argument: each layer's own momentum is used"
            )
    return given  # deprecated: the value passed, as before


def _flush_batch_stats(
    batch_stats: Mapping, momentum: Any, path: str, where: Any = True
) -> Any:
    """Closes every AccumBatchNorm window of ``batch_stats`` where
    ``where``."""
    out = {
        key: _flush_batch_stats(value, momentum, f"{path}[{key!r}]", where)
        if isinstance(value, Mapping)
        else value
        for key, value in batch_stats.items()
    }
    if all(k in out for k in stats_lib.WINDOW_KEYS):
        layer_momentum = _layer_momentum(
            out.get(stats_lib.MOMENTUM_KEY), momentum, path
        )
        window = stats_lib.Window(*(out[k] for k in stats_lib.WINDOW_KEYS))
        out["mean"], out["var"], window = stats_lib.flush(
            window, out["mean"], out["var"], layer_momentum, where
        )
        out.update(zip(stats_lib.WINDOW_KEYS, window, strict=True))
    return _rebuild(batch_stats, out)


def flush_batch_stats(batch_stats: Any, momentum: Any = None) -> Any:
    """Closes the partial window of every linen :class:`AccumBatchNorm`.

    Folds the pooled statistics of a window that has fewer than
    ``accum_steps`` micro-batches into the running ``mean``/``var`` (with the
    true count, not the full window's), with the momentum that the layer
    recorded in ``batch_stats``, and empties the window. Layers with an empty
    window, and plain ``nn.BatchNorm`` layers, are left unchanged.

    Args:
      batch_stats: the ``batch_stats`` collection (a nested mapping).
      momentum: deprecated, no longer needed; a value that differs from a
        layer's recorded momentum raises ``ValueError`` (outside ``jit``).

    Returns:
      The new ``batch_stats``, of the same structure.

    Raises:
      TypeError: if ``batch_stats`` is not a mapping.
      ValueError: if a layer's window comes without its momentum (convert
        such ``batch_stats`` with :func:`convert_batch_stats`).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from optaxaccum.flax import AccumBatchNorm, flush_batch_stats
      >>> bn = AccumBatchNorm(use_running_average=False, momentum=0.0,
      ...                     accum_steps=4)
      >>> v = bn.init(jax.random.key(0), jnp.ones((2, 1)))
      >>> _, upd = bn.apply(v, jnp.array([[1.0], [3.0]]),
      ...                   mutable=["batch_stats"])
      >>> flush_batch_stats(upd["batch_stats"])["mean"]
      Array([2.], dtype=float32)
    """
    if not isinstance(batch_stats, Mapping):
        raise TypeError(
            "flush_batch_stats expects the batch_stats mapping, got "
            f"{type(batch_stats).__name__}"
        )
    if momentum is not None:
        _warn_deprecated("flush_batch_stats(batch_stats, momentum)")
        if isinstance(momentum, numbers.Real) and not 0 <= float(momentum) <= 1:
            raise ValueError(f"momentum must be in [0, 1], got {momentum=}")
    return _flush_batch_stats(batch_stats, momentum, "")


def convert_batch_stats(batch_stats: Any, template: Any) -> Any:
    """``batch_stats`` completed with the entries of :class:`AccumBatchNorm`.

    Variables of a plain ``nn.BatchNorm`` (a pretrained model) hold only
    ``mean`` and ``var``; :class:`AccumBatchNorm` adds its window and its
    momentum on the first training call, which changes the tree structure of
    the state (a retrace, and ``lax.scan`` with the state as carry fails).
    This adds them up front: for every layer of ``template`` with a window,
    an empty window and the layer's momentum; all else comes from
    ``batch_stats``, unchanged. Idempotent; also completes the
    ``batch_stats`` of an older optaxaccum (without ``momentum``).

    Args:
      batch_stats: the ``batch_stats`` to load (a nested mapping).
      template: the model's own ``batch_stats``, e.g.
        ``model.init(key, x)["batch_stats"]`` (concrete arrays: the momentum
        is read from it; any window in it is not copied).

    Returns:
      ``batch_stats`` with the tree structure of ``template``.

    Raises:
      ValueError: if the two differ otherwise (a layer or entry missing on
        either side, or an entry of another shape or dtype); the error names
        the path.
      TypeError: if a momentum in ``template`` is abstract (from
        ``jax.eval_shape``).

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from optaxaccum.flax import AccumBatchNorm, convert_batch_stats
      >>> x, key = jnp.ones((4, 3)), jax.random.key(0)
      >>> plain = nn.BatchNorm(True).init(key, x)["batch_stats"]
      >>> bn = AccumBatchNorm(True, momentum=0.9, accum_steps=4)
      >>> template = bn.init(key, x)["batch_stats"]
      >>> converted = convert_batch_stats(plain, template)
      >>> jax.tree.structure(converted) == jax.tree.structure(template)
      True
      >>> sorted(set(converted) - set(plain))
      ['momentum', 'window_count', 'window_m2', 'window_mean', 'window_step']
    """
    return _convert(batch_stats, template, "")


def _convert(bs: Any, tpl: Any, path: str) -> Any:
    where = f"batch_stats{path}"
    if not isinstance(bs, Mapping) or not isinstance(tpl, Mapping):
        if isinstance(bs, Mapping) or isinstance(tpl, Mapping):
            raise ValueError(
                f"{where} is a {type(bs).__name__} but the template's is a "
                f"{type(tpl).__name__}"
            )
        got = (jax.numpy.shape(bs), jax.numpy.result_type(bs))
        want = (jax.numpy.shape(tpl), jax.numpy.dtype(tpl.dtype))
        if got != want:
            raise ValueError(
                f"{where} has shape and dtype {got}, the template {want}"
            )
        return bs
    extras = _missing_extras(bs, tpl)
    missing = [k for k in tpl if k not in bs and k not in extras]
    unexpected = [k for k in bs if k not in tpl]
    if missing or unexpected:
        raise ValueError(
            f"{where} does not match the template: missing {missing}, "
            f"not in the template {unexpected}"
        )
    momentum = extras.get(stats_lib.MOMENTUM_KEY)
    if momentum is not None and not isinstance(
        momentum, (jax.Array, np.ndarray, numbers.Real)
    ):
        raise TypeError(
            f"the template's {where}[{stats_lib.MOMENTUM_KEY!r}] is "
            f"{type(momentum).__name__}, not an array: give the batch_stats "
            "of model.init(...), not of jax.eval_shape (the momentum is read "
            "from it)"
        )
    out = {k: _convert(v, tpl[k], f"{path}[{k!r}]") for k, v in bs.items()}
    out.update(extras)
    return _rebuild(bs, out)
