"""Setups shared by the data-parallel test modules: the two-process
worker's problem (data, loss) on the 8 CPU devices, trained with plain
local gradients under ``jax.pmap`` or ``jax.shard_map``, and the
single-device reference it is checked against.

``test_multidevice.py`` tests these setups' behaviour;
``test_every_weight.py`` and ``test_scale_by_window.py`` reuse them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from tests import helpers, workers

AXIS = "d"
N = 8  # devices (conftest.py)
K = 3  # micro-batches per window
WINDOWS = 3
TOL = {
    jnp.float32: dict(rtol=2e-5, atol=2e-6),
    jnp.bfloat16: dict(rtol=3e-2, atol=3e-3),
}


# The problem (data, loss) is shared with the two-process worker.
worker = workers.load("_multihost_worker")


def _data(steps, *, ragged, seed=0):
    """``x, y, mask`` of shape ``(steps, N, BATCH, ...)``."""
    return worker.make_data(N, steps, ragged=ragged, seed=seed)


# ------------------------------------------------------------- references


def _window_loss(params, x, y, mask, *, weighted, reduction):
    """The loss whose gradient a window of ``(k, N, BATCH)`` emits."""
    local = jax.vmap(
        jax.vmap(worker.local_loss, (None, 0, 0, 0)), (None, 0, 0, 0)
    )(params, x, y, mask)  # (k, N)
    counts = mask.sum(-1)
    if reduction == "sum":  # mean over devices of each device's window sum
        w = counts if weighted else jnp.ones_like(counts)
        return (w * local).sum(0).mean()
    if weighted:  # the global per-token mean over the whole window
        return (mask * worker.per_token_loss(params, x, y)).sum() / mask.sum()
    return local.mean()  # the mean of the micro-batches' mean losses


_window_grad = jax.jit(
    jax.grad(_window_loss), static_argnames=("weighted", "reduction")
)


def _reference(opt, params, x, y, mask, *, weighted, reduction="mean", k=K):
    """Single device: one ``opt`` step per window of ``k`` micro-steps."""
    state = opt.init(params)
    for t in range(0, len(x), k):
        g = _window_grad(
            params,
            x[t : t + k],
            y[t : t + k],
            mask[t : t + k],
            weighted=weighted,
            reduction=reduction,
        )
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


# ---------------------------------------------------------------- drivers


def _local_step(tx, *, weighted, fused=True, varying=None, scaled=False):
    """The per-device step: plain local gradients, then ``tx``.

    ``varying``: inside ``shard_map``, the axis over which the (replicated)
    params are cast to varying before differentiating, so that the gradient
    stays local (JAX otherwise sums the gradient of a replicated input over
    the axis itself).
    """

    def step(params, state, x, y, mask):
        p = (
            params
            if varying is None
            else lax.pcast(params, varying, to="varying")
        )
        if scaled:
            _, grads = oa.scaled_value_and_grad(worker.local_loss, state)(
                p, x, y, mask
            )
        else:
            grads = jax.grad(worker.local_loss)(p, x, y, mask)
        kwargs = {"accum_weight": mask.sum()} if weighted else {}
        if fused:
            return oa.apply_gradients(tx, grads, state, params, **kwargs)
        updates, state = tx.update(grads, state, params, **kwargs)
        return optax.apply_updates(params, updates), state

    return step


map_per_device = oa.map_accumulators


def _per_device_specs(state):
    """shard_map specs of a state: its accumulators (which differ from
    device to device) get a leading device axis, the rest is replicated."""
    specs = jax.tree.map(lambda _: P(), state)
    return oa.map_accumulators(specs, lambda _: P(AXIS))


def _replicate(tree):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *jnp.shape(a))), tree)


def _pmap_inputs(tree):
    """One copy of ``tree`` per device, placed as pmap places its outputs
    (in jax 0.10), so that feeding the outputs back does not recompile."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), (AXIS,))
    return jax.device_put(_replicate(tree), NamedSharding(mesh, P(AXIS)))


def _run_pmap(tx, params, data, **step_kwargs):
    """Feeds every micro-step of ``data`` to a pmapped step. Returns the
    params of every device (leading axis N) and the final state."""
    step = jax.pmap(_local_step(tx, **step_kwargs), axis_name=AXIS)
    params, state = _pmap_inputs((params, tx.init(params)))
    for t in range(len(data[0])):
        params, state = step(params, state, *(a[t] for a in data))
    return params, state


def _mesh():
    return jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Explicit,))


def _per_device_copies(tree):
    """Each device's copy of a replicated global array, stacked."""

    def copies(a):
        shards = sorted(a.addressable_shards, key=lambda s: s.device.id)
        return np.stack([np.asarray(s.data) for s in shards])

    return jax.tree.map(copies, tree)


def _put(mesh, tree, specs):
    return jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs
    )


def _run_shard_map(tx, params, data, **step_kwargs):
    """As :func:`_run_pmap` with ``jax.shard_map``: params and the state's
    replicated leaves are replicated (``P()``); the accumulators, which
    differ from device to device, carry a leading device axis."""
    mesh = _mesh()
    local = _local_step(tx, varying=AXIS, **step_kwargs)

    def step(params, state, x, y, mask):
        state = map_per_device(state, lambda a: a[0])
        params, state = local(params, state, x[0], y[0], mask[0])
        return params, map_per_device(state, lambda a: a[None])

    state = map_per_device(
        tx.init(params), lambda a: jnp.broadcast_to(a, (N, *a.shape))
    )
    specs = _per_device_specs(state)
    batch = P(AXIS)
    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), specs, batch, batch, batch),
            out_specs=(P(), specs),
        )
    )
    params = _put(mesh, params, jax.tree.map(lambda _: P(), params))
    state = _put(mesh, state, specs)
    for t in range(len(data[0])):
        micro = [_put(mesh, a[t][:, None], P(AXIS)) for a in data]
        params, state = fn(params, state, *micro)
    return _per_device_copies(params), state


def _run_shard_map_per_device(tx, params, data, **step_kwargs):
    """``jax.shard_map`` with pmap's layout: every leaf of the params and
    the state has a leading device axis (all device-varying)."""
    mesh = _mesh()
    local = _local_step(tx, **step_kwargs)

    def step(*args):
        out = local(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: a[None], out)

    d = P(AXIS)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=d, out_specs=d))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, d))  # noqa: E731
    params, state = put(_replicate((params, tx.init(params))))
    for t in range(len(data[0])):
        params, state = fn(params, state, *put(tuple(a[t] for a in data)))
    return jax.tree.map(np.asarray, params), state


RUNNERS = {
    "pmap": _run_pmap,
    "shard_map": _run_shard_map,
    "shard_map_per_device": _run_shard_map_per_device,
}


def _assert_same_on_every_device(per_device):
    for leaf in jax.tree.leaves(per_device):
        leaf = np.asarray(leaf)
        np.testing.assert_array_equal(
            leaf, np.broadcast_to(leaf[:1], leaf.shape)
        )


def _first(per_device):
    return jax.tree.map(lambda a: np.asarray(a)[0], per_device)


def _compiled_text(runner, tx, step):
    """Compiled HLO text of one micro-step of the per-device ``step``. Under
    ``shard_map`` a state holding an ``oa.AccumulateState`` (which, with
    ``axis_name``, differs from device to device) gets the per-device
    layout of :func:`_run_shard_map`; any other state is replicated."""
    params = helpers.multihost_params()
    x, y, mask = (a[0] for a in _data(1, ragged=False))
    if runner == "pmap":
        fn = jax.pmap(step, axis_name=AXIS)
        args = (_replicate(params), _replicate(tx.init(params)), x, y, mask)
        return fn.lower(*args).compile().as_text()
    state = tx.init(params)
    per_device = any(
        isinstance(s, oa.AccumulateState)
        for s in jax.tree.leaves(
            state, is_leaf=lambda s: isinstance(s, oa.AccumulateState)
        )
    )
    if per_device:
        state = map_per_device(
            state, lambda a: jnp.broadcast_to(a, (N, *a.shape))
        )
        specs = _per_device_specs(state)
    else:
        specs = jax.tree.map(lambda _: P(), state)

    def body(p, s, x, y, mask):
        s = map_per_device(s, lambda a: a[0])
        p, s = step(p, s, x[0], y[0], mask[0])
        return p, map_per_device(s, lambda a: a[None])

    mesh = _mesh()
    b = P(AXIS)
    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), specs, b, b, b),
            out_specs=(P(), specs),
        )
    )
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    args = (
        jax.tree.map(lambda a: put(a, P()), params),
        jax.tree.map(put, state, specs),
        *(put(a[:, None], b) for a in (x, y, mask)),
    )
    return fn.lower(*args).compile().as_text()
