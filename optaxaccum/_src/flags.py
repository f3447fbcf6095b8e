"""Flags and the control flow they decide.

A *flag* is a boolean scalar array or the literal ``True`` (known: no
conditional or select is built for it). These helpers combine flags,
select trees on them, and build a conditional, a select or the gate's
loop only where the flag is traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.extend import core as jcore

__all__ = [
    "GATE_LOOP",
    "both",
    "cond_or_call",
    "either",
    "flag_like",
    "loop_or_call",
    "mask",
    "ordered_after",
    "ordered_after_scalars",
    "select",
    "select_or_call",
    "zeros_of",
]


def either(a: Any, b: Any) -> Any:
    """``a | b`` for flags, keeping the literals ``True`` and ``False``."""
    if a is True or b is False:
        return a
    if a is False:
        return b
    return a | b


def both(a: Any, b: Any) -> Any:
    """``a & b`` for flags, keeping the literal ``True``."""
    if a is True:
        return b
    if b is True:
        return a
    return a & b


def flag_like(flag: Any, like: Any) -> Any:
    """``flag`` (a flag or a Python bool) as a boolean array of the type of
    the flag ``like`` (device-varying where it is): what one branch of a
    ``lax.cond`` returns where the other returns a flag like ``like``."""
    return jnp.logical_and(like, False) | flag


def select(pred: Any, on_true: Any, on_false: Any) -> Any:
    """``optax.tree.where(pred, on_true, on_false)``; ``on_true`` for the
    literal ``True``."""
    if pred is True:
        return on_true
    return optax.tree.where(pred, on_true, on_false)


def mask(flag: Any, updates: Any) -> Any:
    """``updates`` where ``flag``, else zeros (no-op for the literal True)."""
    if flag is True:  # no zeros to build (un-jitted callers would pay)
        return updates
    return select(flag, updates, jax.tree.map(jnp.zeros_like, updates))


def zeros_of(shapes: Any) -> Any:
    """Zeros with the shapes and dtypes of a tree of ``ShapeDtypeStruct``."""
    # zeros_like keeps the sharding and the device-varying type of each
    # ShapeDtypeStruct, so both branches of a lax.cond agree on them.
    return jax.tree.map(jnp.zeros_like, shapes)


def _barrier(tree: Any) -> Any:
    """``tree`` with each leaf through its own ``lax.optimization_barrier``.

    One barrier per leaf: an output the caller does not use is dropped with
    its barrier (a barrier over a group keeps every member alive: the
    updates nnx's Optimizer discards became a tree-sized temporary on jax
    0.12), and each leaf keeps its own device-varying type under
    ``shard_map``."""
    return jax.tree.map(lax.optimization_barrier, tree)


def _kept(fn: Callable) -> Callable:
    """``fn`` with its outputs behind ``lax.optimization_barrier``."""
    return lambda: _barrier(fn())


def cond_or_call(pred: Any, true_fn: Callable, false_fn: Callable) -> Any:
    """``lax.cond(pred, true_fn, false_fn)``, or a plain call when ``pred`` is
    known now (the literal ``True``, or a concrete array outside any trace):
    then no conditional is built, which spares un-jitted callers a
    compilation of both branches on every call.

    Every gate branches here, and here only. Each branch's outputs pass
    through ``lax.optimization_barrier``: XLA:GPU's ``simplify-conditional``
    pass rewrites a two-branch conditional whose branches hold only cheap
    elementwise ops into a ``select`` that computes both branches on every
    call (the optimizer would then run on every micro-step); it leaves a
    branch holding a barrier alone. The barrier is an identity: no copy, no
    temporary, on any backend."""
    if pred is True:
        return true_fn()
    try:
        concrete = bool(pred)
    except jax.errors.ConcretizationTypeError:  # traced: decide at run time
        return lax.cond(pred, _kept(true_fn), _kept(false_fn))
    return true_fn() if concrete else false_fn()


def select_or_call(
    pred: Any, true_fn: Callable, false_fn: Callable[[Any], Any]
) -> Any:
    """``true_fn()`` where ``pred``, else ``false_fn(like)`` (``like``:
    ``true_fn``'s outputs, or their shapes, to shape its zeros): a plain
    call when ``pred`` is known now; where it is traced, both, then a
    select of each leaf.

    Decisions inside a gate's branch (a loss scale after the accumulate,
    the followers of a window that may not step) are made this way: the
    optimizer's work there runs on every window, and where it does not
    step, its old state is selected in the same elementwise pass that
    would have overwritten it, in place (a conditional whose untaken branch
    passes the old state through makes XLA copy it)."""
    if pred is True:
        return true_fn()
    try:
        concrete = bool(pred)
    except jax.errors.ConcretizationTypeError:  # traced: decide at run time
        out = true_fn()
        return select(pred, out, false_fn(out))
    return true_fn() if concrete else false_fn(jax.eval_shape(true_fn))


# The name scope of the fused step's loop of 0 or 1 trips: a reader of
# compiled programs (``op_name``) counts its body as a branch, not as code
# that runs on every call.
GATE_LOOP = "optaxaccum_gate"


def loop_or_call(
    pred: Any, true_fn: Callable, false_fn: Callable, order: Any = None
) -> Any:
    """``true_fn()`` where ``pred``, else ``false_fn()`` (a tree of
    ``true_fn``'s structure and types, made of the values ``true_fn``
    starts from): a ``lax.while_loop`` of 0 or 1 trips whose carry is
    ``false_fn()``, or a plain call when ``pred`` is known now.

    The fused step and the plain protocol's top-level gate branch here
    (nested decisions and flush use :func:`cond_or_call`). A conditional
    whose untaken branch
    passes through a value made before it (the accumulator after its add)
    makes XLA:CPU and XLA:GPU copy that value on every call unless the
    user passes compiler options; the carry of a loop is updated in place
    with no copy on XLA:CPU, XLA:GPU and XLA:TPU. ``true_fn`` closes over
    the leaves of the carry: the loop's body reads them from its carry
    instead (the loop runs at most once, so they are the same values).
    XLA:GPU keeps the loop (its ``simplify-conditional`` pass turns only
    conditionals into selects). On a mesh (``jax.set_mesh``: the
    partitioner may lay a loop's carry out otherwise than its inputs and
    reshard it on every call) and where ``pred`` varies by device (inside
    ``shard_map``) this is :func:`cond_or_call`. ``order`` (``(outputs,
    in_loop) -> outputs``, an identity in value; ``in_loop`` false where a
    conditional stands in for the loop) is applied to the loop body's
    outputs: the in-place writes it orders (:func:`ordered_after`).
    """
    if pred is True:
        return true_fn()
    try:
        concrete = bool(pred)
    except jax.errors.ConcretizationTypeError:  # traced: decide at run time
        on_mesh = not jax.sharding.get_abstract_mesh().empty
        if on_mesh or getattr(jax.typeof(pred), "vma", None):
            return cond_or_call(pred, true_fn, false_fn)
        return _loop(pred, true_fn, false_fn(), order)
    return true_fn() if concrete else false_fn()


def _loop(pred: Any, true_fn: Callable, carry: Any, order: Any) -> Any:
    """:func:`loop_or_call` of a traced ``pred``: ``true_fn`` traced once
    (``jax.make_jaxpr``), its values closed over that are leaves of
    ``carry`` read from the loop's carry."""

    def ordered(in_loop):
        return true_fn if order is None else lambda: order(true_fn(), in_loop)

    closed, shapes = jax.make_jaxpr(ordered(True), return_shape=True)()
    leaves, treedef = jax.tree.flatten(carry)
    if jax.tree.structure(shapes) != treedef:
        raise TypeError(
            "loop_or_call: true_fn must return carry's structure, got "
            f"{jax.tree.structure(shapes)} and {treedef}"
        )
    if any(
        jax.typeof(c).weak_type != out.weak_type
        for c, out in zip(leaves, jax.tree.leaves(shapes))
    ):
        # A loop would make such a state leaf strongly typed (the next call
        # would then trace again); a conditional keeps it as it came.
        return cond_or_call(pred, ordered(False), lambda: carry)
    slot = {id(x): i for i, x in enumerate(leaves)}
    consts = list(closed.consts)

    def body(state):
        values, _ = state
        args = [values[slot[id(c)]] if id(c) in slot else c for c in consts]
        out = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(closed.jaxpr, args))()
        return list(out), jnp.zeros_like(state[1])

    with jax.named_scope(GATE_LOOP):  # how readers of programs find it
        out, _ = lax.while_loop(
            lambda state: state[1], body, (leaves, jnp.asarray(pred, bool))
        )
    return jax.tree.unflatten(treedef, out)


def ordered_after(state: Any, params: Any, moments: bool = True) -> Any:
    """``state`` with its in-place writes ordered after the reads of the
    buffers they overwrite: each param-shaped tree of the optimizer's state
    (Adam's moments) after ``params`` (the new params), and each window's
    param-like sums (their fields named by the state class's
    ``_param_sums``) after both and after the window state's other float
    scalars (the noise scale's averages). Each plus a NaN-safe zero of what
    it is ordered after: an identity. Without ``moments``, only the window
    sums, after ``params`` (in a conditional's branch, where ordering the
    moments too makes XLA copy them).

    XLA:CPU's copy insertion orders an in-place write after the reads of
    the same buffer only where data flows from them: a window's zeroed
    accumulator, written over the one the optimizer and the noise scale
    read, then needs no copy; nor does a moment the new params were
    computed from. Leaves whose shape or sharding differ from ``params``'
    stay as they are."""
    treedef = jax.tree.structure(params)

    def windowed(s):
        return hasattr(type(s), "_param_sums")

    def param_like(s):
        return not windowed(s) and jax.tree.structure(s) == treedef

    def ordered_moment(s):
        if not param_like(s):
            return s
        return jax.tree.map(lambda a, p: _after(a, p, []), s, params)

    def is_leaf(s):
        return windowed(s) or param_like(s)

    trees = []
    if moments:
        state = jax.tree.map(ordered_moment, state, is_leaf=is_leaf)
        nodes = jax.tree.leaves(state, is_leaf=is_leaf)
        trees = [s for s in nodes if param_like(s)]
    token = functools.reduce(
        lambda t, s: jax.tree.map(_after_ordered, t, s), trees, params
    )

    def sums_of(s):
        if not windowed(s):
            return s
        names = type(s)._param_sums
        others = [v for k, v in s._asdict().items() if k not in names]
        scalars = _scalar_zeros(others)
        fields = {}
        for name in names:
            sums = getattr(s, name)
            if jax.tree.structure(sums) == treedef:
                sums = jax.tree.map(
                    lambda a, p: _after(a, p, scalars), sums, token
                )
            fields[name] = sums
        return s._replace(**fields)

    return jax.tree.map(sums_of, state, is_leaf=windowed)


def _after_ordered(a: Any, b: Any) -> Any:
    """``_after(a, b)`` where ``b`` was ordered itself (not weakly typed:
    ``_after`` leaves those as they are), else ``a``."""
    if jax.typeof(b).weak_type:
        return a
    return _after(a, b, [])


def ordered_after_scalars(tree: Any, after: Any) -> Any:
    """``tree`` plus the NaN-safe zeros of ``after``'s float scalars: its
    in-place writes ordered after what computed them (off a mesh; see
    :func:`ordered_after`)."""
    if not jax.sharding.get_abstract_mesh().empty:
        return tree
    zeros = _scalar_zeros(after)
    if not zeros:
        return tree
    zero = sum(zeros[1:], zeros[0])
    return jax.tree.map(lambda a: a + zero.astype(a.dtype), tree)


def _scalar_zeros(tree: Any) -> list:
    """The NaN-safe zero (``where(isfinite(x), x * 0, 0)``) of each float
    scalar leaf of ``tree``: values that depend on those leaves and add
    nothing."""
    return [
        jnp.where(jnp.isfinite(x), x * 0, 0)
        for x in jax.tree.leaves(tree)
        if jnp.ndim(x) == 0 and jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]


def _after(a: Any, p: Any, scalars: list) -> Any:
    """``a`` plus the zero of ``p`` (``where(isfinite(p), p * 0, 0)``) and
    the zeros ``scalars``, in ``a``'s dtype, where ``p`` is a float array of
    ``a``'s shape and sharding (elsewhere ``a``)."""
    p = jnp.asarray(p)
    if not jnp.issubdtype(p.dtype, jnp.inexact) or p.shape != a.shape:
        return a
    if jax.typeof(a).weak_type:  # a sum would make it strongly typed
        return a
    if _spec(a) != _spec(p):
        return a
    zero = jnp.where(jnp.isfinite(p), p * 0, 0)
    if not jnp.issubdtype(a.dtype, jnp.complexfloating):
        zero = jnp.real(zero)
    for s in scalars:
        zero = zero + s.astype(zero.dtype)
    return a + zero.astype(a.dtype)


def _spec(x: Any) -> Any:
    """The explicit sharding spec of ``x``'s type, or None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    return getattr(sharding, "spec", None)
