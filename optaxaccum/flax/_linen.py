"""``AccumBatchNorm`` for ``flax.linen``, and its ``batch_stats`` entries.

The layer keeps its window in extra ``batch_stats`` entries (the names are
``batch_stats.WINDOW_KEYS`` and ``MOMENTUM_KEY``). Beside it lives what
reads and writes those entries in a whole collection: one walker over the
nested mapping (:func:`_walk`), the flush of every window, the conversion
of ``nn.BatchNorm`` (or older) variables, and the one advice on converting
them (:data:`CONVERT_ADVICE`).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import module as linen_module

from optaxaccum._src import batch_stats as stats_lib
from optaxaccum._src import checks, numerics
from optaxaccum.flax._shared import CALL_DOC

# How to bring the batch_stats of a plain nn.BatchNorm, or of an older
# optaxaccum (no recorded momentum), up to date: every message says it so.
CONVERT_ADVICE: Final = (
    "convert them with optaxaccum.flax.convert_batch_stats(batch_stats, "
    "model.init(...)['batch_stats'])"
)


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
        closes on its own (under ``jax.jit``: ``jax.errors.JaxRuntimeError``
        with that message, when the step runs).
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
            checks.check_positive_int("accum_steps", self.accum_steps),
        )
        super().__post_init__()

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        if self.accum_steps > 1:
            training = not linen_module.merge_param(
                "use_running_average",
                self.use_running_average,
                use_running_average,
            )
            # In training the window pools the micro-batch; init creates
            # the window's variables.
            if training or self.is_initializing():
                return self._pooled_call(x, use_running_average, mask)
        return super().__call__(x, use_running_average, mask=mask)

    __call__.__doc__ = CALL_DOC

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
            self, x, mask, ra_mean, ra_var, window
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


# --------------------------------------------- the batch_stats collection


def _rebuild(like: Mapping, out: dict[str, Any]) -> Any:
    """``out`` as a mapping of ``like``'s type (a dict, a FrozenDict)."""
    return out if type(like) is dict else cast(Any, type(like))(out)


def _walk(
    fn: Callable[[str, Any, Any], Any],
    tree: Any,
    like: Any = None,
    path: str = "",
) -> Any:
    """The one walker over a nested ``batch_stats`` mapping.

    ``fn(path, node, like_node)`` replaces every node, a mapping before its
    entries, which are then walked beside ``like``'s entries of the same
    keys (``None`` where ``like`` has none). ``path`` is written as the
    messages write it: ``"['block']['bn']"``.
    """
    tree = fn(path, tree, like)
    if not isinstance(tree, Mapping):
        return tree
    beside = like if isinstance(like, Mapping) else {}
    return _rebuild(
        tree,
        {
            k: _walk(fn, v, beside.get(k), f"{path}[{k!r}]")
            for k, v in tree.items()
        },
    )


def _is_layer(node: Any) -> bool:
    """Whether ``node`` holds an AccumBatchNorm window."""
    return isinstance(node, Mapping) and all(
        k in node for k in stats_lib.WINDOW_KEYS
    )


def layers(batch_stats: Any) -> Iterator[tuple[str, Mapping]]:
    """``(path, entries)`` of every AccumBatchNorm window in
    ``batch_stats``, outermost first."""
    found: list[tuple[str, Mapping]] = []

    def visit(path: str, node: Any, _: Any) -> Any:
        if _is_layer(node):
            found.append((path, node))
        return node

    _walk(visit, batch_stats)
    return iter(found)


def has_windows(batch_stats: Any) -> bool:
    return any(True for _ in layers(batch_stats))


def lacks_momentum(batch_stats: Any) -> bool:
    """Whether a layer of ``batch_stats`` holds a window but no momentum."""
    return any(
        stats_lib.MOMENTUM_KEY not in layer for _, layer in layers(batch_stats)
    )


def window_steps(batch_stats: Any) -> dict[str, Any]:
    """``window_step`` of every layer window, by path."""
    return {p: layer["window_step"] for p, layer in layers(batch_stats)}


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


def with_windows_like(old: Any, new: Any) -> Any:
    """``old`` batch_stats with the AccumBatchNorm entries only ``new`` has.

    Variables of a plain ``nn.BatchNorm`` (or of an older optaxaccum, without
    ``momentum``) lack some; the first training call adds them.
    """

    def complete(_: str, node: Any, like: Any) -> Any:
        if not isinstance(node, Mapping) or not isinstance(like, Mapping):
            return node
        return _rebuild(node, {**node, **_missing_extras(node, like)})

    return _walk(complete, old, new)


def warn_deprecated(what: str) -> None:
    warnings.warn(
        f"{what} is deprecated: every AccumBatchNorm layer records its own "
        "momentum in batch_stats, and flushing uses it. Drop the argument "
        f"(for batch_stats of an older optaxaccum, {CONVERT_ADVICE}). Until "
        "then the value passed is used, and one that differs from a layer's "
        "recorded momentum raises ValueError where it can be checked "
        "(outside jit).",
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
                f"{CONVERT_ADVICE}"
            )
        return recorded
    if recorded is not None:
        r, g = (
            numerics.concrete(recorded, np.float32),
            numerics.concrete(given, np.float32),
        )
        if r is not None and g is not None and r != g:
            raise ValueError(
                f"the momentum passed ({given!r}) is not the momentum of the "
                f"AccumBatchNorm layer at batch_stats{path} ({float(r):g}); "
                "drop the argument: each layer's own momentum is used"
            )
    return given  # deprecated: the value passed, as before


def flush_windows(batch_stats: Mapping, momentum: Any, where: Any = True):
    """Closes every AccumBatchNorm window of ``batch_stats`` where
    ``where``, each with its layer's recorded momentum (or ``momentum``,
    deprecated, when given)."""

    def close(path: str, node: Any, _: Any) -> Any:
        if not _is_layer(node):
            return node
        out = dict(node)
        layer_momentum = _layer_momentum(
            out.get(stats_lib.MOMENTUM_KEY), momentum, path
        )
        window = stats_lib.Window(*(out[k] for k in stats_lib.WINDOW_KEYS))
        out["mean"], out["var"], window = stats_lib.close(
            out["mean"],
            out["var"],
            window,
            momentum=layer_momentum,
            where=where,
        )
        out.update(zip(stats_lib.WINDOW_KEYS, window, strict=True))
        return _rebuild(node, out)

    return _walk(close, batch_stats)


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
        warn_deprecated("flush_batch_stats(batch_stats, momentum)")
        if isinstance(momentum, numbers.Real) and not 0 <= float(momentum) <= 1:
            raise ValueError(f"momentum must be in [0, 1], got {momentum=}")
    return flush_windows(batch_stats, momentum)


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
    return _walk(_checked_and_completed, batch_stats, template)


def _checked_and_completed(path: str, bs: Any, tpl: Any) -> Any:
    """One node of :func:`convert_batch_stats`: checked against the
    template's, and completed with the layer's missing entries."""
    where = f"batch_stats{path}"
    if not isinstance(bs, Mapping) or not isinstance(tpl, Mapping):
        if isinstance(bs, Mapping) or isinstance(tpl, Mapping):
            raise ValueError(
                f"{where} is a {type(bs).__name__} but the template's is a "
                f"{type(tpl).__name__}"
            )
        if bs is tpl:  # an entry taken from the template
            return bs
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
    return _rebuild(bs, {**bs, **extras})
