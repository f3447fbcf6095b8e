"""Small helpers shared by the transformations: one helper per idea."""

from __future__ import annotations

import difflib
import inspect
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "check_extra_args",
    "check_weight",
    "declared_extra_args",
    "widen",
]


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


def check_weight(name: str, value: Any) -> None:
    """Raises ``ValueError`` if a concrete weight is not a finite real >= 0.

    Traced values cannot be checked here; the caller decides what a traced
    invalid weight does (see :func:`optaxaccum.accumulate`).

    Args:
      name: the argument's name, for the message.
      value: a Python or NumPy number, or an array (concrete or traced).
    """
    if isinstance(value, jax.core.Tracer):
        return
    if isinstance(value, bool | np.bool_) or (
        hasattr(value, "dtype") and jnp.dtype(value.dtype) == jnp.bool_
    ):
        raise ValueError(
            f"{name} must be a number, got a bool: {name}={value!r}"
        )
    if jnp.ndim(value) != 0:
        raise ValueError(
            f"{name} must be a scalar, got an array of shape {jnp.shape(value)}"
        )
    if isinstance(value, numbers.Integral) and abs(int(value)) > 2**31 - 1:
        raise ValueError(
            f"{name}={value!r} does not fit int32; pass it as a float"
        )
    if isinstance(value, complex) or jnp.iscomplexobj(value):
        raise ValueError(f"{name} must be real, got {name}={value!r}")
    number = float(np.asarray(value))
    if not (np.isfinite(number) and number >= 0):
        raise ValueError(
            f"{name} must be finite and >= 0, got {name}={value!r}"
        )


def declared_extra_args(tx: Any) -> frozenset[str]:
    """The extra keyword arguments an optax transformation's ``update``
    declares by name (``accum_weight``, ``value``, ...); ``**extra_args``
    catch-alls and private (``_``-prefixed) names excluded."""
    try:
        parameters = inspect.signature(tx.update).parameters.values()
    except (TypeError, ValueError):  # builtins or callables without one
        return frozenset()
    return frozenset(
        p.name
        for p in list(parameters)[3:]
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        and not p.name.startswith("_")
    )


def check_extra_args(
    extra_args: Iterable[str], declared: Iterable[str]
) -> None:
    """Raises ``TypeError`` for a keyword that no element takes but that is a
    near-miss of one an element declares (``acum_weight``)."""
    declared = sorted(declared)
    for key in extra_args:
        if key in declared or key.startswith("_"):
            continue
        close = difflib.get_close_matches(key, declared, n=1, cutoff=0.75)
        if close:
            raise TypeError(
                f"unexpected keyword argument {key!r}: no element of the "
                f"chain takes it; did you mean {close[0]!r}?"
            )


def with_signature(fn: Callable, names: Iterable[str]) -> Callable:
    """Gives an ``update(updates, state, params=None, **extra_args)`` function
    a signature that declares ``names`` as keyword-only arguments, so that
    :func:`declared_extra_args` (and ``inspect``) see them."""
    p = inspect.Parameter
    params = [
        p("updates", p.POSITIONAL_OR_KEYWORD),
        p("state", p.POSITIONAL_OR_KEYWORD),
        p("params", p.POSITIONAL_OR_KEYWORD, default=None),
        *(p(n, p.KEYWORD_ONLY, default=None) for n in sorted(names)),
        p("extra_args", p.VAR_KEYWORD),
    ]
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return fn
