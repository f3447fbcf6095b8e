"""The MLP of the mesh benchmark (``benchmarks/bench_mesh.py``) and of the
communication model's checks (``tests/repo/test_comm_model.py``): its
params and a loss that gathers FSDP-sharded weights as it uses them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import optaxaccum as oa


def init_mlp(widths: Sequence[int], seed: int = 0) -> list[dict[str, Any]]:
    """Float32 MLP params: a ``{"w", "b"}`` dict per layer, ``w`` scaled by
    ``1/sqrt(fan_in)``."""
    keys = jax.random.split(jax.random.key(seed), len(widths) - 1)
    return [
        {
            "w": jax.random.normal(k, (a, b), jnp.float32) / a**0.5,
            "b": jnp.zeros((b,), jnp.float32),
        }
        for k, a, b in zip(keys, widths[:-1], widths[1:], strict=True)
    ]


def gather(w, batch_axes):
    """All-gathers an FSDP-sharded leaf; a reduced one with
    ``oa.fsdp_gather``: it stays reduced over the batch axes, so that its
    gradient stays unreduced over them, and is reduce-scattered back."""
    if jax.typeof(w).sharding.spec.reduced:
        return oa.fsdp_gather(w, batch_axes)
    return jax.reshard(w, P(*(None,) * w.ndim))


def make_loss(batch_axes):
    """The mean squared error of the MLP on ``(x, y)``, each weight gathered
    (:func:`gather`) where it is used."""

    def loss(params, x, y):
        h = x
        for i, layer in enumerate(params):
            h = h @ gather(layer["w"], batch_axes)
            b = jnp.broadcast_to(gather(layer["b"], batch_axes), h.shape)
            h = h + jax.reshard(b, jax.typeof(h).sharding.spec)
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - y) ** 2)

    return loss
