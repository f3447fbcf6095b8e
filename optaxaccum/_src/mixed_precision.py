"""``oa.mixed_precision_dot_general``: low-precision products, float32
weight gradients straight out of the GEMM.

Casting float32 master weights to bfloat16 in the model (``dtype=bfloat16``)
makes JAX transpose the cast too: the weight gradient is computed by a
bfloat16 GEMM, rounded to bfloat16 and converted back to float32 before it
reaches the accumulator, a pass of its own per weight and micro-step. The
dot below casts inside a ``jax.custom_vjp`` whose backward asks each
operand's cotangent GEMM for its accumulation dtype (float32) directly, so
XLA:GPU can make the window's accumulation that GEMM's epilogue.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from optaxaccum._src import checks, numerics


class _Operand(NamedTuple):
    dtype: np.dtype
    ndim: int
    sharding: NamedSharding | None  # of its type, on an explicit mesh


class _Static(NamedTuple):
    """A call's static configuration (``nondiff_argnums``)."""

    dims: tuple  # ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))
    precision: Any
    compute: np.dtype  # both operands' dtype in the GEMMs
    accum: np.dtype  # every GEMM's output (its accumulation dtype)
    out: np.dtype  # the forward's result dtype
    out_sharding: Any
    lhs: _Operand
    rhs: _Operand


def _dims(dimension_numbers: Any) -> tuple:
    """``dimension_numbers`` as tuples of ints (flax passes lists too)."""
    (lc, rc), (lb, rb) = dimension_numbers
    axes = lambda s: tuple(operator.index(a) for a in s)  # noqa: E731
    return ((axes(lc), axes(rc)), (axes(lb), axes(rb)))


def _wider(a: np.dtype, b: np.dtype) -> np.dtype:
    """The wider floating dtype of ``a`` and ``b`` (float32 for bfloat16
    with float16), as ``jnp.promote_types`` but under strict promotion."""
    if a == b:
        return a
    bits_a, bits_b = jnp.finfo(a).bits, jnp.finfo(b).bits
    if bits_a == bits_b:
        return numerics.widen(a, jnp.float32)
    return a if bits_a > bits_b else b


def _operand(name: str, x: jax.Array) -> _Operand:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"mixed_precision_dot_general takes floating operands, got "
            f"{name}.dtype={x.dtype} (jax.lax.dot_general computes integer "
            "and complex products)"
        )
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        sharding = None
    return _Operand(jnp.dtype(x.dtype), x.ndim, sharding)


def _vma(x: jax.Array) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (else empty;
    ``manual_axis_type.varying`` on jax 0.10 to 0.12)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def _same_variance(lhs: jax.Array, rhs: jax.Array) -> tuple:
    """Both operands varying over the mesh axes either varies over (inside
    ``shard_map``), as ``jax.lax.dot_general`` casts them itself: the cast's
    transpose sums the invariant operand's cotangent over those axes,
    outside the custom VJP, whose cotangents then have their operands'
    types."""
    axes = _vma(lhs) | _vma(rhs)

    def vary(x):
        missing = tuple(sorted(axes - _vma(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return vary(lhs), vary(rhs)


def _kept(ndim: int, contract: Sequence[int], batch: Sequence[int]):
    """An operand's axes that are neither contracted nor batched, in
    order: in the product they follow the batch axes, the lhs's first."""
    return tuple(a for a in range(ndim) if a not in (*contract, *batch))


def _cotangent(g: jax.Array, other: jax.Array, static: _Static, side: int):
    """The cotangent of operand ``side`` (0: lhs, 1: rhs).

    A GEMM of the output cotangent ``g`` (cast to the compute dtype) with
    the other operand's compute-dtype copy, whose output is the
    accumulation dtype: it contracts ``g``'s axes that came from the other
    operand with that operand's kept axes, and batches the batch axes. Its
    output holds the batch axes, this operand's kept axes, then the other
    operand's contracting axes in increasing order, each standing for the
    contracting axis of this operand it was paired with; a transpose puts
    them in this operand's order (XLA folds it into the GEMM's layout).
    """
    (contract, batch), nb = static.dims, len(static.dims[1][0])
    own, oth = (static.lhs, static.rhs)[side], (static.rhs, static.lhs)[side]
    own_k = _kept(own.ndim, contract[side], batch[side])
    oth_k = _kept(oth.ndim, contract[1 - side], batch[1 - side])
    start = nb + len(own_k) if side == 0 else nb  # g: batch, lhs's, rhs's
    dims = (
        (tuple(range(start, start + len(oth_k))), oth_k),
        (tuple(range(nb)), batch[1 - side]),
    )
    paired = np.argsort(contract[1 - side], kind="stable")
    labels = (*batch[side], *own_k, *(contract[side][i] for i in paired))
    out_sharding = None
    if own.sharding is not None:
        out_sharding = _cotangent_sharding(own, labels)
    product = _gemm(g.astype(static.compute), other, dims, static, out_sharding)
    order = tuple(int(i) for i in np.argsort(labels, kind="stable"))
    grad = jax.lax.transpose(product, order)
    return grad if grad.dtype == own.dtype else grad.astype(own.dtype)


def _cotangent_sharding(own: _Operand, labels: tuple) -> NamedSharding:
    """The sharding of a cotangent GEMM's output whose axes are the
    operand's ``labels``: the operand's own, each axis in its place, and
    unreduced where the operand is reduced (and the reverse), as JAX types
    a cotangent."""
    spec = own.sharding.spec  # type: ignore[union-attr]
    parts = (*spec.partitions, *(None,) * own.ndim)
    ct_spec = spec.update(
        partitions=tuple(parts[a] for a in labels),
        unreduced=spec.reduced,
        reduced=spec.unreduced,
    )
    return own.sharding.update(spec=ct_spec)  # type: ignore[union-attr]


def _gemm(a, b, dims, static: _Static, out_sharding) -> jax.Array:
    """``dot_general(a, b)`` of the compute-dtype operands with an output of
    the accumulation dtype.

    XLA:CPU (jaxlib 0.10.2) has no kernel for a bfloat16 x bfloat16 ->
    float32 dot in some layouts (``Unsupported element type for
    DotThunk``): there the operands are converted to the accumulation dtype
    first. The products are the same (a product of two bfloat16 or float16
    values is exact in float32) and so is their float32 accumulation.
    """
    dot = functools.partial(
        jax.lax.dot_general,
        dimension_numbers=dims,
        precision=static.precision,
        preferred_element_type=static.accum,
        out_sharding=out_sharding,
    )
    if a.dtype == static.accum and b.dtype == static.accum:
        return dot(a, b)
    wide = lambda a, b: dot(a.astype(static.accum), b.astype(static.accum))  # noqa: E731
    return jax.lax.platform_dependent(a, b, cpu=wide, default=dot)


def _product(lhs: jax.Array, rhs: jax.Array, static: _Static) -> jax.Array:
    out = _gemm(lhs, rhs, static.dims, static, static.out_sharding)
    return out if out.dtype == static.out else out.astype(static.out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mixed_dot(static: _Static, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    return _product(
        lhs.astype(static.compute), rhs.astype(static.compute), static
    )


def _mixed_dot_fwd(static, lhs, rhs):
    lhs, rhs = lhs.astype(static.compute), rhs.astype(static.compute)
    return _product(lhs, rhs, static), (lhs, rhs)


def _mixed_dot_bwd(static, residuals, g):
    lhs, rhs = residuals
    return _cotangent(g, rhs, static, 0), _cotangent(g, lhs, static, 1)


_mixed_dot.defvjp(_mixed_dot_fwd, _mixed_dot_bwd)


def mixed_precision_dot_general(
    compute_dtype: Any = jnp.bfloat16,
) -> Callable[..., jax.Array]:
    """A ``dot_general`` that multiplies in ``compute_dtype`` and returns
    float32 gradients straight out of the GEMMs.

    The returned function has :func:`jax.lax.dot_general`'s signature. It
    casts both operands to ``compute_dtype``, accumulates the products in
    float32 (or ``compute_dtype`` if wider) and returns
    ``preferred_element_type``, by default the wider of the operands'
    dtypes. Its VJP computes each operand's cotangent with a GEMM of the
    ``compute_dtype`` copies whose output is float32 (then the operand's
    dtype): a float32 weight's gradient is never rounded to
    ``compute_dtype``, and XLA:GPU can make the window's accumulation
    (:func:`accumulate`) the epilogue of that GEMM. With
    ``compute_dtype=jnp.float32`` it is :func:`jax.lax.dot_general`.

    Pass it as ``dot_general=`` to ``flax.linen.Dense``/``DenseGeneral`` or
    ``flax.nnx.Linear``/``LinearGeneral`` with their ``dtype`` left
    ``None``, so that float32 master weights reach it uncast (docs/gpu.md,
    "Mixed precision"). It works under ``jit``, ``vmap``, ``grad``,
    :func:`microbatched_value_and_grad`, ``shard_map``, ``pmap`` and on
    explicit meshes (each cotangent keeps its operand's sharding).

    Args:
      compute_dtype: the floating dtype of both operands in the GEMMs.

    Returns:
      ``dot_general(lhs, rhs, dimension_numbers, precision=None,
      preferred_element_type=None, *, out_sharding=None)`` of floating
      operands, of the same or different dtypes (an integer or complex
      one raises a ``TypeError``: :func:`jax.lax.dot_general` is for those).

    Raises:
      TypeError: ``compute_dtype`` is not a dtype.
      ValueError: ``compute_dtype`` is not a floating dtype.

    Examples:
      >>> import jax, jax.numpy as jnp, optaxaccum as oa
      >>> dot = oa.mixed_precision_dot_general(jnp.bfloat16)
      >>> x, w = jnp.ones((8, 4)), jnp.full((4, 3), 0.1)
      >>> dims = (((1,), (0,)), ((), ()))
      >>> dot(x, w, dims).dtype
      dtype('float32')
      >>> dw = jax.grad(lambda w: dot(x, w, dims).sum())(w)
      >>> dw.dtype, float(dw[0, 0])
      (dtype('float32'), 8.0)
    """
    compute = checks.check_float_dtype("compute_dtype", compute_dtype)
    accum = numerics.widen(compute, jnp.float32)

    def dot_general(
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        *,
        out_sharding: Any = None,
    ) -> jax.Array:
        a, b = _same_variance(jnp.asarray(lhs), jnp.asarray(rhs))
        ops = _operand("lhs", a), _operand("rhs", b)
        if preferred_element_type is None:
            out = _wider(ops[0].dtype, ops[1].dtype)
        else:
            out = checks.check_float_dtype(
                "preferred_element_type",
                preferred_element_type,
                wrong_kind=TypeError,
            )
        static = _Static(
            _dims(dimension_numbers),
            precision,
            compute,
            accum,
            out,
            out_sharding,
            *ops,
        )
        return _mixed_dot(static, a, b)

    return dot_general
