"""The communication model (``tools/comm_model.py``) against
the HLO census of compiled steps on the 8 CPU devices of conftest.py.

For the modes the library controls (``deferred``, ``shard_update``), every
collective the model lists must be in the compiled step with exactly the model's result
bytes per window, per op and per mesh axes, and nothing else of tree size.
For the modes XLA partitions on its own (``naive``, ``fsdp_all``), the
step moves at least the model's bytes over each set of mesh axes: XLA:CPU
all-reduces the whole gradient and slices it where the model counts a
reduce-scatter, and may gather activations instead of reducing gradients,
so the model is the lower bound a backend reaches and never flatters
deferring.
"""

from collections import Counter

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from tools import comm_model as cm
from tools.mesh_mlp import init_mlp, make_loss

K = 4
WIDTHS = (16, 32, 16)
BATCH = 64
SCALAR_BYTES = 8  # all-reduces of the loss and the window's weight
MESHES = {
    "data2xfsdp4": dict(data=2, fsdp=4),
    "dcn2xdata2xfsdp2": dict(dcn=2, data=2, fsdp=2),
    "data8": dict(data=8),
}


def _census(sizes, mode):
    """Total result bytes per window of each (op, axes) of the compiled
    step, scalars left out."""
    names = tuple(sizes)
    mesh = jax.make_mesh(
        tuple(sizes.values()),
        names,
        axis_types=(AxisType.Explicit,) * len(names),
        devices=jax.devices()[:8],
    )
    shard = (
        names if mode == "fsdp_all" else ("fsdp" if "fsdp" in names else None)
    )
    data = tuple(n for n in names if n in ("dcn", "data"))
    loss = make_loss(names)
    if mode in ("deferred", "shard_update"):
        axis = data if len(data) > 1 else data[0]
        acc = oa.accumulate(
            K, axis_name=axis, shard_update=mode == "shard_update"
        )
        tx = oa.chain(acc, optax.adam(1e-3))
        grad_fn = oa.unreduced_value_and_grad(loss, axis)
    else:
        tx = oa.chain(oa.accumulate(K), optax.adam(1e-3))
        grad_fn = jax.value_and_grad(loss)

    def step(p, s, x, y):
        _, g = grad_fn(p, x, y)
        return oa.apply_gradients(tx, g, s, p)

    with jax.set_mesh(mesh):
        params = jax.tree.map(
            lambda a: jax.device_put(
                a, NamedSharding(mesh, P(shard, *(None,) * (a.ndim - 1)))
            ),
            init_mlp(WIDTHS),
        )
        state = jax.jit(tx.init)(params)
        rows = NamedSharding(mesh, P(names))
        x = jax.device_put(np.ones((BATCH, WIDTHS[0]), np.float32), rows)
        y = jax.device_put(np.ones((BATCH, WIDTHS[-1]), np.float32), rows)
        compiled = jax.jit(step).lower(params, state, x, y).compile()
    total = Counter()
    for o in oa.collective_census(compiled, mesh):
        # (a reduce-scatter of a bias's shard can be as small as a scalar)
        if o["op"] != "all-reduce" or o["bytes"] > SCALAR_BYTES:
            runs = 1 if o["branches"] else K
            total[o["op"], o["axes"]] += o["bytes"] * runs
    return total


def _model(sizes, mode):
    n_params = sum(
        int(np.prod(a.shape)) for a in jax.tree.leaves(init_mlp(WIDTHS))
    )
    total = Counter()
    for c in cm.collectives(n_params, cm.Mesh(**sizes), K, mode):
        total[c.op, c.axes] += c.result_bytes * c.per_window
    return total


@pytest.mark.parametrize("mode", ["deferred", "shard_update"])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_model_equals_hlo_census(mesh, mode):
    """Op by op, over the same mesh axes, the same result bytes per window:
    with ``shard_update`` one reduce-scatter and one all-gather of the
    tree's fsdp shard over the data axes, and no tree-sized all-reduce."""
    sizes = MESHES[mesh]
    assert _census(sizes, mode) == _model(sizes, mode)


@pytest.mark.parametrize(
    "mesh, mode",
    [
        ("data2xfsdp4", "naive"),
        ("dcn2xdata2xfsdp2", "naive"),
        ("data8", "naive"),
        ("data2xfsdp4", "fsdp_all"),
    ],
)
def test_model_bounds_hlo_census_of_xla_partitioned_steps(mesh, mode):
    """Over every mesh axis set of the model, the compiled step moves at
    least the model's bytes (XLA may gather activations instead of reducing
    gradients, or all-reduce and slice where the model reduce-scatters)."""
    sizes = MESHES[mesh]
    hlo, model = _census(sizes, mode), _model(sizes, mode)
    for axes in {a for _, a in model}:
        moved = sum(b for (_, a), b in hlo.items() if a >= axes)
        needed = sum(b for (_, a), b in model.items() if a == axes)
        assert moved >= needed, (axes, hlo, model)


def test_link_bytes_of_a_ring():
    mesh = cm.Mesh(dcn=4, data=2, fsdp=8)
    ar = cm.Collective("all-reduce", frozenset({"data"}), 100.0, 1)
    assert cm.link_bytes(ar, mesh) == (2 * 100 * 1 / 2, 0.0)
    rs = cm.Collective("reduce-scatter", frozenset({"fsdp"}), 10.0, 1)
    assert cm.link_bytes(rs, mesh) == (80 * 7 / 8, 0.0)
    # Across slices: inside the slice (q = 2) first, then 1/q over dcn.
    ar2 = cm.Collective("all-reduce", frozenset({"dcn", "data"}), 64.0, 1)
    assert cm.link_bytes(ar2, mesh) == (2 * 64 / 2, 2 * 32 * 3 / 4)
    ag = cm.Collective("all-gather", frozenset({"dcn"}), 64.0, 1)
    assert cm.link_bytes(ag, mesh) == (0.0, 64 * 3 / 4)


def test_deferring_divides_slow_bytes_by_k_and_shard_update_the_optimizer():
    hw, n = cm.HARDWARE["tpu-v5p"], 8 * 10**9
    mesh = cm.slice_mesh(16, hw)
    naive = cm.window_cost(n, mesh, 8, "naive", hw)
    deferred = cm.window_cost(n, mesh, 8, "deferred", hw)
    shard = cm.window_cost(n, mesh, 8, "shard_update", hw)
    assert naive["slow_bytes"] == pytest.approx(8 * deferred["slow_bytes"])
    # reduce-scatter + all-gather move the bytes of one all-reduce
    assert shard["slow_bytes"] == pytest.approx(deferred["slow_bytes"])
    assert naive["optimizer"] == pytest.approx(16 * shard["optimizer"])


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="mode"):
        cm.collectives(10, cm.Mesh(), 1, "zero")


# ------------------------------------------------ gather once per step


def _held_census(sizes, mode):
    """Result bytes per step of each (op, axes) of one jitted step of K
    micro-batches with gather_once (an op in the scan's loop runs K
    times), scalars left out; the gradients reduced over the data axes."""
    import functools

    from optaxaccum._src import sharding

    names = tuple(sizes)
    mesh = jax.make_mesh(
        tuple(sizes.values()),
        names,
        axis_types=(AxisType.Explicit,) * len(names),
        devices=jax.devices()[:8],
    )
    if mode == "held":
        shard, over = "fsdp", None
        data = tuple(n for n in names if n in ("dcn", "data"))
    else:  # fsdp_all_held_dcn: every axis shards, "dcn" minor, held over it
        shard, over, data = ("data", "fsdp", "dcn"), "dcn", ()
    micro = functools.partial(
        oa.microbatched_value_and_grad,
        num_microbatches=K,
        batch_argnums=(1, 2),
        interleave=True,
        gather_once=oa.GatherOnce(names, over=over),
    )
    loss = make_loss(names)
    if data:
        grad_fn = oa.unreduced_value_and_grad(loss, data, value_and_grad=micro)
    else:
        grad_fn = micro(loss)

    def step(p, x, y):
        g = grad_fn(p, x, y)[1]
        return jax.tree.map(
            lambda a: jax.reshard(
                a, sharding.without_unreduced(jax.typeof(a).sharding.spec)
            ),
            g,
        )

    with jax.set_mesh(mesh):
        params = jax.tree.map(
            lambda a: jax.device_put(
                a, NamedSharding(mesh, P(shard, *(None,) * (a.ndim - 1)))
            ),
            init_mlp(WIDTHS),
        )
        rows = NamedSharding(mesh, P(names))
        x = jax.device_put(np.ones((BATCH, WIDTHS[0]), np.float32), rows)
        y = jax.device_put(np.ones((BATCH, WIDTHS[-1]), np.float32), rows)
        compiled = jax.jit(step).lower(params, x, y).compile()
    total = Counter()
    for o in oa.collective_census(compiled, mesh):
        if o["op"] != "all-reduce" or o["bytes"] > SCALAR_BYTES:
            total[o["op"], o["axes"]] += o["bytes"] * (
                K - 2 if o["loop"] else 1  # the first and last: peeled
            )
    return total


@pytest.mark.parametrize(
    "mesh, mode",
    [
        ("data2xfsdp4", "held"),
        ("dcn2xdata2xfsdp2", "held"),
        ("dcn2xdata2xfsdp2", "fsdp_all_held_dcn"),
    ],
)
def test_held_model_equals_hlo_census(mesh, mode):
    """The held modes against the compiled step of K in-step micro-batches
    with gather_once: op by op, the model's bytes per step. ``held``: one
    all-gather and one reduce-scatter over fsdp, one all-reduce of the
    shard over the data axes. ``fsdp_all_held_dcn``: once per step over
    dcn; the per-micro-batch gathers inside the slice are hoisted out of
    the loop by XLA:CPU (at most 3, the peeled micro-batches' and the
    loop's, where the model, for GPU and TPU, counts K), every other op
    equal."""
    sizes = MESHES[mesh]
    census, model = _held_census(sizes, mode), _model(sizes, mode)
    inner = frozenset({"data", "fsdp"})
    if mode == "fsdp_all_held_dcn" and jax.default_backend() == "cpu":
        one = model.pop(("all-gather", inner)) / K
        gathers = census.pop(("all-gather", inner)) / one
        # The first and last micro-batch's, and the loop's hoisted: XLA:CPU
        # may merge identical ones (gathers of the same parameters).
        assert gathers in (1, 2, 3), gathers
    assert census == model


def test_exposed_time_orders_the_schedules():
    """The exposed-time model: gather once, hidden exposes what one
    micro-batch of the per-micro-batch path does (the same overlap, once
    per step instead of k times); gather once today exposes every layer's
    gather and reduce-scatter; more than hidden, for every decoder,
    setting and k."""
    for size in cm.DECODERS:
        for _, per_node, nodes in cm.EXPOSED_SETTINGS:
            for k in cm.EXPOSED_WINDOWS:
                e = cm.exposed(size, per_node, nodes, k)
                assert e["per-micro-batch"] == pytest.approx(
                    k * e["once, hidden"]
                )
                assert e["once, peel=False"] > e["once, hidden"] > 0
                assert e["compute"] > 0


def test_exposed_pass_hides_what_compute_covers():
    """One pass: the first collective is exposed, the others only by what
    they take beyond their neighbour's compute."""
    assert cm._hidden_pass(compute=2.0, comm=1.0, layers=4) == 1.0
    assert cm._hidden_pass(compute=1.0, comm=3.0, layers=4) == 3.0 + 3 * 2.0
