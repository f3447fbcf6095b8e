"""Argument checks: each raises a ``TypeError`` or ``ValueError`` naming the
argument and its value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optaxaccum._src import numerics

__all__ = [
    "NO_PARAMS_MSG",
    "axis_names",
    "check_axis_name",
    "check_bool",
    "check_callable",
    "check_float_dtype",
    "check_positive_int",
    "check_real",
    "check_same_structure",
    "check_state_type",
    "check_weight",
    "wrap_indices",
]

NO_PARAMS_MSG = (
    "You are using a transformation that requires the current value of "
    "parameters, but you are not passing `params` when calling `update`."
)


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
    number = numerics.concrete(value)
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
