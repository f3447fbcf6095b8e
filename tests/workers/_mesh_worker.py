"""One process of the 2-process mesh test in ``test_mesh.py``.

Run as ``python _mesh_worker.py PROCESS_ID NUM_PROCESSES PORT OUT``: the
process joins a ``jax.distributed`` job (coordinator on ``127.0.0.1:PORT``)
with ``LOCAL_DEVICES`` CPU devices and gloo collectives; one explicit
``data=2 x fsdp=4`` mesh spans every process's devices. A small MLP whose
weights are sharded over ``fsdp`` trains with
``oa.unreduced_value_and_grad`` and
``oa.chain(oa.accumulate(K, axis_name="data"), optax.adam)`` under
``jax.jit``, each micro-batch (sharded over both axes) weighted by its
global token count. Before micro-step ``SAVE_AT`` (mid-window) the state
is saved with orbax and restored. ``_mesh_worker_shard_update.py`` runs
the same with ``shard_update=True``. Process 0 saves the final params (``np.save`` of
:func:`flatten`) to ``OUT``.

Importing this module changes no jax configuration and starts no backend:
the test imports it for :func:`make_data`,
:func:`per_example` and the constants, to compute the single-process
reference. The params are ``tests/helpers.py``'s ``mesh_mlp_params``: the
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

LOCAL_DEVICES = 4
K = 3  # micro-batches per window
WINDOWS = 2
SAVE_AT = K + 1  # saved and restored before this micro-step (mid-window)
BATCH = 16  # global examples per micro-batch
D_IN, HIDDEN, D_OUT = 8, 16, 4
LEARNING_RATE = 0.05
SPECS = {"w1": ("fsdp", None), "b1": (), "w2": ("fsdp", None)}


def make_data(steps: int, seed: int = 0):
    """``x, y, mask`` of shape ``(steps, BATCH, ...)``, unequal token
    counts per micro-batch."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(steps, BATCH, D_OUT)).astype(np.float32)
    counts = rng.integers(2, BATCH + 1, size=steps)
    mask = (np.arange(BATCH) < counts[:, None]).astype(np.float32)
    return x, y, mask


def per_example(params, x, y):
    """Single-device model: squared error per example."""
    b1 = params["b1"].reshape((1,) * (x.ndim - 1) + (HIDDEN,))
    h = jnp.tanh(x @ params["w1"] + b1)
    return ((h @ params["w2"] - y) ** 2).mean(-1)


def _sharded_loss(params, x, y, mask):
    """The same loss on the mesh, keeping the params' reduced axes."""
    import jax
    from jax.sharding import PartitionSpec as P

    axes = {"data", "fsdp"}

    def gather(w):
        return jax.reshard(w, P(*(None,) * w.ndim, reduced=axes))

    h = x @ gather(params["w1"])
    b = jnp.broadcast_to(gather(params["b1"]), h.shape)
    h = jnp.tanh(h + jax.reshard(b, jax.typeof(h).sharding.spec))
    per = ((h @ gather(params["w2"]) - y) ** 2).mean(-1)
    return (mask * per).sum() / mask.sum()


def _save_and_restore(tx, params, state, out: str):
    """Saves ``state`` (mid-window) with orbax from every process and
    restores it into ``jax.eval_shape(tx.init, params)`` placed by
    ``oa.state_shardings``: each device's partial sum comes back."""
    import pathlib

    import jax
    import orbax.checkpoint as ocp

    import optaxaccum as oa

    path = pathlib.Path(out).resolve().parent / "state"
    shardings = oa.state_shardings(tx, params)
    target = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(tx.init, params),
        shardings,
    )
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, state)
        ckpt.wait_until_finished()
        return ckpt.restore(path, target)


def main(
    process_id: int,
    num_processes: int,
    port: int,
    out: str,
    shard_update: bool = False,
) -> None:
    import jax

    join(process_id, num_processes, port, LOCAL_DEVICES)
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import optaxaccum as oa

    assert jax.device_count() == LOCAL_DEVICES * num_processes
    mesh = jax.make_mesh(
        (2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2
    )
    assert mesh.is_multi_process

    def global_array(a, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(
            a.shape, sharding, lambda idx: a[idx]
        )

    tx = oa.chain(
        oa.accumulate(K, axis_name="data", shard_update=shard_update),
        optax.adam(LEARNING_RATE),
    )

    @jax.jit
    def step(params, state, x, y, mask):
        _, grads = oa.unreduced_value_and_grad(_sharded_loss, "data")(
            params, x, y, mask
        )
        return oa.apply_gradients(
            tx, grads, state, params, accum_weight=mask.sum()
        )

    x, y, mask = make_data(WINDOWS * K)
    batch = P(("data", "fsdp"))
    with jax.set_mesh(mesh):
        params = {
            k: global_array(v, P(*SPECS[k]))
            for k, v in helpers.mesh_mlp_params(D_IN, HIDDEN, D_OUT).items()
        }
        state = jax.jit(tx.init)(params)
        for t in range(WINDOWS * K):
            if t == SAVE_AT:
                state = _save_and_restore(tx, params, state, out)
            params, state = step(
                params,
                state,
                global_array(x[t], batch),
                global_array(y[t], batch),
                global_array(mask[t], batch),
            )
        full = jax.jit(
            lambda p: jax.tree.map(lambda a: jax.reshard(a, P()), p)
        )(params)
    steps = int(np.asarray(state[0].gradient_step.addressable_data(0)))
    assert steps == WINDOWS, steps
    if shard_update:  # Adam's moments: 1/(fsdp * data) of w1 per device
        mu = state[1][0].mu["w1"]
        assert mu.addressable_shards[0].data.size * 8 == D_IN * HIDDEN, mu
    if process_id == 0:
        np.save(
            out,
            flatten(
                {k: np.asarray(v.addressable_data(0)) for k, v in full.items()}
            ),
        )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
