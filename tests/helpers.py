"""Setups shared by the test modules: parameter and gradient trees.

Each builder draws from NumPy's generator in a fixed order, so a test that
builds the same tree twice gets the same values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _generator(seed):
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed)


def normal_tree(seed, shapes: Mapping, dtype=jnp.float32, scale=1.0) -> dict:
    """A tree of normal draws, leaf by leaf in the order of ``shapes``.

    Args:
      seed: the seed of ``np.random.default_rng``, or a generator to draw
        from (the draws continue its stream).
      shapes: name -> shape (a tuple), array (its shape and dtype are
        taken), or a nested mapping of these.
      dtype: the dtype of the leaves given by a shape.
      scale: each draw's factor, one number or name -> number.

    Returns:
      A dict shaped as ``shapes``: ``jnp.asarray(draw * factor, dtype)``
      per leaf.

    Example::

        params = normal_tree(0, {"w": (5, 3), "b": (3,)}, scale={"b": 0.1})
    """
    rng = _generator(seed)
    out = {}
    for name, shape in shapes.items():
        factor = scale.get(name, 1.0) if isinstance(scale, Mapping) else scale
        if isinstance(shape, Mapping):
            out[name] = normal_tree(rng, shape, dtype, factor)
        elif hasattr(shape, "dtype"):
            draw = rng.normal(size=shape.shape) * factor
            out[name] = jnp.asarray(draw, shape.dtype)
        else:
            out[name] = jnp.asarray(rng.normal(size=shape) * factor, dtype)
    return out


def normal_like(params: Any, seed) -> Any:
    """Normal draws shaped and typed as ``params``, in its leaves' order
    (``jax.tree.map``'s).

    Args:
      params: any tree of arrays.
      seed: the seed of ``np.random.default_rng``, or a generator.

    Returns:
      A tree like ``params``.

    Example::

        grads = normal_like({"w": jnp.ones((2, 3))}, seed=1)
    """
    rng = _generator(seed)
    return jax.tree.map(
        lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params
    )


def mlp_params(seed=0, din=5, dhid=8, dout=3, dtype=jnp.float32) -> dict:
    """A two-layer perceptron's weights ``w1``, ``b1``, ``w2``.

    Args:
      seed: the seed of the draws.
      din: the input width.
      dhid: the hidden width.
      dout: the output width.
      dtype: the leaves' dtype.

    Returns:
      ``{"w1": (din, dhid), "b1": (dhid,), "w2": (dhid, dout)}``, drawn
      normal, times 0.5, 0.1 and 0.5.

    Example::

        params = mlp_params(dtype=jnp.bfloat16)
    """
    shapes = {"w1": (din, dhid), "b1": (dhid,), "w2": (dhid, dout)}
    scale = {"w1": 0.5, "b1": 0.1, "w2": 0.5}
    return normal_tree(seed, shapes, dtype, scale)


def linear_params(dtype=jnp.float32) -> dict:
    """A linear layer's weights: ``w`` (5, 3) drawn normal times 0.3 from
    seed 0, ``b`` (3,) zeros.

    Args:
      dtype: the leaves' dtype.

    Returns:
      ``{"w": ..., "b": ...}``.

    Example::

        params = linear_params(jnp.float16)
    """
    w = normal_tree(0, {"w": (5, 3)}, dtype, scale=0.3)["w"]
    return {"w": w, "b": jnp.zeros((3,), dtype)}


def gradient_trees(
    n: int, params: Mapping, seed=1, bad: Sequence[tuple[int, float]] = ()
) -> list[dict]:
    """``n`` normal gradient trees like the flat dict ``params``, drawn in
    its keys' order from one generator; those at the indices of ``bad``
    (index -> value) hold that value at ``w[1, 2]``.

    Args:
      n: how many trees.
      params: a flat dict of arrays with a ``w`` of at least (2, 3).
      seed: the seed of the draws.
      bad: ``(index, value)`` pairs, or a dict index -> value.

    Returns:
      A list of ``n`` dicts like ``params``.

    Example::

        grads = gradient_trees(4, linear_params(), bad={2: float("nan")})
    """
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        g = normal_tree(rng, params)
        if i in dict(bad):
            g["w"] = g["w"].at[1, 2].set(dict(bad)[i])
        out.append(g)
    return out


def ones_and_zeros() -> dict:
    """``{"w": ones (3, 4), "b": zeros (4,)}``, float32.

    Returns:
      The tree.

    Example::

        params = ones_and_zeros()
    """
    return {"w": jnp.ones((3, 4)), "b": jnp.zeros((4,))}


def mesh_mlp_params(din=8, hidden=16, dout=4) -> dict:
    """The mesh tests' two-layer perceptron (``tests/mesh_helpers.py``).

    Args:
      din: the input width.
      hidden: the hidden width.
      dout: the output width.

    Returns:
      ``{"w1": (din, hidden), "b1": (hidden,), "w2": (hidden, dout)}``,
      float32, drawn from seed 1: normal over 3, times 0.1, over 4.

    Example::

        params = mesh_mlp_params()
    """
    rng = np.random.default_rng(1)
    return {
        "w1": (rng.normal(size=(din, hidden)) / 3).astype(np.float32),
        "b1": (0.1 * rng.normal(size=hidden)).astype(np.float32),
        "w2": (rng.normal(size=(hidden, dout)) / 4).astype(np.float32),
    }


# Synthetic micro-batch gradients with a known noise scale.
NOISE_DIM = 64  # dimensions of the synthetic gradient
NOISE_VARIANCE = 1.0  # per-unit-of-weight noise variance of each coordinate
NOISE_MEAN = 0.5  # every coordinate of the true gradient ``G``


def noisy_gradients(key, weights, windows):
    """Synthetic micro-batch gradients of a known noise scale.

    Args:
      key: the ``jax.random`` key of the noise.
      weights: one window's micro-batch weights ``w_i``.
      windows: how many windows (``weights`` repeated).

    Returns:
      ``(grads, w)``: ``(steps, NOISE_DIM)`` gradients ``G + e_i`` with
      ``G`` all ``NOISE_MEAN`` and ``Var e_i = NOISE_VARIANCE / w_i``, and
      the ``(steps,)`` weights, float32.

    Example::

        grads, weights = noisy_gradients(jax.random.key(0), (1.0, 2.0), 3)
    """
    g = jnp.full(NOISE_DIM, NOISE_MEAN)
    w = jnp.tile(jnp.asarray(weights, jnp.float32), windows)
    e = jax.random.normal(key, (w.shape[0], NOISE_DIM))
    return g[None] + e * jnp.sqrt(NOISE_VARIANCE / w)[:, None], w


def brute_noise(grads, weights):
    """tr(Sigma), |G|^2 of one window, float64 numpy, residual form."""
    g, w = np.asarray(grads, np.float64), np.asarray(weights, np.float64)
    g, w = g[w > 0], w[w > 0]
    big_w, k = w.sum(), len(w)
    mean = (w[:, None] * g).sum(0) / big_w
    trace = (w * ((g - mean) ** 2).sum(1)).sum() / (k - 1)
    return trace, mean @ mean - trace / big_w


def odd_params(din=8, hidden=16) -> dict:
    """Leaves that the shard placement leaves whole: a matrix, a bias of an
    odd size and a scalar.

    Args:
      din: the matrix's rows.
      hidden: the matrix's columns.

    Returns:
      ``{"w": (din, hidden), "b": (3,), "s": ()}``, float32 NumPy, drawn
      from seed 3: normal over 3, times 0.1, and ``s`` 1.3.

    Example::

        params = odd_params()
    """
    rng = np.random.default_rng(3)
    return {
        "w": (rng.normal(size=(din, hidden)) / 3).astype(np.float32),
        "b": (0.1 * rng.normal(size=3)).astype(np.float32),  # odd size
        "s": np.float32(1.3),  # a scalar
    }


def multihost_params(dtype=jnp.float32, din=5, dout=3) -> dict:
    """The two-process worker's linear layer (``_multihost_worker.py``).

    Args:
      dtype: the leaves' dtype.
      din: the input width.
      dout: the output width.

    Returns:
      ``{"w": (din, dout), "b": (dout,)}``: ``w`` drawn normal times 0.3
      from seed 1 in float32, ``b`` zeros; then cast to ``dtype``.

    Example::

        params = multihost_params(jnp.bfloat16)
    """
    rng = np.random.default_rng(1)
    params = {
        "w": (0.3 * rng.normal(size=(din, dout))).astype(np.float32),
        "b": np.zeros(dout, np.float32),
    }
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


def float32_normal(rng, shape, dtype=jnp.float32, scale=1.0):
    """``scale`` times a standard normal draw, rounded to float32 in NumPy
    and then cast to ``dtype`` (``ml_dtypes`` for bfloat16): no eager jax
    compilations."""
    x = (scale * rng.standard_normal(shape)).astype(np.float32)
    return jnp.asarray(x.astype(dtype))


def float32_normal_tree(seed, shapes, dtype=jnp.float32, scale=1.0) -> dict:
    """A flat tree of :func:`float32_normal` draws from one generator.

    Args:
      seed: the seed of ``np.random.default_rng``.
      shapes: name -> shape; drawn in this order.
      dtype: the leaves' dtype.
      scale: each draw's factor.

    Returns:
      name -> array.

    Example::

        params = float32_normal_tree(0, {"w": (4, 3), "b": (3,)})
    """
    rng = np.random.default_rng(seed)
    return {
        name: float32_normal(rng, shape, dtype, scale)
        for name, shape in shapes.items()
    }


def cycled_tree(seed, names, shapes, dtypes, scale=1.0) -> dict:
    """Many leaves cycling through ``shapes`` and ``dtypes``.

    Args:
      seed: the seed of ``np.random.default_rng``.
      names: the leaves' names, drawn in this order.
      shapes: leaf ``i`` has shape ``shapes[i % len(shapes)]``.
      dtypes: leaf ``i`` has dtype ``dtypes[i % len(dtypes)]``.
      scale: each draw's factor.

    Returns:
      name -> ``jnp.asarray(scale * standard normal draw, dtype)``.

    Example::

        tree = cycled_tree(0, ["a", "b"], [(2,), ()], [jnp.float32])
    """
    rng = np.random.default_rng(seed)
    return {
        name: jnp.asarray(
            scale * rng.standard_normal(shapes[i % len(shapes)]),
            dtypes[i % len(dtypes)],
        )
        for i, name in enumerate(names)
    }


def fsdp_mesh_params(shapes) -> tuple:
    """:func:`normal_tree` of ``shapes`` from seed 0 on a ``data=2 x
    fsdp=4`` mesh of 8 devices: ``dense.kernel`` sharded over ``fsdp``,
    the rest replicated.

    Args:
      shapes: as :func:`normal_tree`'s, holding ``{"dense": {"kernel"}}``.

    Returns:
      ``(mesh, params)``.

    Example::

        mesh, params = fsdp_mesh_params({"dense": {"kernel": (8, 2)}})
    """
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(
        (2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2
    )
    params = normal_tree(0, shapes, jnp.float32)
    specs = jax.tree.map(lambda _: P(), params)
    specs["dense"]["kernel"] = P("fsdp", None)
    return mesh, jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs
    )
