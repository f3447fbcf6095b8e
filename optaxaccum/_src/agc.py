"""``oa.agc``: adaptive gradient clipping (Brock et al., 2021), unit-wise."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Union

import jax
import jax.numpy as jnp
import optax

from optaxaccum._src import checks, numerics

__all__ = ["agc", "unitwise_norm"]

#: One leaf's units: ``None`` (the default rule), an int or a tuple of ints
#: (the axes a unit spans; the norm is taken over them).
AxisSpec = Union[int, tuple[int, ...], None]
#: What ``agc(axis=...)`` accepts.
AxisArg = Union[
    AxisSpec,
    Callable[[tuple[Any, ...], jax.Array], AxisSpec],
    Any,  # a pytree of ``AxisSpec`` matching (a prefix of) params
]

AGC_NO_PARAMS_MSG = (
    "oa.agc (adaptive gradient clipping) needs the current parameters: the "
    "clipping threshold of each unit is proportional to its parameter norm. "
    "Call `update(grads, state, params)`. " + checks.NO_PARAMS_MSG
)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_axes(x: Any) -> bool:
    """Whether ``x`` is an int or a tuple of ints (one leaf's axes)."""
    return _is_int(x) or (type(x) is tuple and all(_is_int(a) for a in x))


def _is_spec(x: Any) -> bool:
    """Leaf predicate for the pytree form of ``axis``: ``None`` and axes."""
    return x is None or _is_axes(x)


def _default_axes(ndim: int) -> tuple[int, ...]:
    """The default units: whole tensor up to 1-D, else all axes but the last."""
    if ndim <= 1:
        return tuple(range(ndim))
    return tuple(range(ndim - 1))


def _normalize_axes(spec: Any, shape: tuple[int, ...], where: str) -> tuple:
    """Checks one leaf's axis spec and returns non-negative, sorted axes."""
    ndim = len(shape)
    if spec is None:
        return _default_axes(ndim)
    if _is_int(spec):
        axes = (spec,)
    elif isinstance(spec, (tuple, list)) and all(_is_int(a) for a in spec):
        axes = tuple(spec)
    else:
        raise TypeError(
            f"The axis for {where} must be None, an int or a tuple of ints, "
            f"got {spec!r} of type {type(spec).__name__}"
        )
    out = checks.wrap_indices(
        axes,
        ndim,
        lambda _: (
            f"The axis {spec!r} for {where} is out of range for a leaf "
            f"of shape {shape} (ndim={ndim}); valid axes are "
            f"{-ndim}..{ndim - 1}"
        ),
    )
    if len(set(out)) != len(out):
        raise ValueError(
            f"The axis {spec!r} for {where} repeats an axis (shape {shape})"
        )
    return tuple(sorted(out))


def _unit_norm(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """L2 norms over ``axes`` (kept as size 1), in float32 or wider."""
    x = jnp.asarray(x)
    x = x.astype(numerics.widen(x.dtype))
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        sq = jnp.real(x) * jnp.real(x) + jnp.imag(x) * jnp.imag(x)
    else:
        sq = x * x
    return jnp.sqrt(jnp.sum(sq, axis=axes, keepdims=True))


def unitwise_norm(
    x: jax.typing.ArrayLike, axis: int | Sequence[int] | None = None
) -> jax.Array:
    r"""L2 norm of each unit of ``x``, as used by :func:`agc`.

    A *unit* is a slice of ``x`` spanning the axes in ``axis``; its norm is
    :math:`\|x_u\|_2 = \sqrt{\sum_{i \in u} |x_i|^2}`. With ``axis=None`` the
    units follow the usual ``(..., in, out)`` kernel layout, chosen by
    ``x.ndim`` alone (size-1 axes are not squeezed):

    * ``ndim <= 1`` (scalars, biases, scales): the whole tensor is one unit;
    * ``ndim >= 2``: one unit per index of the last axis (the output
      features), the norm taken over every other axis — ``(in, out)`` dense
      kernels, ``(W, in, out)``, ``(H, W, in, out)`` and
      ``(D, H, W, in, out)`` convolution kernels, Flax's
      ``(heads, head_dim, features)`` attention output kernels. For Flax's
      ``(features, heads, head_dim)`` query/key/value kernels a unit is one
      ``head_dim`` index across all heads; pass ``axis=0`` for those leaves
      to make each ``(head, head_dim)`` output its own unit.

    Args:
      x: an array.
      axis: the axes a unit spans (an int or a tuple of ints, negative values
        allowed, ``()`` making every element its own unit), or ``None`` for
        the default above.

    Returns:
      The norms, with the rank of ``x`` and the reduced axes kept with size 1,
      so that they broadcast against ``x``. Their dtype is float32 for
      float32 and lower-precision inputs (float64 for float64 inputs, the
      real dtype for complex ones): norms are never reduced in bf16 or fp16.

    Raises:
      TypeError: if ``axis`` is not None, an int or a tuple of ints.
      ValueError: if an axis is out of range for ``x`` or repeated.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optaxaccum as oa
      >>> w = jnp.array([[3.0, 0.0], [4.0, 0.0]])  # (in, out)
      >>> oa.unitwise_norm(w)
      Array([[5., 0.]], dtype=float32)
      >>> oa.unitwise_norm(w, axis=-1)  # (out, in) layout
      Array([[3.],
             [4.]], dtype=float32)
      >>> oa.unitwise_norm(jnp.array([3.0, 4.0], jnp.bfloat16))
      Array([5.], dtype=float32)
    """
    x = jnp.asarray(x)
    axes = _normalize_axes(axis, x.shape, "x")
    return _unit_norm(x, axes)


def _leaf_axes(
    axis: Any, params: optax.Params
) -> list[tuple[str, tuple[int, ...]]]:
    """Resolves ``axis`` to ``(path string, axes)`` for every params leaf."""
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    paths = [jax.tree_util.keystr(p) for p, _ in path_leaves]
    if axis is None or _is_axes(axis):
        specs = [axis] * len(path_leaves)
    elif callable(axis):
        specs = [axis(p, leaf) for p, leaf in path_leaves]
    else:
        spec_def = jax.tree.structure(axis, is_leaf=_is_spec)
        try:
            subtrees = spec_def.flatten_up_to(params)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "The tree structure of agc's axis does not match that of "
                "params (it must be the same, or a prefix of it; None "
                f"entries mean the default rule).\n  axis: {spec_def}\n"
                f"  params: {jax.tree.structure(params)}\n  ({e})"
            ) from None
        spec_leaves = spec_def.flatten_up_to(axis)
        specs = [
            spec
            for spec, sub in zip(spec_leaves, subtrees)
            for _ in jax.tree.leaves(sub)
        ]
    return [
        (path, _normalize_axes(spec, jnp.shape(leaf), f"params{path}"))
        for path, spec, (_, leaf) in zip(paths, specs, path_leaves)
    ]


def _check_axis_arg(axis: Any) -> None:
    """Static type check of ``agc``'s ``axis`` (ranges need the params)."""
    if axis is None or callable(axis) or _is_axes(axis):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        axis, is_leaf=_is_spec
    )[0]:
        if not _is_spec(leaf):
            raise TypeError(
                "axis must be None, an int, a tuple of ints, a callable "
                "(path, leaf) -> axes, or a pytree (matching params) of "
                "None / ints / tuples of ints; got "
                f"axis{jax.tree_util.keystr(path)}={leaf!r} of type "
                f"{type(leaf).__name__}"
            )


@functools.partial(jax.jit, static_argnames=("axes", "clipping", "eps"))
def _clip_leaf(
    g: jax.Array,
    w: jax.Array,
    *,
    axes: tuple[int, ...],
    clipping: float,
    eps: float,
) -> jax.Array:
    """Clips one gradient leaf unit-wise against its parameter leaf.

    Jitted so that eager (un-jitted) use dispatches one fused computation per
    leaf rather than a dozen small ones; inside ``jax.jit`` it is inlined.
    """
    g_norm = _unit_norm(g, axes)
    w_norm = _unit_norm(w, axes)
    # Both are float32 or float64: compare in the wider.
    real = max(g_norm.dtype, w_norm.dtype, key=lambda d: d.itemsize)
    g_norm = g_norm.astype(real)
    max_norm = clipping * jnp.maximum(w_norm.astype(real), eps)
    over = g_norm > max_norm  # false for NaN norms: those pass through
    # max_norm / g_norm where over (g_norm > 0 there), else 1 / 1. A divide
    # last, not a select: XLA then computes the scale once per unit, with
    # both norms' reductions in the same fusion (2 fusions per leaf instead
    # of 4, 30% less compile time), rather than copying the select and its
    # inputs into the consumer.
    scale = jnp.where(over, max_norm, 1.0) / jnp.where(over, g_norm, 1.0)
    compute = numerics.widen(g.dtype)
    return (g.astype(compute) * scale.astype(compute)).astype(g.dtype)


def agc(
    clipping: float = 0.01,
    eps: float = 1e-3,
    *,
    axis: AxisArg = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Adaptive gradient clipping, unit-wise (the NFNet AGC).

    Each unit :math:`u` of a gradient leaf (by default one output feature, see
    :func:`unitwise_norm`) is rescaled to a norm of at most
    :math:`\lambda \max(\|w_u\|, \epsilon)`, the matching unit of the
    parameters; units under the bound pass bit-for-bit unchanged. Norms are
    computed in float32 (or wider); updates keep the gradients' dtype. Units,
    other layouts (Equinox), excluding the classifier and the differences
    from :func:`optax.adaptive_grad_clip`: docs/concepts.md.

    Args:
      clipping: :math:`\lambda`, the largest ratio of a unit's gradient norm
        to its parameter norm; a real number > 0.
      eps: :math:`\epsilon`, the floor of the parameter norm (so that
        zero-initialised parameters can move); a real number >= 0.
      axis: the units: ``None`` (by each leaf's ``ndim``), an int or a tuple
        of axes for every leaf, a pytree (or prefix) of those matching
        ``params``, or a callable ``(path, leaf) -> None | int | tuple``.

    Returns:
      A stateless :class:`optax.GradientTransformationExtraArgs` whose
      ``update`` requires ``params``.

    Raises:
      TypeError, ValueError: for a bad argument (naming it), an axis out of
        range or not matching ``params``, or missing ``params``.

    Examples:
      >>> import jax.numpy as jnp, optax, optaxaccum as oa
      >>> params = {"w": jnp.array([[3.0, 1.0], [4.0, 0.0]])}  # norms 5, 1
      >>> grads = {"w": jnp.array([[0.5, 3.0], [1.0, 4.0]])}  # norms 1.1, 5
      >>> tx = oa.agc(clipping=0.5)
      >>> updates, _ = tx.update(grads, tx.init(params), params)
      >>> updates["w"]  # column 0 is within 0.5 * 5; column 1 cut to 0.5 * 1
      Array([[0.5, 0.3],
             [1. , 0.4]], dtype=float32)

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without
      Normalization <https://arxiv.org/abs/2102.06171>`_, 2021
    """
    clipping = checks.check_real("clipping", clipping)
    if not clipping > 0:  # also rejects NaN
        raise ValueError(f"clipping must be > 0, got clipping={clipping!r}")
    eps = checks.check_real("eps", eps)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got eps={eps!r}")
    _check_axis_arg(axis)

    def init_fn(params):
        _leaf_axes(axis, params)  # fail early on axes that do not fit
        return optax.EmptyState()

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError(AGC_NO_PARAMS_MSG)
        checks.check_same_structure("updates", updates, params, "params")
        leaf_axes = _leaf_axes(axis, params)
        g_leaves, treedef = jax.tree.flatten(updates)
        w_leaves = jax.tree.leaves(params)
        out = []
        # Leaf shapes were checked by check_same_structure.
        for g, w, (_, axes) in zip(g_leaves, w_leaves, leaf_axes):
            out.append(_clip_leaf(g, w, axes=axes, clipping=clipping, eps=eps))
        return jax.tree.unflatten(treedef, out), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
