"""Whole-matrix followers under ``oa.accumulate(..., shard_update=True)``:
``optax.contrib.muon`` (or a transformation marked ``oa.whole_leaves``)
runs by *ownership*, each matrix on one device of the data axes, once per
window (docs/scaling.md, "Whole-matrix optimizers: owned leaves").

On the 8 CPU devices of conftest.py (data=8 and data=2 x fsdp=4), against
single-device ``optax.contrib.muon`` on each window's whole batch, the
compiled program's cost analysis and its collective census.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from tests import helpers
from tests import mesh_helpers as mh
from tools import sharded_steps

pytestmark = pytest.mark.devices(8)

MESHES = ["data8", "data2xfsdp4"]
MUON_TOL = dict(rtol=1e-4, atol=1e-5)


_muon = sharded_steps.muon


_tx = mh._shard_update_tx


@pytest.mark.parametrize("mesh_name", [*MESHES, *mh.ONE_DEVICE])
def test_muon_equals_single_device_muon_on_the_window(mesh_name):
    """Several windows of token-weighted micro-batches: the params equal
    single-device optax.contrib.muon stepped once per window on the
    window's whole batch (refused before), and keep their sharding; also
    on a mesh whose axes all have size 1 (a run resumed on one device)."""
    if mesh_name in mh.ONE_DEVICE:
        mesh, axis = mh._mesh(mesh_name), "data"
    else:
        mesh, axis = sharded_steps.mesh(mesh_name)
    data = mh._make_data(mh.K * 3)
    params, state = mh._run(_tx(_muon(), axis), mesh, data, axis=axis)
    want = mh._reference(_muon(), helpers.mesh_mlp_params(), *data)
    chex.assert_trees_all_close(
        jax.tree.map(np.asarray, params), want, **MUON_TOL
    )
    assert int(state[0].gradient_step) == 3
    mh._same_sharding(params, mh._put_params(mesh, helpers.mesh_mlp_params()))


# ------------------------------------------- transformer-shaped and stacked

V, D, SEQ = sharded_steps.V, sharded_steps.D, sharded_steps.SEQ
_transformer_params = sharded_steps.transformer_params
_stacked_muon = sharded_steps.stacked_muon
_specs = sharded_steps.fsdp_specs
_optimizer_step = sharded_steps.optimizer_step
_flops = sharded_steps.flops
_state_bytes = sharded_steps.state_bytes


@pytest.mark.slow
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("mesh_name", MESHES)
def test_per_device_state_and_newton_schulz_flops_are_one_over_data(
    mesh_name, stacked
):
    """For a transformer-shaped parameter set (matrices of several sizes)
    and a stacked-layer one (scanned layers split along the layer axis):
    each device's part of muon's state and the step's FLOPs (compiled cost
    analysis, per device) are within 1.25x of 1/data of single-device
    muon's; the updates equal single-device muon's."""
    mesh, axis = sharded_steps.mesh(mesh_name)
    n = sharded_steps.data_size(mesh, axis)
    params = _transformer_params(stacked)
    opt = _stacked_muon() if stacked else _muon()
    ours = oa.whole_leaves(opt, layer_axis=0) if stacked else opt
    compiled, state, _, (updates, _) = _optimizer_step(mesh, axis, ours, params)
    whole = jax.jit(opt.update).lower(params, opt.init(params), params)
    whole = whole.compile()
    whole_flops = _flops(whole)
    per_device = sum(
        r.addressable_shards[0].data.nbytes for r in state[1].rows.values()
    ) + sum(x.addressable_shards[0].data.nbytes for x in state[1].shared)
    whole_bytes = _state_bytes(opt.init(params))
    assert per_device <= 1.25 * whole_bytes / n, (per_device, whole_bytes)
    assert _flops(compiled) <= 1.25 * whole_flops / n, (
        _flops(compiled),
        whole_flops,
    )
    want, _ = whole(params, opt.init(params), params)  # single-device muon
    chex.assert_trees_all_close(
        jax.device_get(updates), jax.device_get(want), **MUON_TOL
    )


def test_ownership_is_deterministic_and_balanced():
    """The greedy assignment (private helper, on purpose): the same plan
    twice; every device owns some matrix; no device carries more than
    1.25x of 1/data of the Newton–Schulz cost."""
    from optaxaccum._src import owned

    mesh, axis = sharded_steps.mesh("data8")
    params = _transformer_params()
    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
    plans = [owned.plan(p, axis, None) for _ in range(2)]
    assert plans[0].leaves == plans[1].leaves
    cost = np.zeros(8)
    for leaf in plans[0].leaves:
        if leaf.kind == "owned":
            cost[leaf.owner] += owned._cost(leaf.shape)
    assert (cost > 0).all(), cost
    assert cost.max() <= 1.25 * cost.sum() / 8, cost


# ------------------------------------------------------------ collectives


@pytest.mark.parametrize("mesh_name", MESHES)
def test_hlo_collectives_once_per_window_none_per_micro_batch(mesh_name):
    """Compiled step: outside the closing branch only scalars cross the
    data axes (nothing per micro-batch); inside it, over the data axes,
    the gradient's reduce-scatter, one all-to-all to the owners and
    all-gathers back, bounded by the tree's bytes each."""
    mesh, axis = sharded_steps.mesh(mesh_name)
    axes = frozenset(sharded_steps.oa_axes(axis))
    ops, _, params = mh._compiled_census(mesh, _tx(_muon(), axis), axis=axis)
    over = [o for o in ops if o["axes"] & axes]
    top = [o for o in over if not o["branches"]]
    assert sum(o["bytes"] for o in top) <= 16, top
    by_op = {}
    for o in over:
        if o["branches"]:
            by_op[o["op"]] = by_op.get(o["op"], 0) + o["bytes"]
    tree = mh._shard_bytes(params)
    n = sharded_steps.data_size(mesh, axis)
    assert by_op.pop("reduce-scatter") * n == tree, by_op
    # To the owners: each device's data-slice of the window gradient and
    # of the params of each owned leaf, a row per owner (padded to the
    # largest). Back: each owner's row (the params' piece of its leaves),
    # and the element-wise leaves' pieces.
    from optaxaccum._src import owned

    pl = owned.plan(params, axis, None)
    sent, share, pieces = [0] * n, [0] * n, 0
    for leaf in pl.leaves:
        local = owned._local(leaf.shape, leaf.spec, mesh)
        if leaf.kind == "owned":
            share[leaf.owner] += 4 * int(np.prod(local))
            moved = owned._local(leaf.shape, leaf.move, mesh)
            sent[leaf.owner] += 2 * 4 * int(np.prod(moved))
        else:
            pieces += 4 * int(np.prod(local))
    assert by_op.pop("all-to-all") == n * max(sent), by_op
    assert by_op.pop("all-gather") == n * max(share) + pieces, by_op
    # Resharding to and from the placement: at most a few small permutes.
    assert by_op.pop("collective-permute", 0) <= tree, by_op
    assert by_op.get("all-reduce", 0) <= 64, by_op
    assert not set(by_op) - {"all-reduce"}, by_op


@pytest.mark.parametrize(
    "spec", [P(None, "fsdp", None), P(None, None, "fsdp"), P("fsdp")]
)
def test_stacked_leaf_returns_the_params_shard_over_data(spec, capfd):
    """data=2 x fsdp=4, a stacked leaf of 4 layers split along them
    (layer_axis=0), fsdp on one of its dimensions: the owners' updates
    cross the data axes as the params' shard (1024 B per device), not the
    whole leaf (4096 B), and XLA reports no involuntary rematerialization;
    the updates equal single-device muon's."""
    mesh, axis = sharded_steps.mesh("data2xfsdp4")
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 16, 16)).astype(np.float32)}
    opt = _stacked_muon()
    compiled, _, p, (updates, _) = _optimizer_step(
        mesh, axis, oa.whole_leaves(opt, layer_axis=0), params, {"w": spec}
    )
    shard = mh._shard_bytes(p)
    assert shard == 1024
    back = [
        o
        for o in oa.collective_census(compiled, mesh)
        if o["axes"] & {"data"} and o["op"] in ("all-gather", "all-reduce")
    ]
    assert sum(o["bytes"] for o in back) <= shard, back
    assert "rematerialization" not in capfd.readouterr().err
    want, _ = opt.update(params, opt.init(params), params)
    chex.assert_trees_all_close(
        jax.device_get(updates), jax.device_get(want), **MUON_TOL
    )


def test_stacked_leaf_whose_layers_data_does_not_divide_is_owned_whole():
    """data=2 x fsdp=4, layer_axis=0: a leaf of 3 layers is owned whole by
    one device, one of 4 layers is split along them (private plan, on
    purpose); the updates equal single-device muon's."""
    from optaxaccum._src import owned

    mesh, axis = sharded_steps.mesh("data2xfsdp4")
    rng = np.random.default_rng(2)
    params = {
        f"w{n}": rng.normal(size=(n, 16, 16)).astype(np.float32) for n in (3, 4)
    }
    specs = {k: P(None, "fsdp", None) for k in params}
    with jax.set_mesh(mesh):
        p = jax.device_put(
            params, {k: NamedSharding(mesh, s) for k, s in specs.items()}
        )
    kinds = [leaf.kind for leaf in owned.plan(p, axis, 0).leaves]
    assert kinds == ["owned", "stacked"], kinds
    opt = _stacked_muon()
    _, _, _, (updates, _) = _optimizer_step(
        mesh, axis, oa.whole_leaves(opt, layer_axis=0), params, specs
    )
    want, _ = opt.update(params, opt.init(params), params)
    chex.assert_trees_all_close(
        jax.device_get(updates), jax.device_get(want), **MUON_TOL
    )


# ------------------------------------------------ declaration and refusals


def test_whole_leaves_bad_input_and_position():
    for bad in (1, False, True):  # False == 0, yet not an axis
        with pytest.raises(ValueError, match="layer_axis"):
            oa.whole_leaves(optax.sgd(0.1), layer_axis=bad)
    with pytest.raises(ValueError, match="last of the chain"):
        oa.chain(
            oa.accumulate(mh.K, axis_name="data", shard_update=True),
            _muon(),
            optax.add_decayed_weights(0.1),
        )


def test_init_with_params_on_no_mesh_is_the_followers_own_state():
    """tx.init of a muon shard_update chain on params that lie on no mesh
    (host arrays, eagerly or under jax.jit with no jax.set_mesh): the
    follower's part is muon's own init, not an error."""
    params = helpers.mesh_mlp_params()
    tx = _tx(_muon(), "data")
    want = _muon().init(params)
    for init in (tx.init, jax.jit(tx.init)):
        try:
            state = init(params)
        except ValueError as e:  # e.g. JAX's: no mesh to reshard onto
            msg = f"tx.init refused params on no mesh: {e}"
            raise AssertionError(msg) from e
        chex.assert_trees_all_equal(jax.device_get(state[1]), want)


def test_whole_leaves_marks_any_transformation():
    """A user's matrix transformation (an SVD-based orthogonalisation)
    marked oa.whole_leaves runs by ownership, equal to single-device."""

    def orthogonalise():
        def update(u, state, params=None):
            del params

            def leaf(x):
                if x.ndim != 2:
                    return -0.1 * x
                a, _, b = jnp.linalg.svd(x, full_matrices=False)
                return -0.1 * a @ b

            return jax.tree.map(leaf, u), state

        return optax.GradientTransformation(
            lambda p: optax.EmptyState(), update
        )

    mesh, axis = sharded_steps.mesh("data8")
    data = mh._make_data(mh.K * 2)
    tx = _tx(oa.whole_leaves(orthogonalise()), axis)
    params, _ = mh._run(tx, mesh, data, axis=axis)
    want = mh._reference(orthogonalise(), helpers.mesh_mlp_params(), *data)
    chex.assert_trees_all_close(
        jax.tree.map(np.asarray, params), want, **MUON_TOL
    )


# ------------------------------------------- checkpoints and other meshes


def _feed(tx, mesh, params, state, data, ts_range):
    step = jax.jit(mh._step_fn(tx, mesh))
    with jax.set_mesh(mesh):
        for t in ts_range:
            batch = mh._put_batch(mesh, *(a[t] for a in data))
            params, state, _ = step(params, state, *batch)
    return params, state


def test_state_shardings_and_orbax_round_trip_mid_window(tmp_path):
    """data=2 x fsdp=4: oa.state_shardings gives the state's shardings
    (the owners' rows over data, Adam's pieces at the ZeRO placement); a
    mid-window orbax save restored into jax.eval_shape(tx.init, params)
    with them continues to the uninterrupted run and the reference."""
    import orbax.checkpoint as ocp

    mesh, axis = sharded_steps.mesh("data2xfsdp4")
    tx = _tx(_muon(), axis)
    data = mh._make_data(mh.K * 2)
    before = mh.K + 1
    with jax.set_mesh(mesh):
        params = mh._put_params(mesh, helpers.mesh_mlp_params())
        shardings = oa.state_shardings(tx, params)
        state = jax.jit(tx.init)(params)
    got = jax.tree.map(lambda x: x.sharding.spec, state)
    assert got == jax.tree.map(lambda s: s.spec, shardings)
    assert got[1].rows["float32"] == P("data", None)
    params, state = _feed(tx, mesh, params, state, data, range(before))
    with jax.set_mesh(mesh):
        target = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            jax.eval_shape(tx.init, params),
            shardings,
        )
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp_path / "state", state)
            ckpt.wait_until_finished()
            restored = ckpt.restore(tmp_path / "state", target)
    rest = range(before, len(data[0]))
    resumed, _ = _feed(tx, mesh, params, restored, data, rest)
    uninterrupted, _ = _feed(tx, mesh, params, state, data, rest)
    chex.assert_trees_all_close(
        jax.device_get(resumed), jax.device_get(uninterrupted), **mh.TOL
    )
    want = mh._reference(_muon(), helpers.mesh_mlp_params(), *data)
    chex.assert_trees_all_close(jax.device_get(resumed), want, **MUON_TOL)


def test_reshard_state_mid_window_onto_another_data_size():
    """A state saved mid-window on data=8 (each matrix's muon momentum on
    its owner of 8), resumed with oa.reshard_state on data=2 x fsdp=4
    (ownership recomputed over 2, the rows moved): the run equals the
    uninterrupted one on data=8 and single-device muon."""
    data = mh._make_data(mh.K * 3)
    before = mh.K + 2
    old, axis = sharded_steps.mesh("data8")
    tx = _tx(_muon(), axis)
    with jax.set_mesh(old):
        params = mh._put_params(old, helpers.mesh_mlp_params())
        state = jax.jit(tx.init)(params)
    params, state = _feed(tx, old, params, state, data, range(before))
    rest = range(before, len(data[0]))
    uninterrupted, _ = _feed(tx, old, params, state, data, rest)
    saved, host_params = jax.device_get((state, params))
    new, _ = sharded_steps.mesh("data2xfsdp4")
    with jax.set_mesh(new):
        params = mh._put_params(new, host_params)
        moved = oa.reshard_state(tx, saved, params)
    assert moved[1].rows["float32"].shape[0] == 2
    resumed, _ = _feed(tx, new, params, moved, data, rest)
    chex.assert_trees_all_close(
        jax.device_get(resumed), jax.device_get(uninterrupted), **mh.TOL
    )
    want = mh._reference(_muon(), helpers.mesh_mlp_params(), *data)
    chex.assert_trees_all_close(jax.device_get(resumed), want, **MUON_TOL)


def test_reshard_state_when_the_largest_matrix_is_the_last_path():
    """Muon's state after a step on data=8 resharded onto data=2 x fsdp=4
    (owners recomputed; the largest matrix, first owned, is the last path,
    so the owners' order differs from the paths'): the state's index is in
    the paths' order, and the next step equals single-device muon's."""
    rng = np.random.default_rng(1)
    shapes = {"a": (16, 16), "b": (16, 24), "bias": (16,), "z": (32, 48)}
    params = {
        k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()
    }
    grads = [jax.tree.map(lambda p, i=i: p * (i + 1.5), params) for i in (0, 1)]
    tx = _tx(_muon(), "data", k=1)

    def step(mesh, g, state, p):
        with jax.set_mesh(mesh), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # gradients not unreduced
            return jax.jit(tx.update)(g, state, p)

    old, _ = sharded_steps.mesh("data8")
    with jax.set_mesh(old):
        p = jax.device_put(params, NamedSharding(old, P()))
        state = jax.jit(tx.init)(p)
    _, state = step(old, jax.device_put(grads[0], p["a"].sharding), state, p)
    # The owners' index lists muon's momentum of a, b, z in path order.
    sizes = state[1].owners["float32"][:, 2].tolist()
    assert sizes == [16 * 16, 16 * 24, 32 * 48], state[1].owners
    new, _ = sharded_steps.mesh("data2xfsdp4")
    with jax.set_mesh(new):
        p = jax.device_put(params, NamedSharding(new, P()))
        moved = oa.reshard_state(tx, jax.device_get(state), p)
    got, _ = step(new, jax.device_put(grads[1], p["a"].sharding), moved, p)
    opt = _muon()
    _, ref = opt.update(grads[0], opt.init(params), params)
    want, _ = opt.update(grads[1], ref, params)
    chex.assert_trees_all_close(
        jax.device_get(got), jax.device_get(want), **MUON_TOL
    )


@pytest.mark.parametrize("saved_on,resumed_on", [("2", "8"), ("8", "2")])
def test_reshard_state_names_a_stacked_leaf_split_on_one_mesh_only(
    saved_on, resumed_on
):
    """layer_axis=0, a stacked leaf of 4 layers: split along them on
    data=2, owned whole on data=8. Muon's state saved on one resharded
    onto the other raises ValueError naming the leaf, the data sizes and
    what to do (not another follower or other params)."""
    meshes = {"2": "data2xfsdp4", "8": "data8"}
    rng = np.random.default_rng(3)
    params = {
        "head": rng.normal(size=(16, 32)).astype(np.float32),
        "layers": rng.normal(size=(4, 16, 16)).astype(np.float32),
    }
    tx = _tx(oa.whole_leaves(_stacked_muon(), layer_axis=0), "data", k=1)
    old, _ = sharded_steps.mesh(meshes[saved_on])
    with jax.set_mesh(old):
        p = jax.device_put(params, NamedSharding(old, P()))
        saved = jax.device_get(jax.jit(tx.init)(p))
    new, _ = sharded_steps.mesh(meshes[resumed_on])
    with jax.set_mesh(new):
        p = jax.device_put(params, NamedSharding(new, P()))
        with pytest.raises(ValueError) as raised:
            oa.reshard_state(tx, saved, p)
    msg = str(raised.value)
    assert "another follower" not in msg, msg
    for part in (
        "(4, 16, 16)",
        f"data size {resumed_on}",
        f"data size {saved_on}",
        "along their layers",
        "whole",
        "layer_axis=0",
        "tx.init(params)",
    ):
        assert part in msg, (part, msg)


def test_comm_model_owned_mode_equals_the_census_when_balanced():
    """Eight equal matrices on data=8 (one per owner): the reduce-scatter,
    the all-to-all and the all-gather over the data axes of the compiled
    step equal the communication model's ``owned`` rows
    (tools/comm_model.py)."""
    from tools import comm_model as cm

    mesh, axis = sharded_steps.mesh("data8")
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": rng.normal(size=(16, 16)).astype(np.float32) for i in range(8)
    }
    compiled, *_ = _optimizer_step(mesh, axis, _muon(), params)
    got = {}
    for o in oa.collective_census(compiled, mesh):
        if o["axes"] == {"data"} and o["bytes"] > 64:
            got[o["op"]] = got.get(o["op"], 0) + o["bytes"]
    n_params = sum(p.size for p in params.values())
    model = {
        c.op: c.result_bytes
        for c in cm.collectives(n_params, cm.Mesh(data=8), 1, "owned")
        if c.axes == {"data"}
    }
    assert got == model, (got, model)


def test_flush_partial_window_runs_muon_by_ownership():
    """oa.flush after 2 of K micro-batches on data=2 x fsdp=4: muon by
    ownership steps on the mean over those 2, as single-device muon."""
    mesh, axis = sharded_steps.mesh("data2xfsdp4")
    tx = _tx(_muon(), axis)
    data = mh._make_data(2)
    params, state = mh._run(tx, mesh, data, axis=axis)

    def flush(params, state):
        updates, state = oa.flush(tx, state, params)
        return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        params, state = jax.jit(flush)(params, state)
    want = mh._reference(_muon(), helpers.mesh_mlp_params(), *data, k=2)
    chex.assert_trees_all_close(
        jax.tree.map(np.asarray, params), want, **MUON_TOL
    )
    assert int(state[0].gradient_step) == 1


def test_reshard_moves_each_leafs_state_to_its_new_owner():
    """The rows' move of oa.reshard_state (private helper, on purpose):
    two owned leaves on owners 3 and 1 of 8 (at offsets 0 and 2) land on
    owners 0 and 1 of 2 (offsets 0 and 0), and back; nothing else is
    written."""
    from optaxaccum._src import reshard

    old = np.zeros((8, 6), np.float32)
    old[3, 0:4] = [1, 2, 3, 4]
    old[1, 2:4] = [5, 6]
    saved_index = {"float32": np.array([[3, 0, 4], [1, 2, 2]], np.int32)}
    new_index = {"float32": np.array([[0, 0, 4], [1, 0, 2]], np.int32)}
    like = {"float32": jax.ShapeDtypeStruct((2, 4), np.float32)}
    want = np.array([[1, 2, 3, 4], [5, 6, 0, 0]], np.float32)
    back = reshard.moved_rows(
        {"float32": want},
        new_index,
        saved_index,
        {"float32": jax.ShapeDtypeStruct(old.shape, np.float32)},
    )
    np.testing.assert_array_equal(back["float32"], old)
    got = reshard.moved_rows({"float32": old}, saved_index, new_index, like)
    np.testing.assert_array_equal(got["float32"], want)
    bad = {"float32": np.array([[0, 0, 3], [1, 0, 2]], np.int32)}
    with pytest.raises(ValueError, match="reshard_state"):
        reshard.moved_rows({"float32": old}, saved_index, bad, like)
