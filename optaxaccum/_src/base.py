"""The gate protocol of :func:`optaxaccum.chain`: decide, emit, flush.

A *gate* is an optax transformation that decides, on each call, whether the
transformations after it in an :func:`optaxaccum.chain` run. It is an
ordinary :class:`optax.GradientTransformationExtraArgs` (usable alone or in
``optax.chain``) that also has a ``gate_update`` function. Every gate
receives the same arguments as ``update`` and returns a :class:`GateResult`:

* **decide**: ``GateResult.may_open``, a boolean scalar, and
  ``GateResult.state``, the gate's state if it stays closed.
* **emit**: ``GateResult.emit()``, called only inside the branch of a
  ``lax.cond`` taken when ``may_open`` is true, returns an :class:`Emitted`:
  the updates to pass on, the gate's state then, whether the followers run
  after all (``opened``: a decision that needs the branch's work, e.g. a
  total weight summed across devices) and extra arguments for the followers.
  Work that matters only when the gate opens (dividing by the window's
  weight, an all-reduce) belongs here.
* **flush** (optional): ``gate_flush(state, params, **extra_args)`` returns a
  :class:`GateResult` that closes a partial window without a new gradient.

A gate whose ``emit`` costs nothing (it returns values computed anyway, as a
loss scale's unscaled gradients) sets ``GateResult.eager``: the chain then
calls ``emit`` on every step and merges the gate's decision with the next
gate's, so the fused step keeps its fast path. The next gate learns whether
the eager one let the call pass from the keyword ``passed`` (a flag) of its
``gate_update``: where it is false the call must not count (closed state as
it was, ``may_open`` false). A gate that does not take ``passed`` gets the
same effect from the chain (:func:`call_gate`), at the cost of holding its
new state next to the old.

A ``flag`` below is a boolean scalar array or the literal ``True`` (known
open: no conditional or select is built for it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeAlias, TypeGuard

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optaxaccum._src import utils

__all__ = [
    "Emitted",
    "GateResult",
    "GatedTransformation",
    "is_gate",
    "resolve",
]


class Emitted(NamedTuple):
    """What a gate's ``emit`` returns (a plain 3-tuple is accepted too).

    Attributes:
      updates: the updates passed on to the followers.
      state: the gate's state when it opens.
      opened: a flag: whether the followers run; when false the updates are
        replaced by zeros and ``state`` is kept.
      follower_args: extra arguments replacing the call's own for the
        followers (a closing accumulate passes its total ``accum_weight``).
      reached: a flag: whether the call reached the last gate of a chain
        (false where a later gate of the chain did not open).
    """

    updates: optax.Updates
    state: Any  # the gate's state (a pytree)
    opened: Any = True
    follower_args: Mapping[str, Any] = {}
    reached: Any = True


class GateResult(NamedTuple):
    """What a gate decided on one call.

    Attributes:
      state: the gate's state to keep when it stays closed (a pytree).
      may_open: a flag: whether ``emit`` is to be called.
      emit: a function of no arguments returning an :class:`Emitted` (or
        ``(updates, state, opened)``); called only inside the ``lax.cond``
        branch taken when ``may_open`` is true, unless ``eager``.
      eager: ``True`` when ``emit`` costs nothing and may be called on every
        step; default ``False``.
      empty: a flag: the call closed a window of weight 0 (``may_open`` is
        false): the followers do not step, but a later gate counts the
        window as one call of weight 0 (``emit`` is called for it).
    """

    state: Any  # the gate's state (a pytree)
    may_open: Any
    emit: Callable[[], tuple]
    eager: bool = False
    empty: Any = False


# ``gate_update(updates, state, params=None, *, passed=True, **extra_args)``
GateUpdateFn: TypeAlias = Callable[..., GateResult]
# ``gate_flush(state, params, **extra_args)``
GateFlushFn: TypeAlias = Callable[..., GateResult]


class GatedTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation that is also a gate of :func:`chain`.

    A :class:`optax.GradientTransformationExtraArgs` (``init``, ``update``)
    with two more attributes, ``gate_update`` and ``gate_flush`` (see the
    protocol above). Its plain ``update`` is derived from ``gate_update``:
    zeros when the gate stays closed.

    Args:
      init: the usual ``init(params) -> state``.
      gate_update: ``(updates, state, params=None, **extra_args) ->
        GateResult``.
      gate_flush: optional ``(state, params, **extra_args) -> GateResult``.

    Example:
      A gate that lets only finite gradients through:

      >>> import jax, jax.numpy as jnp, optax
      >>> import optaxaccum as oa
      >>> def gate_update(updates, state, params=None, **extra_args):
      ...   finite = jnp.all(jnp.isfinite(updates))
      ...   return oa.GateResult(state, finite, lambda: (updates, state, True))
      >>> only_finite = oa.GatedTransformation(
      ...     lambda params: optax.EmptyState(), gate_update)
      >>> tx = oa.chain(only_finite, optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(2))
      >>> tx.update(jnp.array([1.0, jnp.nan]), state)[0]
      Array([0., 0.], dtype=float32)
    """

    gate_update: GateUpdateFn
    gate_flush: GateFlushFn | None

    def __new__(
        cls,
        init: optax.TransformInitFn,
        gate_update: GateUpdateFn,
        gate_flush: GateFlushFn | None = None,
    ):
        # The plain update declares what gate_update takes by name, so that
        # chains can tell a near-miss keyword (``acum_weight``) from others.
        names = utils.declared_extra_args(gate_update, skip=3)

        def update_fn(updates, state, params=None, **extra_args):
            utils.check_extra_args(extra_args, names)
            return resolve(gate_update(updates, state, params, **extra_args))

        self = super().__new__(
            cls, init, utils.with_signature(update_fn, names)
        )
        self.gate_update = gate_update
        self.gate_flush = gate_flush
        return self

    def __getnewargs__(self):
        # copy/deepcopy/pickle rebuild through __new__ with these arguments.
        return (self.init, self.gate_update, self.gate_flush)


def _flatten_gate(tx: GatedTransformation):
    return (tx.init, tx.update), (tx.gate_update, tx.gate_flush)


def _unflatten_gate(aux, children) -> GatedTransformation:
    init, _ = children  # update is derived from gate_update again
    return GatedTransformation(init, *aux)


# A NamedTuple subclass would otherwise be rebuilt by jax.tree functions as
# GatedTransformation(init, update), losing gate_update.
jax.tree_util.register_pytree_node(
    GatedTransformation, _flatten_gate, _unflatten_gate
)


def is_gate(tx: Any) -> TypeGuard[GatedTransformation]:
    """Whether ``tx`` is a gate (a :class:`GatedTransformation`)."""
    return isinstance(tx, GatedTransformation)


def zeros_of(shapes: Any) -> Any:
    """Zeros with the shapes and dtypes of a tree of ``ShapeDtypeStruct``."""
    # zeros_like keeps the sharding and the device-varying type of each
    # ShapeDtypeStruct, so both branches of a lax.cond agree on them.
    return jax.tree.map(jnp.zeros_like, shapes)


def cond_or_call(pred: Any, true_fn: Callable, false_fn: Callable) -> Any:
    """``lax.cond(pred, true_fn, false_fn)``, or a plain call when ``pred`` is
    known now (the literal ``True``, or a concrete array outside any trace):
    then no conditional is built, which spares eager callers a compilation of
    both branches on every call."""
    if pred is True:
        return true_fn()
    try:
        concrete = bool(pred)
    except jax.errors.ConcretizationTypeError:  # traced: decide at run time
        return lax.cond(pred, true_fn, false_fn)
    return true_fn() if concrete else false_fn()


def replaced(extra_args: dict[str, Any], window: Any) -> dict[str, Any]:
    """The call's keywords with ``accum_weight`` replaced by an earlier
    window's total weight ``window`` where the call passed one."""
    if window is None or "accum_weight" not in extra_args:
        return extra_args
    return {**extra_args, "accum_weight": window}


def follower_args(
    tx: Any, extra_args: dict[str, Any], window: Any
) -> dict[str, Any]:
    """The keywords a follower ``tx`` sees: exactly the call's (already
    :func:`replaced`), plus the window's total as ``accum_weight`` if ``tx``
    declares ``accum_weight`` by name (a nested accumulate). No other
    keyword reaches it: optax's linesearches hand unknown keywords to
    ``value_fn``."""
    if window is None or "accum_weight" not in utils.declared_extra_args(tx):
        return extra_args
    return {**extra_args, "accum_weight": window}


def call_gate(
    gate: GatedTransformation,
    passed: Any,
    window: Any,
    updates: optax.Updates,
    state: optax.OptState,
    params: optax.Params | None = None,
    **extra_args: Any,
) -> GateResult:
    """``gate.gate_update`` for a call that earlier gates let ``passed``.

    Where ``passed`` is false the call must not count: the gate's closed
    state is its state as it was, and it does not open. A gate whose
    ``gate_update`` takes the keyword ``passed`` does this itself (inside
    its own update, so no tree is held twice); for any other gate the
    state is selected here. ``window`` is the total weight of an earlier
    accumulate's window (or ``None``), given as ``window_weight`` to a gate
    that takes it, else as in :func:`follower_args`.
    """
    if window is not None:
        if "window_weight" in utils.keywords(gate.gate_update):
            extra_args = {**extra_args, "window_weight": window}
        else:
            extra_args = follower_args(gate, extra_args, window)
    if passed is True:
        return gate.gate_update(updates, state, params, **extra_args)
    if "passed" in utils.keywords(gate.gate_update):
        return gate.gate_update(
            updates, state, params, passed=passed, **extra_args
        )
    res = gate.gate_update(updates, state, params, **extra_args)
    return res._replace(
        state=select(passed, res.state, state),
        may_open=both(passed, res.may_open),
    )


def resolve(res: GateResult) -> tuple[optax.Updates, optax.OptState]:
    """Turns a :class:`GateResult` into the plain ``(updates, state)``.

    When the gate stays closed (or opens but does not let the followers run)
    the updates are zeros with the structure, shapes and dtypes of those it
    would have emitted.

    Args:
      res: a gate's result for one call.

    Returns:
      ``(updates, state)`` as an ordinary ``update`` returns them.
    """

    def opened():
        updates, state, flag, *_ = emitted(res)
        return mask(flag, updates), state

    def closed():
        return zeros_of(jax.eval_shape(opened)[0]), res.state

    return cond_or_call(res.may_open, opened, closed)


def emitted(res: GateResult) -> Emitted:
    """Calls ``res.emit()`` and returns its result as an :class:`Emitted`."""
    return Emitted(*res.emit())


def mask(flag: Any, updates: optax.Updates) -> optax.Updates:
    """``updates`` where ``flag``, else zeros (no-op for the literal True)."""
    if flag is True:  # no zeros to build (eager callers would allocate them)
        return updates
    return select(flag, updates, jax.tree.map(jnp.zeros_like, updates))


def either(a: Any, b: Any) -> Any:
    """``a | b`` for boolean scalars, keeping the literals ``True`` and
    ``False``."""
    if a is True or b is False:
        return a
    if a is False:
        return b
    return a | b


def both(a: Any, b: Any) -> Any:
    """``a & b`` for boolean scalars, keeping the literal ``True``."""
    if a is True:
        return b
    if b is True:
        return a
    return a & b


def select(pred: Any, on_true: Any, on_false: Any) -> Any:
    """``optax.tree.where(pred, on_true, on_false)``; ``on_true`` for the
    literal ``True``."""
    if pred is True:
        return on_true
    return optax.tree.where(pred, on_true, on_false)
