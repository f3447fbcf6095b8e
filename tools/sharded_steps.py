"""The meshes, the transformer-shaped params and the compiled optimizer step
of the sharded-update checks, shared by ``tests/test_shard_update.py``,
``tests/test_owned.py`` and ``benchmarks/bench_owned.py``.

The meshes are of 8 devices of the default backend (the tests' conftest
and the benchmark make 8 CPU devices).
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa

MESHES = {
    "data2xfsdp4": ((2, 4), ("data", "fsdp"), "data"),
    "data8": ((8,), ("data",), "data"),
    "dcn2xdata2xfsdp2": ((2, 2, 2), ("dcn", "data", "fsdp"), ("dcn", "data")),
}


def mesh(name):
    """The explicit mesh of :data:`MESHES`' ``name`` and its data axis."""
    shape, names, axis = MESHES[name]
    mesh = jax.make_mesh(
        shape, names, axis_types=(AxisType.Explicit,) * len(shape)
    )
    return mesh, axis


def data_size(mesh, axis):
    """The number of devices along the data axis (or axes) ``axis``."""
    return int(np.prod([mesh.shape[a] for a in oa_axes(axis)]))


def oa_axes(axis):
    """``axis`` as a tuple of axis names."""
    return axis if isinstance(axis, tuple) else (axis,)


def shard_update_tx(opt, axis, k, **kwargs):
    """``opt`` behind ``oa.accumulate(k, shard_update=True)`` on ``axis``."""
    return oa.chain(
        oa.accumulate(k, axis_name=axis, shard_update=True, **kwargs), opt
    )


def muon():
    """``optax.contrib.muon``, as the sharded-update checks use it."""
    return optax.contrib.muon(0.05)


V, D, SEQ = 64, 32, 16


def transformer_params(stacked=False):
    """The shapes of a small transformer LM: embeddings, per layer q/k/v/o
    (D, D), MLP (D, 4D) and (4D, D), layer-norm scales and biases, head.
    ``stacked``: the layers' leaves stacked along a leading layer axis
    (scanned layers): 8 of them, which the data size divides; else 2."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.normal(size=shape) / np.sqrt(shape[-2])).astype(np.float32)

    def layer():
        return {
            "q": w(D, D),
            "k": w(D, D),
            "v": w(D, D),
            "o": w(D, D),
            "up": w(D, 4 * D),
            "down": w(4 * D, D),
            "ln": np.ones(D, np.float32),
            "bias": np.zeros(4 * D, np.float32),
        }

    layers = [layer() for _ in range(8 if stacked else 2)]
    params = {"embed": w(V, D), "pos": w(SEQ, D), "head": w(D, V)}
    if stacked:
        params["layers"] = jax.tree.map(lambda *x: np.stack(x), *layers)
    else:
        params.update({f"layer{i}": lay for i, lay in enumerate(layers)})
    return params


def stacked_muon():
    """Muon of the layers' stacked (3-D) leaves, batched on their lead axis."""
    dims = optax.contrib.MuonDimensionNumbers(1, 2)

    def dim_nums(params):
        return jax.tree.map(
            lambda x: (
                dims
                if x.ndim == 3
                else (
                    optax.contrib.MuonDimensionNumbers()
                    if x.ndim == 2
                    else None
                )
            ),
            params,
        )

    return optax.contrib.muon(0.05, muon_weight_dimension_numbers=dim_nums)


def fsdp_specs(params, fsdp):
    """fsdp on the first dimension of every leaf it divides."""
    return jax.tree.map(
        lambda x: P(fsdp) if fsdp and x.shape[0] % 4 == 0 else P(), params
    )


def optimizer_step(mesh, axis, opt, params, specs=None):
    """The jitted ``tx.update`` of ``oa.chain(accumulate(1, shard_update),
    opt)`` on gradients at the params' sharding (``specs``, else
    :func:`fsdp_specs`), its state and params."""
    tx = shard_update_tx(opt, axis, 1)
    fsdp = "fsdp" if "fsdp" in mesh.axis_names else None
    if specs is None:
        specs = fsdp_specs(params, fsdp)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradients not unreduced: on purpose
        p = jax.device_put(params, shardings)
        state = jax.jit(tx.init)(p)
        step = jax.jit(lambda g, s, p: tx.update(g, s, p))
        compiled = step.lower(p, state, p).compile()
        out = step(p, state, p)
    return compiled, state, p, out


def flops(compiled):
    """The flops of a compiled program, by XLA's cost analysis."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def state_bytes(tree):
    """The bytes of a tree's arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
