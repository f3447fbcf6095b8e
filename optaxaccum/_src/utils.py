"""Small helpers shared by the transformations: one helper per idea."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jcore

__all__ = [
    "NO_PARAMS_MSG",
    "all_finite",
    "all_true",
    "axis_names",
    "check_axis_name",
    "check_bool",
    "check_callable",
    "check_extra_args",
    "check_float_dtype",
    "check_positive_int",
    "check_real",
    "check_same_structure",
    "check_state_type",
    "check_weight",
    "concrete",
    "cond_or_call",
    "loop_or_call",
    "ordered_after",
    "select_or_call",
    "declared_extra_args",
    "divide_or",
    "either",
    "both",
    "mask",
    "optax_has_updated",
    "peaks",
    "select",
    "wrap_indices",
    "zeros_of",
    "find_state",
    "widen",
]

NO_PARAMS_MSG = (
    "You are using a transformation that requires the current value of "
    "parameters, but you are not passing `params` when calling `update`."
)


def widen(dtype: Any, at_least: Any = jnp.float32) -> np.dtype:
    """The dtype to compute or accumulate ``dtype`` in: at least the float
    precision of ``at_least``; complex stays complex (of that precision).

    Written out rather than ``jnp.promote_types``, which raises under
    ``jax.numpy_dtype_promotion("strict")``.

    Args:
      dtype: the dtype of the values (a gradient leaf, an input).
      at_least: a floating dtype, the least precision wanted.

    Returns:
      ``dtype`` if it is floating (or complex) and at least as wide as
      ``at_least``, else the floating (or complex) dtype of ``at_least``'s
      width.

    Example:
      >>> import jax.numpy as jnp
      >>> from optaxaccum._src.utils import widen
      >>> widen(jnp.bfloat16), widen(jnp.complex64, jnp.float32)
      (dtype('float32'), dtype('complex64'))
    """
    dtype, floor = jnp.dtype(dtype), jnp.dtype(at_least)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        bits = max(jnp.finfo(dtype).bits, jnp.finfo(floor).bits)
        return jnp.dtype(jnp.complex128 if bits > 32 else jnp.complex64)
    if jnp.issubdtype(dtype, jnp.floating) and (
        jnp.finfo(dtype).bits >= jnp.finfo(floor).bits
    ):
        return dtype
    return floor


def concrete(value: Any, dtype: Any = None) -> np.ndarray | None:
    """``value`` as a NumPy array if it is known now, ``None`` if it is
    traced (inside ``jax.jit``, ``vmap``, ``grad``...).

    Args:
      value: a Python or NumPy number, or an array (concrete or traced).
      dtype: optional NumPy dtype to convert to.

    Returns:
      ``np.asarray(value, dtype)``, or ``None`` for a traced value.

    Example:
      >>> import jax.numpy as jnp
      >>> from optaxaccum._src.utils import concrete
      >>> concrete(jnp.ones(2))
      array([1., 1.], dtype=float32)
    """
    try:
        return np.asarray(value, dtype)
    except (
        jax.errors.TracerArrayConversionError,
        jax.errors.ConcretizationTypeError,
    ):
        return None


def check_weight(name: str, value: Any) -> None:
    """Raises ``ValueError`` if a concrete weight is not a finite real >= 0
    (``TypeError`` if it is not a number at all, e.g. a string).

    Traced values cannot be checked here; the caller decides what a traced
    invalid weight does (see :func:`optaxaccum.accumulate`).

    Args:
      name: the argument's name, for the message.
      value: a Python or NumPy number, or an array (concrete or traced).
    """
    if type(value) is float and math.isfinite(value) and value >= 0:
        return  # a Python float that is fine (the default weight, 1.0)
    number = concrete(value)
    if number is None:  # traced: decided later
        return
    if number.dtype == np.bool_:
        raise ValueError(
            f"{name} must be a number, got a bool: {name}={value!r}"
        )
    if not np.issubdtype(number.dtype, np.number):
        raise TypeError(
            f"{name} must be a number, got {name}={value!r} of type "
            f"{type(value).__name__}"
        )
    if number.ndim != 0:
        raise ValueError(
            f"{name} must be a scalar, got an array of shape {number.shape}"
        )
    if isinstance(value, numbers.Integral) and abs(int(value)) > 2**31 - 1:
        raise ValueError(
            f"{name}={value!r} does not fit int32; pass it as a float"
        )
    if np.iscomplexobj(number):
        raise ValueError(f"{name} must be real, got {name}={value!r}")
    if not (np.isfinite(number) and number >= 0):
        raise ValueError(
            f"{name} must be finite and >= 0, got {name}={value!r}"
        )


def keywords(fn: Any, skip: int = 3) -> frozenset[str]:
    """The keyword parameters of ``fn`` (or of a transformation's
    ``update``) after the first ``skip``, ``**`` catch-alls and
    ``_``-prefixed names excluded."""
    fn = getattr(fn, "update", fn)
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins or callables without one
        return frozenset()
    return frozenset(
        p.name
        for p in list(parameters)[skip:]
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        and not p.name.startswith("_")
    )


def declared_extra_args(fn: Any, skip: int = 3) -> frozenset[str]:
    """The extra keyword arguments a function declares by name.

    Args:
      fn: an ``update``-like function, or an optax transformation (its
        ``update`` is read).
      skip: how many leading parameters are not extra arguments
        (``updates, state, params``).

    Returns:
      The names of its keyword parameters after the first ``skip``
      (``accum_weight``, ``value``, ...); ``**extra_args`` catch-alls,
      and private (``_``-prefixed) names excluded.
    """
    return keywords(fn, skip)


def check_extra_args(
    extra_args: Iterable[str],
    declared: Iterable[str],
    where: str = "no element of the chain takes it",
) -> None:
    """Raises ``TypeError`` for a keyword that is not declared but is a
    near-miss of one that is (``acum_weight`` for ``accum_weight``, or its
    last word: ``weight``).

    Args:
      extra_args: the keywords given.
      declared: the keywords the receivers declare.
      where: why the keyword is unexpected, for the message.
    """
    declared = sorted(declared)
    for key in extra_args:
        if key in declared or key.startswith("_"):
            continue
        # A misspelling, or a declared name's last word (``weight`` for
        # ``accum_weight``).
        close = difflib.get_close_matches(key, declared, n=1, cutoff=0.75)
        close = close or [d for d in declared if d.endswith(f"_{key}")]
        if close:
            raise TypeError(
                f"unexpected keyword argument {key!r}: {where}; "
                f"did you mean {close[0]!r}?"
            )


def with_signature(
    fn: Callable, names: Iterable[str], gate: bool = False
) -> Callable:
    """Gives an ``update(updates, state, params=None, **extra_args)`` function
    (with ``gate``: a ``gate_update(updates, state, params, ctx,
    **extra_args)``) a signature that declares ``names`` as keyword-only
    arguments, so that :func:`declared_extra_args` (and ``inspect``) see
    them."""
    p = inspect.Parameter
    leading = [
        p("updates", p.POSITIONAL_OR_KEYWORD),
        p("state", p.POSITIONAL_OR_KEYWORD),
        p("params", p.POSITIONAL_OR_KEYWORD, default=None),
    ]
    if gate:
        leading[2] = p("params", p.POSITIONAL_OR_KEYWORD)
        leading.append(p("ctx", p.POSITIONAL_OR_KEYWORD))
    names = set(names) | keywords(fn, len(leading))  # and its own keywords
    params = [
        *leading,
        *(p(n, p.KEYWORD_ONLY, default=None) for n in sorted(names)),
        p("extra_args", p.VAR_KEYWORD),
    ]
    fn.__dict__["__signature__"] = inspect.Signature(params)
    return fn


def check_positive_int(name: str, value: Any) -> int:
    """Returns ``value`` as an int if it is an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be a positive int, got {name}={value!r} "
            f"of type {type(value).__name__}"
        )
    if int(value) < 1:
        raise ValueError(
            f"{name} must be a positive int (>= 1), got {name}={value!r}"
        )
    if int(value) > jnp.iinfo(jnp.int32).max:
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


def check_float_dtype(
    name: str,
    value: Any,
    *,
    complex_ok: bool = False,
    wrong_kind: type[Exception] = ValueError,
) -> jnp.dtype:
    """Returns ``jnp.dtype(value)`` if it is a floating dtype (or a complex
    one, with ``complex_ok``); a dtype of another kind raises
    ``wrong_kind``."""
    kind = "floating or complex" if complex_ok else "floating"
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(
            f"{name} must be a {kind} dtype, got {name}={value!r}"
        ) from e
    ok = jnp.issubdtype(dtype, jnp.floating) or (
        complex_ok and jnp.issubdtype(dtype, jnp.complexfloating)
    )
    if not ok:
        raise wrong_kind(
            f"{name} must be a {kind} dtype (e.g. jnp.float32), "
            f"got {name}={value!r}"
        )
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
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
    return all_true([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])


def peaks(tree: Any, factor: Any = None, dtypes: Any = None) -> list:
    """The largest magnitude of each inexact, non-empty leaf of ``tree``
    (a complex leaf's real and imaginary parts apart), times ``factor`` and
    cast to the leaf's dtype in ``dtypes`` if given: the peaks of
    ``factor * tree`` as those dtypes, since rounding is monotonic and NaN
    propagates through the maximum. A reduce of the leaves themselves: it
    fuses with no producer (a second reader of one keeps it in memory)."""
    leaves = jax.tree.leaves(tree)
    kinds = jax.tree.leaves(dtypes) if dtypes is not None else leaves
    out = []
    for g, d in zip(leaves, kinds, strict=True):
        g = jnp.asarray(g)
        if not jnp.issubdtype(g.dtype, jnp.inexact) or g.size == 0:
            continue
        parts = (g.real, g.imag) if jnp.iscomplexobj(g) else (g,)
        for part in parts:
            peak = jnp.max(jnp.abs(part))
            if factor is not None:
                peak = peak * jnp.abs(jnp.asarray(factor, peak.dtype))
            dtype = jnp.result_type(d)
            if jnp.issubdtype(dtype, jnp.complexfloating):
                dtype = jnp.finfo(dtype).dtype
            out.append(peak.astype(dtype))
    return out


#: Largest number of flags combined by one node of all_true.
FAN_IN = 32


def all_true(flags: Sequence[Any]) -> jax.Array:
    """Whether every boolean scalar in ``flags`` is true (a boolean scalar).

    Compile time, not run time, shapes this: the flags (one per gradient
    leaf) are combined in a tree of fan-in :data:`FAN_IN` whose nodes are
    sorts, an operation XLA neither fuses nor duplicates. A ``jnp.stack`` of
    them all builds one fusion with an operand per leaf, which XLA compiles
    in time quadratic in the number of operands (20 s for 1 000 leaves on
    CPU), and elementwise nodes are merged back into one such fusion, or
    copied into every consumer of the result. A false flag becomes NaN,
    which a sort puts last.
    """
    if not flags:
        return jnp.array(True)
    nans = [jnp.where(f, 0.0, jnp.nan).astype(jnp.float32) for f in flags]
    while len(nans) > 1:
        chunks = [nans[i : i + FAN_IN] for i in range(0, len(nans), FAN_IN)]
        nans = [jnp.sort(jnp.stack(c))[-1] for c in chunks]
    return ~jnp.isnan(nans[0])


def check_bool(name: str, value: Any) -> bool:
    """Returns ``value`` if it is a bool, else raises ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {name}={value!r}")
    return value


def check_callable(name: str, value: Any, *, none_ok: bool = False) -> Any:
    """Returns ``value`` if it is callable (or ``None``, with ``none_ok``),
    else raises ``TypeError`` naming ``name``."""
    if none_ok and value is None:
        return value
    if not callable(value):
        allowed = "callable or None" if none_ok else "callable"
        raise TypeError(f"{name} must be {allowed}, got {name}={value!r}")
    return value


def axis_names(axis_name: Any) -> tuple[Hashable, ...]:
    """``axis_name`` (one mesh axis name or a non-empty tuple of them) as a
    tuple; ``TypeError`` for anything else (``None``, ``()``, a list)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or any(
        n is None or not isinstance(n, Hashable) for n in names
    ):
        raise TypeError(
            "axis_name must be a mesh axis name or a non-empty tuple of "
            f"them, got {axis_name=!r}"
        )
    return names


def check_axis_name(value: Any) -> Any:
    """Returns ``axis_name`` if it is ``None`` or what :func:`axis_names`
    accepts."""
    if value is not None:
        axis_names(value)
    return value


def check_state_type(
    state: Any, cls: type, caller: str, what: str = "", hint: str = ""
) -> None:
    """Raises ``TypeError`` (``"{caller} expects a {what}, got ..."``) if
    ``state`` is not an instance of ``cls``.

    Args:
      state: the state given to an ``update``.
      cls: the state class it must be.
      caller: the transformation, for the message (``"oa.accumulate"``).
      what: how the message names ``cls`` (default: its name).
      hint: appended to the message (e.g. how to convert a state).
    """
    if isinstance(state, cls):
        return
    what = what or cls.__name__
    article = "an" if what[0].lower() in "aeiou" else "a"
    raise TypeError(
        f"{caller} expects {article} {what}, got {type(state).__name__}{hint}"
    )


def find_state(
    state: Any,
    kind: type | tuple[type, ...] | Callable[[Any], bool],
    caller: str,
    names: str = "",
) -> Any:
    """The first (outermost, leftmost) node of ``state`` of ``kind``.

    Args:
      state: a (nested) optimizer state.
      kind: a class, a tuple of classes, or a predicate of a node.
      caller: the function asking, for the message.
      names: what the message calls the nodes sought (default: the names
        of the classes of ``kind``).

    Returns:
      The first node found, in ``jax.tree.leaves`` order.

    Raises:
      ValueError: naming ``caller`` if there is none.
    """
    if isinstance(kind, (type, tuple)):
        classes = kind if isinstance(kind, tuple) else (kind,)
        names = names or " or ".join(c.__name__ for c in classes)
        match = lambda x: isinstance(x, classes)  # noqa: E731
    else:
        match = kind
    for node in jax.tree.leaves(state, is_leaf=match):
        if match(node):
            return node
    raise ValueError(
        f"{caller} found no {names} in the state given "
        f"({jax.tree.structure(state)})"
    )


def optax_has_updated(mini_step: Any, gradient_step: Any) -> jax.Array:
    """optax's ``MultiSteps.has_updated`` rule, for states without an
    ``updated`` flag: the window position is 0 after at least one step."""
    return (jnp.asarray(mini_step) == 0) & (jnp.asarray(gradient_step) > 0)


def divide_or(x: Any, y: Any, ok: Any = None, otherwise: Any = 0) -> Any:
    """``x / y`` where ``ok`` (default ``y != 0``), else ``otherwise``; the
    division never sees the excluded ``y`` (no NaN in a gradient of it).

    Example:
      >>> import jax.numpy as jnp
      >>> from optaxaccum._src.utils import divide_or
      >>> divide_or(jnp.array([1.0, 1.0]), jnp.array([2.0, 0.0]))
      Array([0.5, 0. ], dtype=float32)
    """
    ok = y != 0 if ok is None else ok
    return jnp.where(ok, x / jnp.where(ok, y, 1), otherwise)


def wrap_indices(
    indices: Iterable[int], size: int, out_of_range: Callable[[int], str]
) -> tuple[int, ...]:
    """``indices`` in ``range(size)``, negative ones counted from the end;
    ``ValueError(out_of_range(i))`` for the first ``i`` outside
    ``[-size, size)``."""
    out = []
    for i in indices:
        if not -size <= i < size:
            raise ValueError(out_of_range(i))
        out.append(int(i) % size)
    return tuple(out)


# ------------------------------------------------------------ flags
# A *flag* is a boolean scalar array or the literal ``True`` (known: no
# conditional or select is built for it).


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
