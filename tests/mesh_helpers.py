"""Setups shared by the mesh test modules: the 8-device meshes, a small
MLP sharded over ``fsdp``, its data, the jitted steps that train it, and
the single-device reference they are checked against.

``test_mesh.py`` tests these setups' behaviour; ``test_shard_update.py``,
``test_owned.py``, ``test_reshard_state.py``, ``test_every_weight.py``,
``test_gpu_branch.py`` and ``test_scale_by_window.py`` reuse them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from optaxaccum._src import collectives
from tests import helpers
from tools import sharded_steps

K = 3  # micro-batches per window
WINDOWS = 2
BATCH = 16  # global examples per micro-batch
D_IN, HIDDEN, D_OUT = 8, 16, 4  # helpers.mesh_mlp_params's sizes
TOL = dict(rtol=2e-5, atol=2e-6)
MESHES = {"data2xfsdp4": (2, 4), "data8": (8,)}
# A mesh whose axes all have size 1: a run resumed on one device.
ONE_DEVICE = {"one1x1": (1, 1)}


def _mesh(name):
    shape = {**MESHES, **ONE_DEVICE}[name]
    names = ("data", "fsdp")[: len(shape)]
    return jax.make_mesh(
        shape,
        names,
        axis_types=(AxisType.Explicit,) * len(shape),
        devices=jax.devices()[: int(np.prod(shape))],
    )


def _param_specs(mesh):
    fsdp = "fsdp" if "fsdp" in mesh.axis_names else None
    return {"w1": P(fsdp, None), "b1": P(), "w2": P(fsdp, None)}


def _batch_axes(mesh):
    return tuple(mesh.axis_names)


def _make_data(steps, seed=0):
    """``x, y, mask`` of shape ``(steps, BATCH, ...)``; unequal token counts
    per micro-batch (one has a single real example)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(steps, BATCH, D_OUT)).astype(np.float32)
    counts = rng.integers(BATCH // 2, BATCH + 1, size=steps)
    counts[0] = 1
    mask = np.zeros((steps, BATCH), np.float32)
    for t, c in enumerate(counts):
        mask[t, rng.permutation(BATCH)[:c]] = 1.0
    return x, y, mask


# ------------------------------------------------------------------ model


def _gather(w, batch_axes):
    """All-gathers a weight for the forward. When it is reduced (over the
    data axis, from oa.unreduced_value_and_grad), oa.fsdp_gather keeps the
    gathered copy reduced over every axis that shards the batch, so that
    its gradient is unreduced over them (not all-reduced inside the
    backward pass) and reduce-scattered back over fsdp."""
    if jax.typeof(w).sharding.spec.reduced:
        return oa.fsdp_gather(w, batch_axes)
    return jax.reshard(w, P(*(None,) * w.ndim))


def _add_bias(h, b, batch_axes):
    """``h + b``; a reduced ``b`` is broadcast to ``h``'s sharding first
    (JAX rejects an elementwise op of a reduced and a sharded operand)."""
    if not jax.typeof(b).sharding.spec.reduced:
        return h + b[None]
    b = jnp.broadcast_to(_gather(b, batch_axes), h.shape)
    return h + jax.reshard(b, jax.typeof(h).sharding.spec)


def _per_example(params, x, y, batch_axes=None):
    if batch_axes is None:  # single device
        b1 = params["b1"].reshape((1,) * (x.ndim - 1) + (HIDDEN,))
        h = jnp.tanh(x @ params["w1"] + b1)
        return ((h @ params["w2"] - y) ** 2).mean(-1)
    h = x @ _gather(params["w1"], batch_axes)
    h = jnp.tanh(_add_bias(h, params["b1"], batch_axes))
    return ((h @ _gather(params["w2"], batch_axes) - y) ** 2).mean(-1)


def _loss(batch_axes):
    def loss(params, x, y, mask):
        per = _per_example(params, x, y, batch_axes)
        return (mask * per).sum() / jnp.maximum(mask.sum(), 1.0)

    return loss


# ------------------------------------------------------------- reference


@jax.jit
def _window_grad(params, x, y, mask):
    """Gradient of the per-token mean loss over a window's whole batch."""

    def loss(p):
        return (mask * _per_example(p, x, y)).sum() / mask.sum()

    return jax.grad(loss)(params)


def _reference(opt, params, x, y, mask, k=K):
    """``opt`` stepped once per window of ``k`` micro-batches on the
    window's whole batch, on one device (each window's step one jit: an
    op-by-op Muon takes five times as long)."""

    @jax.jit
    def window(params, state, x, y, mask):
        updates, state = opt.update(
            _window_grad(params, x, y, mask), state, params
        )
        return optax.apply_updates(params, updates), state

    state = opt.init(params)
    for t in range(0, len(x), k):
        s = slice(t, t + k)
        params, state = window(params, state, x[s], y[s], mask[s])
    return params


# ---------------------------------------------------------------- drivers


def _shard_update_tx(opt, axis, k=K, **kwargs):
    """``oa.accumulate(k, axis_name=axis, shard_update=True)`` then
    ``opt`` (:func:`tools.sharded_steps.shard_update_tx`)."""
    return sharded_steps.shard_update_tx(opt, axis, k, **kwargs)


def _put_params(mesh, params):
    return jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
        params,
        _param_specs(mesh),
    )


def _put_batch(mesh, *arrays):
    spec = P(_batch_axes(mesh))
    return [jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]


def _step_fn(tx, mesh, *, ours=True, fused=True, weighted=True, axis="data"):
    loss = _loss(_batch_axes(mesh))
    vg = (
        oa.unreduced_value_and_grad(loss, axis)
        if ours
        else jax.value_and_grad(loss)
    )

    def step(params, state, x, y, mask):
        loss_value, grads = vg(params, x, y, mask)
        kwargs = {"accum_weight": mask.sum()} if weighted else {}
        if fused:
            params, state = oa.apply_gradients(
                tx, grads, state, params, **kwargs
            )
        else:
            updates, state = tx.update(grads, state, params, **kwargs)
            params = optax.apply_updates(params, updates)
        return params, state, loss_value

    return step


def _run(tx, mesh, data, eager_init=False, **kwargs):
    """Feeds ``data``'s micro-steps to the jitted step. The state comes from
    ``jax.jit(tx.init)`` under the mesh (unreduced accumulator), or with
    ``eager_init`` from ``tx.init`` outside any mesh context (plain zeros,
    made unreduced by the first step)."""
    if eager_init:
        state = tx.init(_put_params(mesh, helpers.mesh_mlp_params()))
    with jax.set_mesh(mesh):
        params = _put_params(mesh, helpers.mesh_mlp_params())
        if not eager_init:
            state = jax.jit(tx.init)(params)
        step = jax.jit(_step_fn(tx, mesh, **kwargs), donate_argnums=(0, 1))
        for t in range(len(data[0])):
            micro = _put_batch(mesh, *(a[t] for a in data))
            params, state, _ = step(params, state, *micro)
        return params, state


def _same_sharding(tree, params):
    for a, p in zip(
        jax.tree.leaves(tree), jax.tree.leaves(params), strict=True
    ):
        assert a.sharding.is_equivalent_to(p.sharding, a.ndim), (
            a.sharding,
            p.sharding,
        )


def _compiled_census(mesh, tx, ours=True, axis="data"):
    """The collective census of ``tx``'s compiled step on the sharded MLP,
    the lowered program's text and the params."""
    with jax.set_mesh(mesh):
        params = _put_params(mesh, helpers.mesh_mlp_params())
        state = jax.jit(tx.init)(params)
        batch = _put_batch(mesh, *(a[0] for a in _make_data(1)))
        step = _step_fn(tx, mesh, ours=ours, axis=axis)
        lowered = jax.jit(step).lower(params, state, *batch)
        ops = collectives.collective_census(lowered.compile().as_text(), mesh)
    return ops, lowered.as_text(), params


def _shard_bytes(tree):
    """Bytes one device holds of ``tree``."""
    return sum(
        a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree)
    )


def _nan_on_one_device(data, t):
    """Micro-batch ``t`` gets a NaN in an example on the last data shard."""
    x = data[0].copy()
    x[t, BATCH - 1, 0] = np.nan
    mask = data[2].copy()
    mask[t, BATCH - 1] = 1.0
    return x, data[1], mask


def _scaled_step(tx, mesh):
    """The documented mesh step with the loss scale in the chain."""
    loss = _loss(_batch_axes(mesh))

    def step(params, state, x, y, mask):
        scale = oa.loss_scale(state)
        _, grads = oa.unreduced_value_and_grad(
            lambda p, *a: loss(p, *a) * scale, "data"
        )(params, x, y, mask)
        return oa.apply_gradients(
            tx, grads, state, params, accum_weight=mask.sum()
        )

    return jax.jit(step)
