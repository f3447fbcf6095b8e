"""Numbers and dtypes: the dtype to compute in, a value known now,
finiteness and peaks of a tree, a guarded division.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FAN_IN",
    "all_finite",
    "all_true",
    "concrete",
    "divide_or",
    "peaks",
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
      >>> from optaxaccum._src.numerics import widen
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
      >>> from optaxaccum._src.numerics import concrete
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


def divide_or(x: Any, y: Any, ok: Any = None, otherwise: Any = 0) -> Any:
    """``x / y`` where ``ok`` (default ``y != 0``), else ``otherwise``; the
    division never sees the excluded ``y`` (no NaN in a gradient of it).

    Example:
      >>> import jax.numpy as jnp
      >>> from optaxaccum._src.numerics import divide_or
      >>> divide_or(jnp.array([1.0, 1.0]), jnp.array([2.0, 0.0]))
      Array([0.5, 0. ], dtype=float32)
    """
    ok = y != 0 if ok is None else ok
    return jnp.where(ok, x / jnp.where(ok, y, 1), otherwise)
