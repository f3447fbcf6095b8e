"""One process of the 2-process test in ``test_multidevice.py``.

Run as ``python _multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUT``: the
process joins a ``jax.distributed`` job (coordinator on ``127.0.0.1:PORT``),
exposes ``LOCAL_DEVICES`` CPU devices with gloo CPU collectives, and trains a
small linear model data-parallel over all the job's devices with
``jax.pmap`` and ``oa.chain(oa.accumulate(K, axis_name="d"), optax.adam)``,
each device computing plain local gradients of its own micro-batch, weighted
by its token count. Process 0 saves the final params to ``OUT`` (``np.save``
of :func:`flatten`).

Importing this module changes no jax configuration and starts no backend:
the test imports it for :func:`make_data`,
:func:`local_loss` and the constants, to compute the single-process
reference. The params are ``tests/helpers.py``'s ``multihost_params``: the
repository root is on ``PYTHONPATH`` (``tests/workers/__init__.py``).
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _distributed import flatten, join  # noqa: E402

from tests import helpers  # noqa: E402

LOCAL_DEVICES = 2
K = 3  # micro-batches per window
WINDOWS = 2
BATCH = 4  # examples per device and micro-batch (some masked out)
D_IN, D_OUT = 5, 3
LEARNING_RATE = 0.05


def make_data(
    num_devices: int, steps: int, *, ragged: bool = True, seed: int = 0
):
    """``steps`` micro-steps of data for ``num_devices`` devices: ``x, y,
    mask`` of shape ``(steps, num_devices, BATCH, ...)``. ``mask`` marks the
    real tokens: with ``ragged``, unequal counts per device (one device has
    none in the first micro-step; all are full in the second), else all."""
    rng = np.random.default_rng(seed)
    shape = (steps, num_devices, BATCH)
    x = rng.normal(size=(*shape, D_IN)).astype(np.float32)
    y = rng.normal(size=(*shape, D_OUT)).astype(np.float32)
    if ragged:
        counts = rng.integers(0, BATCH + 1, size=shape[:2])
        counts[0, -1] = 0
        counts[1 % steps, :] = BATCH
    else:
        counts = np.full(shape[:2], BATCH)
    mask = (np.arange(BATCH) < counts[..., None]).astype(np.float32)
    return x, y, mask


def per_token_loss(params, x, y):
    bias = params["b"].reshape((1,) * (x.ndim - 1) + params["b"].shape)
    pred = x @ params["w"] + bias
    return ((pred - y) ** 2).mean(axis=-1)


def local_loss(params, x, y, mask):
    """Mean loss over one device's real tokens (0 if it has none)."""
    total = (mask * per_token_loss(params, x, y)).sum()
    return total / jnp.maximum(mask.sum(), 1.0)


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
    import jax

    join(process_id, num_processes, port, LOCAL_DEVICES)
    import optax

    import optaxaccum as oa

    n = jax.device_count()
    assert jax.local_device_count() == LOCAL_DEVICES, jax.local_devices()
    assert n == LOCAL_DEVICES * num_processes, jax.devices()
    x, y, mask = make_data(n, WINDOWS * K)
    # pmap maps over this process's devices, in the order of
    # jax.local_devices(); each takes its global device's slice of the data.
    mine = np.array([d.id for d in jax.local_devices()])
    order = sorted(d.id for d in jax.devices())
    rows = np.array([order.index(i) for i in mine])

    tx = oa.chain(oa.accumulate(K, axis_name="d"), optax.adam(LEARNING_RATE))

    def step(params, state, x, y, mask):
        grads = jax.grad(local_loss)(params, x, y, mask)
        return oa.apply_gradients(
            tx, grads, state, params, accum_weight=mask.sum()
        )

    pstep = jax.pmap(step, axis_name="d")
    params = helpers.multihost_params(jnp.float32, D_IN, D_OUT)
    state = tx.init(params)

    def local_copies(tree):
        return jax.tree.map(
            lambda a: jnp.broadcast_to(a, (LOCAL_DEVICES, *a.shape)), tree
        )

    params, state = local_copies(params), local_copies(state)
    for t in range(WINDOWS * K):
        params, state = pstep(
            params, state, x[t, rows], y[t, rows], mask[t, rows]
        )
    params = jax.tree.map(np.asarray, params)
    for name, leaf in params.items():  # every local device holds the same
        np.testing.assert_array_equal(
            leaf, np.broadcast_to(leaf[0], leaf.shape), err_msg=name
        )
    steps = int(np.asarray(state[0].gradient_step)[0])
    assert steps == WINDOWS, steps
    if process_id == 0:
        np.save(out, flatten({k: v[0] for k, v in params.items()}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
