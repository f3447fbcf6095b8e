"""The gate protocol shared by :func:`optaxaccum.chain` and its gates.

A *gate* is an optax transformation that decides, on each call, whether the
transformations after it in an :func:`optaxaccum.chain` run. It is an ordinary
:class:`optax.GradientTransformationExtraArgs` (so it can be used alone or in
``optax.chain``) that also carries a ``gate_update`` function returning a
:class:`GateResult` instead of ``(updates, state)``:

* ``GateResult.state`` is the gate's new state if it stays closed;
* ``GateResult.may_open`` is a boolean scalar: whether to call ``emit``;
* ``GateResult.emit()`` is called only inside the branch of a ``lax.cond``
  taken when ``may_open`` is true. It returns ``(updates, state, opened)``:
  the updates to pass on, the gate's state in that case and a boolean scalar
  (or the Python literal ``True``) saying whether the followers run.

Work that only matters when the gate opens (dividing an accumulator by its
weight, an all-reduce across devices) belongs in ``emit`` so that it is not
executed on the calls where the gate stays closed. A gate whose ``emit`` is
free (its updates are computed anyway, as a loss scale's unscaled gradients)
says so with ``GateResult.eager``: the chain may then call ``emit`` on every
step and combine the gate with a later one (``may_open`` of both), so that a
step where the later gate stays closed still skips everything after it.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optaxaccum._src import utils

__all__ = [
    "GateResult",
    "GatedTransformation",
    "is_gate",
    "resolve",
]

NO_PARAMS_MSG = (
    "You are using a transformation that requires the current value of "
    "parameters, but you are not passing `params` when calling `update`."
)


class GateResult(NamedTuple):
    """What a gate decided on one call.

    Attributes:
      state: the gate's state to keep when it stays closed (a pytree).
      may_open: boolean scalar array: whether ``emit`` is to be called.
      emit: a function of no arguments returning ``(updates, state, opened)``
        or ``(updates, state, opened, follower_args)``; called only inside
        the ``lax.cond`` branch taken when ``may_open`` is true (unless
        ``eager``). ``opened`` is a boolean scalar (or the literal ``True``)
        telling whether the followers run; when it is false the emitted
        updates are replaced by zeros and the emitted state kept.
        ``follower_args`` (a dict) replaces extra arguments for the
        followers (a closing accumulate passes its total ``accum_weight``).
      eager: ``True`` when ``emit`` costs nothing (it returns values already
        computed) and may be called on every step; default ``False``.
    """

    state: optax.OptState
    may_open: jax.Array
    emit: Callable[[], tuple[optax.Updates, optax.OptState, Any]]
    eager: bool = False


class GateUpdateFn(Protocol):
    """Signature of a gate's ``gate_update`` function."""

    def __call__(
        self,
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> GateResult: ...


class GateFlushFn(Protocol):
    """Signature of a gate's ``gate_flush`` function (see :func:`flush`)."""

    def __call__(
        self,
        state: optax.OptState,
        params: optax.Params,
        **extra_args: Any,
    ) -> GateResult: ...


class GatedTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation that is also a gate of :func:`chain`.

    It is a :class:`optax.GradientTransformationExtraArgs` (``init``,
    ``update``) with two more attributes: ``gate_update``, returning a
    :class:`GateResult`, and ``gate_flush`` (or ``None``), which closes a
    partial window without a new gradient. Its plain ``update`` is derived
    from ``gate_update``: zeros when the gate stays closed.

    Args:
      init: the usual ``init(params) -> state``.
      gate_update: ``(updates, state, params=None, **extra_args) ->
        GateResult``.
      gate_flush: optional ``(state, params, **extra_args) -> GateResult``.
      takes_gate_passed: whether ``gate_update`` honours the keyword
        ``_gate_passed`` (a boolean scalar): when it is false the call must
        not count (the gate's state as if the call had not happened, apart
        from what an eager gate before it decided). :func:`chain` then skips
        its own selection of this gate's state, which spares a tree-sized
        temporary. Default ``False``: the chain selects the state itself.

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
        takes_gate_passed: bool = False,
    ):
        def update_fn(updates, state, params=None, **extra_args):
            return resolve(gate_update(updates, state, params, **extra_args))

        # The plain update declares what gate_update takes by name, so that
        # chains can tell a near-miss keyword (``acum_weight``) from others.
        names = utils.declared_extra_args(
            optax.GradientTransformationExtraArgs(init, gate_update)
        )
        update_fn = utils.with_signature(update_fn, names)
        self = super().__new__(cls, init, update_fn)
        self.gate_update = gate_update
        self.gate_flush = gate_flush
        self.takes_gate_passed = takes_gate_passed
        return self

    def __getnewargs__(self):
        # copy/deepcopy/pickle rebuild through __new__ with these arguments.
        return (
            self.init, self.gate_update, self.gate_flush,
            self.takes_gate_passed,
        )


def _flatten_gate(tx: GatedTransformation):
    return (tx.init, tx.update), (
        tx.gate_update, tx.gate_flush, tx.takes_gate_passed
    )


def _unflatten_gate(aux, children) -> GatedTransformation:
    init, _ = children  # update is derived from gate_update again
    return GatedTransformation(init, *aux)


# A NamedTuple subclass would otherwise be rebuilt by jax.tree functions as
# GatedTransformation(init, update), losing gate_update.
jax.tree_util.register_pytree_node(
    GatedTransformation, _flatten_gate, _unflatten_gate
)


def is_gate(tx: Any) -> bool:
    """Whether ``tx`` is a gate (a :class:`GatedTransformation`)."""
    return isinstance(tx, GatedTransformation)


def zeros_of(shapes: Any) -> Any:
    """Zeros with the shapes and dtypes of a tree of ``ShapeDtypeStruct``."""
    # zeros_like keeps the sharding and the device-varying type of each
    # ShapeDtypeStruct, so both branches of a lax.cond agree on them.
    return jax.tree.map(jnp.zeros_like, shapes)


def cond_or_call(pred: Any, true_fn: Callable, false_fn: Callable):
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
        updates, state, flag, _ = emitted(res)
        return mask(flag, updates), state

    def closed():
        return zeros_of(jax.eval_shape(opened)[0]), res.state

    return cond_or_call(res.may_open, opened, closed)


def emitted(res: GateResult) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Calls ``res.emit()``: ``(updates, state, opened, follower_args)``.

    ``emit`` may return a fourth element, a dict of extra arguments that
    replace the call's own for the followers (a closing accumulate passes
    its window's total weight as their ``accum_weight``).
    """
    out = res.emit()
    if len(out) == 3:
        return (*out, {})
    return out


def mask(flag: Any, updates: optax.Updates) -> optax.Updates:
    """``updates`` where ``flag``, else zeros (no-op for the literal True)."""
    if flag is True:  # no zeros to build (eager callers would allocate them)
        return updates
    return select(flag, updates, jax.tree.map(jnp.zeros_like, updates))


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


# ---------------------------------------------------------------- validation


def check_positive_int(name: str, value: Any) -> int:
    """Returns ``value`` as an int if it is an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be a positive int, got {name}={value!r} "
            f"of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(
            f"{name} must be a positive int (>= 1), got {name}={value!r}"
        )
    if value > jnp.iinfo(jnp.int32).max:
        raise ValueError(
            f"{name} must fit in int32 (<= 2**31 - 1), got {name}={value!r}"
        )
    return int(value)


def check_real(name: str, value: Any) -> float:
    """Returns ``value`` as a float if it is a real number (not a bool)."""
    is_scalar_array = (
        hasattr(value, "dtype")
        and jnp.ndim(value) == 0
        and jnp.issubdtype(value.dtype, jnp.number)
        and not jnp.issubdtype(value.dtype, jnp.complexfloating)
    )
    if isinstance(value, bool) or not (
        isinstance(value, numbers.Real) or is_scalar_array
    ):
        raise TypeError(
            f"{name} must be a real number, got {name}={value!r} "
            f"of type {type(value).__name__}"
        )
    return float(value)


def check_float_dtype(name: str, value: Any) -> jnp.dtype:
    """Returns ``jnp.dtype(value)`` if it is a floating dtype."""
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(
            f"{name} must be a floating dtype, got {name}={value!r}"
        ) from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{name} must be a floating dtype (e.g. jnp.float32), "
            f"got {name}={value!r}"
        )
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        raise ValueError(
            f"{name}={value!r} needs 64-bit mode "
            "(jax.config.update('jax_enable_x64', True)); without it JAX "
            "would silently use float32"
        )
    return dtype


def check_same_structure(
    what: str, tree: Any, reference: Any, reference_what: str
) -> None:
    """Raises ``ValueError`` naming both structures if they differ."""
    got = jax.tree.structure(tree)
    want = jax.tree.structure(reference)
    if got != want:
        raise ValueError(
            f"The tree structure of {what} does not match that of "
            f"{reference_what}.\n  {what}: {got}\n  {reference_what}: {want}"
        )
    paths = jax.tree_util.tree_flatten_with_path(reference)[0]
    for (path, ref), leaf in zip(paths, jax.tree.leaves(tree), strict=True):
        if jnp.shape(leaf) != jnp.shape(ref):
            raise ValueError(
                f"{what} at {jax.tree_util.keystr(path)} has shape "
                f"{jnp.shape(leaf)}, but {reference_what} has shape "
                f"{jnp.shape(ref)}"
            )


def all_finite(tree: Any) -> jax.Array:
    """Boolean scalar: whether every element of every leaf is finite."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()
