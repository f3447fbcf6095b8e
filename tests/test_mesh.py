"""Sharded meshes under ``jax.jit``: unreduced gradients and one
data-axis reduction per window, on ``data=2 x fsdp=4`` and ``data=8`` meshes
of the 8 CPU devices conftest.py gives.

References: a single-device optax run on each window's whole batch (the
global per-token mean), and the naive way (``jax.value_and_grad`` +
``oa.accumulate``) for the collective census of the compiled steps.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from optaxaccum._src import collectives, reducer, sharding
from tests import helpers, workers
from tests.mesh_helpers import (
    D_IN,
    D_OUT,
    HIDDEN,
    MESHES,
    ONE_DEVICE,
    TOL,
    WINDOWS,
    K,
    _batch_axes,
    _compiled_census,
    _loss,
    _make_data,
    _mesh,
    _nan_on_one_device,
    _param_specs,
    _per_example,
    _put_batch,
    _put_params,
    _reference,
    _run,
    _same_sharding,
    _scaled_step,
    _shard_bytes,
    _step_fn,
    _window_grad,
)

# Meshes of 8 devices of the default backend (conftest: 8 CPU devices).
pytestmark = pytest.mark.devices(8)


def _padded(spec, ndim):
    return spec.partitions + (None,) * (ndim - len(spec.partitions))


def _partitions(x):
    """The dims of ``x``'s sharding, padded with None to ``x.ndim``."""
    typ = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    return _padded(typ.sharding.spec, typ.ndim)


# ------------------------------------------------------------------ tests


def test_without_unreduced_keeps_dims_and_reduced_axes():
    """Summing an unreduced array leaves its dimensions and reduced axes:
    the spec without unreduced axes is built on every jax version (jax
    0.11's unreduced_kind made spec.update(unreduced=frozenset()) raise)."""
    spec = P("fsdp", None, unreduced={"data"}, reduced={"pod"})
    assert sharding.without_unreduced(spec) == P("fsdp", None, reduced={"pod"})
    assert sharding.without_unreduced(P("fsdp")) == P("fsdp")
    back = sharding.deferred_spec(P("fsdp"), ("data",), "unreduced")
    assert sharding.without_unreduced(back) == P("fsdp")


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_unreduced_value_and_grad_type_and_value(mesh_name):
    """Gradients keep the params' sharding, are unreduced over 'data'
    ({U:data}) and, reduced, equal jax.grad on one device; the loss is
    reduced as usual."""
    mesh = _mesh(mesh_name)
    x, y, mask = (a[1] for a in _make_data(2))
    loss = _loss(_batch_axes(mesh))
    seen = {}

    def f(params, x, y, mask):
        value, grads = oa.unreduced_value_and_grad(loss, "data")(
            params, x, y, mask
        )
        seen["types"] = jax.tree.map(jax.typeof, grads)
        seen["loss"] = jax.typeof(value)
        return value, jax.tree.map(
            lambda g: jax.reshard(
                g, sharding.without_unreduced(jax.typeof(g).sharding.spec)
            ),
            grads,
        )

    with jax.set_mesh(mesh):
        params = _put_params(mesh, helpers.mesh_mlp_params())
        value, grads = jax.jit(f)(params, *_put_batch(mesh, x, y, mask))
    for t, spec in zip(
        jax.tree.leaves(seen["types"]),
        jax.tree.leaves(_param_specs(mesh)),
        strict=True,
    ):
        assert t.sharding.spec.unreduced == {"data"}, t
        assert _partitions(t) == _padded(spec, t.ndim), t
    assert not seen["loss"].sharding.spec.unreduced
    want_value, want = jax.value_and_grad(_loss(None))(
        helpers.mesh_mlp_params(), x, y, mask
    )
    chex.assert_trees_all_close(grads, want, **TOL)
    np.testing.assert_allclose(value, want_value, **TOL)
    _same_sharding(grads, params)


@pytest.mark.parametrize(
    "mesh_name,opt_name,fused,eager_init",
    [
        ("data2xfsdp4", "sgd", True, False),
        ("data2xfsdp4", "adam", True, False),
        ("data2xfsdp4", "adam", False, True),
        ("data8", "adam", True, True),
        ("data8", "sgd", False, False),
    ],
)
def test_accumulate_axis_name_equals_big_batch(
    mesh_name, opt_name, fused, eager_init
):
    """Unreduced micro-batch gradients, weighted by their global token
    counts, K per window, several windows: the params equal one optax step
    per window on the window's whole batch (single device); the accumulator
    keeps the params' sharding, stacked over 'data' (one row per device's
    partial sum)."""
    mesh = _mesh(mesh_name)
    opt = {"sgd": optax.sgd(0.3), "adam": optax.adam(0.05)}[opt_name]
    data = _make_data(K * WINDOWS)
    tx = oa.chain(oa.accumulate(K, axis_name="data"), opt)
    params, state = _run(tx, mesh, data, eager_init, fused=fused)
    want = _reference(opt, helpers.mesh_mlp_params(), *data)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, params), want, **TOL)
    acc = state[0]
    assert int(acc.gradient_step) == WINDOWS and int(acc.mini_step) == 0
    _check_stacked(acc.acc, mesh)
    _same_sharding(params, _put_params(mesh, helpers.mesh_mlp_params()))


def _check_stacked(acc, mesh, axis="data"):
    """The state's accumulator is each device's partial sum, stacked: a
    leading axis of the data size sharded over 'data', then the params'
    shape and sharding; an ordinary array (nothing unreduced)."""
    params = helpers.mesh_mlp_params()
    for a, p, spec in zip(
        jax.tree.leaves(acc),
        jax.tree.leaves(params),
        jax.tree.leaves(_param_specs(mesh)),
        strict=True,
    ):
        assert a.shape == (mesh.shape[axis], *p.shape), (a.shape, p.shape)
        assert _partitions(a) == (axis, *_padded(spec, p.ndim)), a.sharding
        assert not a.sharding.spec.unreduced


def test_accumulate_sum_reduction_is_the_global_weighted_sum():
    """reduction="sum" in jit's global view: the window emits
    sum_i w_i g_i of the micro-batches' (global) gradients, once."""
    mesh = _mesh("data2xfsdp4")
    lr = 0.01
    data = _make_data(K)
    tx = oa.chain(
        oa.accumulate(K, reduction="sum", axis_name="data"), optax.sgd(lr)
    )
    params, _ = _run(tx, mesh, data, fused=False)
    want = helpers.mesh_mlp_params()
    grads = [
        _window_grad(want, *(a[t : t + 1] for a in data)) for t in range(K)
    ]
    weights = data[2].sum(-1)
    want = jax.tree.map(
        lambda p, *g: p - lr * sum(w * gi for w, gi in zip(weights, g)),
        want,
        *grads,
    )
    chex.assert_trees_all_close(
        jax.tree.map(np.asarray, params), want, rtol=1e-4, atol=1e-5
    )


def test_flush_partial_window_under_mesh():
    """oa.flush after 2 of K micro-batches reduces the unreduced
    accumulator once and steps Adam with the mean over those 2."""
    mesh = _mesh("data2xfsdp4")
    opt = optax.adam(0.05)
    tx = oa.chain(oa.accumulate(K, axis_name="data"), opt)
    data = _make_data(2)
    params, state = _run(tx, mesh, data)

    def flush(params, state):
        updates, state = oa.flush(tx, state, params)
        return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        params, state = jax.jit(flush)(params, state)
    want = _reference(opt, helpers.mesh_mlp_params(), *data, k=2)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, params), want, **TOL)
    assert int(state[0].gradient_step) == 1


# ------------------------------------------------------------ HLO census


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_hlo_one_data_reduction_per_window(mesh_name):
    """Compiled step. Ours: on every call the only collectives over 'data'
    reduce scalars (the loss, the token counts); in the closing branch exactly one all-reduce
    over 'data', of one device's shard of the gradient tree. Naive
    (jax.value_and_grad + oa.accumulate): the whole gradient tree is
    all-reduced over 'data' on every micro-step (K per window)."""
    mesh = _mesh(mesh_name)
    opt = optax.adam(0.1)
    ours, lowered, params = _compiled_census(
        mesh, oa.chain(oa.accumulate(K, axis_name="data"), opt), ours=True
    )
    top = collectives.over(ours, "data", top=True)
    # Only scalars: the loss and the token counts (mask sums).
    assert sum(o["bytes"] for o in top) <= 16, top
    branch = collectives.over(ours, "data", top=False)
    assert len(branch) == 1 and branch[0]["op"] == "all-reduce", ours
    assert branch[0]["branches"] == (1,), branch
    assert branch[0]["bytes"] == _shard_bytes(params), (branch, params)
    # Over 'data' the lowered module holds only the unreduced types (Shardy
    # inserts the window's reduction when compiling; the census above shows
    # it honoured); its explicit collectives are oa.fsdp_gather's, over
    # 'fsdp' (the reduce-scatter of the sharded weights' gradients).
    assert 'unreduced={"data"}' in lowered
    if "fsdp" in mesh.axis_names:
        assert "reduce_scatter" in lowered

    naive, _, _ = _compiled_census(
        mesh, oa.chain(oa.accumulate(K), opt), ours=False
    )
    tree_bytes = sum(
        np.asarray(a).nbytes for a in jax.tree.leaves(helpers.mesh_mlp_params())
    )
    top = collectives.over(naive, "data", top=True)
    assert sum(o["bytes"] for o in top) >= tree_bytes, naive
    assert not collectives.over(naive, "data", top=False), naive


@pytest.mark.skipif(
    not hasattr(jax.sharding, "no_collectives"),
    reason="jax.sharding.no_collectives is new in jax 0.12",
)
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_no_data_collective_until_the_window_closes(mesh_name):
    """The rule above checked at trace time: under
    ``jax.sharding.no_collectives({"data"})``, which raises on any
    collective over 'data', oa.accumulate's micro-step (adding an unreduced
    gradient, noise-scale sums included) traces; the window's emission does
    not: its one reduction over 'data' is the first collective."""
    mesh = _mesh(mesh_name)
    acc = oa.accumulate(K, axis_name="data", noise_scale_decay=0.9)
    loss = _loss(_batch_axes(mesh))
    forbid = jax.sharding.no_collectives  # pyright: ignore[reportAttributeAccessIssue]

    def grads_of(params, x, y, mask):
        return oa.unreduced_value_and_grad(loss, "data")(params, x, y, mask)[1]

    def micro(params, state, grads):
        with forbid({"data"}):
            return acc.gate_update(grads, state, params, oa.GateContext())[0]

    def close(params, state, grads):
        result = acc.gate_update(grads, state, params, oa.GateContext())
        with forbid({"data"}):
            return result.emit().updates

    with jax.set_mesh(mesh):
        params = _put_params(mesh, helpers.mesh_mlp_params())
        state = jax.jit(acc.init)(params)
        batch = _put_batch(mesh, *(a[0] for a in _make_data(1)))
        grads = jax.jit(grads_of)(params, *batch)
        assert _traces(micro, params, state, grads)
        assert not _traces(close, params, state, grads)


def _traces(f, *args):
    """Whether ``jax.jit(f)`` traces on ``args`` without a collective that
    jax.sharding.no_collectives forbids (other errors propagate)."""
    try:
        jax.jit(f).trace(*args)
    except Exception as e:
        if "forbidden by `no_collectives`" not in str(e):
            raise
        return False
    return True


def test_hlo_fsdp_reduce_scatter_per_micro_step():
    """On data=2 x fsdp=4, a micro-step's collectives
    (outside the closing branch) output at most 1 + 1/fsdp parameter trees:
    the forward's all-gathers plus a reduce-scatter of the gradient over
    fsdp (in the HLO, not an all-reduce of the whole gradient then
    sliced)."""
    mesh = _mesh("data2xfsdp4")
    tx = oa.chain(oa.accumulate(K, axis_name="data"), optax.adam(0.1))
    ops, _, _ = _compiled_census(mesh, tx, ours=True)
    top = [o for o in ops if not o["branches"]]
    tree_bytes = sum(
        np.asarray(a).nbytes for a in jax.tree.leaves(helpers.mesh_mlp_params())
    )
    assert sum(o["bytes"] for o in top) <= (1 + 1 / 4) * tree_bytes, top
    scattered = [o for o in top if o["op"] == "reduce-scatter"]
    assert {frozenset(o["axes"]) for o in scattered} == {frozenset({"fsdp"})}
    w_bytes = 4 * (D_IN * HIDDEN + HIDDEN * D_OUT)  # the fsdp-sharded leaves
    assert sum(o["bytes"] for o in scattered) == w_bytes // 4, top
    big = [o for o in top if o["op"] == "all-reduce" and o["bytes"] > 64]
    assert not big, top  # the replicated bias (64 bytes) is all-reduced


def test_naming_fsdp_too_defers_both_reductions():
    """axis_name=("data", "fsdp"): no gradient reduction at all on
    micro-steps (only the forward's all-gathers over fsdp), one all-reduce
    of the whole tree over both axes per window, an unsharded accumulator;
    the update still equals the big-batch one."""
    mesh = _mesh("data2xfsdp4")
    axis = ("data", "fsdp")
    tx = oa.chain(oa.accumulate(K, axis_name=axis), optax.adam(0.05))
    data = _make_data(K * WINDOWS)
    params, state = _run(tx, mesh, data, axis=axis)
    want = _reference(optax.adam(0.05), helpers.mesh_mlp_params(), *data)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, params), want, **TOL)
    tree_bytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(want))
    assert _shard_bytes(state[0].acc) == tree_bytes
    with jax.set_mesh(mesh):
        p = _put_params(mesh, helpers.mesh_mlp_params())
        s = jax.jit(tx.init)(p)
        batch = _put_batch(mesh, *(a[0] for a in _make_data(1)))
        step = jax.jit(_step_fn(tx, mesh, axis=axis))
        ops = oa.collective_census(step.lower(p, s, *batch).compile(), mesh)
    top = [o for o in ops if not o["branches"] and o["bytes"] > 64]
    assert {o["op"] for o in top} == {"all-gather"}, ops
    assert all(o["axes"] == {"fsdp"} for o in top), ops
    branch = [o for o in ops if o["branches"]]
    assert len(branch) == 1 and branch[0]["axes"] == set(axis), ops
    assert branch[0]["bytes"] == tree_bytes, ops


@pytest.mark.parametrize("eager_init", [False, True], ids=["jit", "eager"])
def test_axis_names_out_of_mesh_order(eager_init):
    """axis_name=("fsdp", "data") on the mesh ("data", "fsdp"): the same
    axes in another order are the same reduction. The accumulator is
    stacked in the mesh's order (its leading dimension over both axes, as
    the steps restack it: a stack in the given order failed with a shape
    ValueError on the second step), by ``jax.jit(tx.init)`` under the mesh
    or by the first step after an eager init, and two windows equal the
    big-batch Adam."""
    mesh = _mesh("data2xfsdp4")
    axis = ("fsdp", "data")
    tx = oa.chain(oa.accumulate(K, axis_name=axis), optax.adam(0.05))

    def check_stacked(acc):
        for a, p in zip(
            jax.tree.leaves(acc),
            jax.tree.leaves(helpers.mesh_mlp_params()),
            strict=True,
        ):
            assert a.shape == (mesh.size, *p.shape), (a.shape, p.shape)
            assert _partitions(a)[0] == ("data", "fsdp"), a.sharding
            assert not a.sharding.spec.unreduced
            # What the steps read as a stack over the named axes.
            assert reducer.stacked_axes(a, axis) == ("data", "fsdp")

    params = _put_params(mesh, helpers.mesh_mlp_params())
    if not eager_init:  # tx.init off the mesh context: plain, stacked later
        with jax.set_mesh(mesh):
            check_stacked(jax.jit(tx.init)(params)[0].acc)
    data = _make_data(K * WINDOWS)
    params, state = _run(tx, mesh, data, eager_init, axis=axis)
    want = _reference(optax.adam(0.05), helpers.mesh_mlp_params(), *data)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, params), want, **TOL)
    assert int(state[0].gradient_step) == WINDOWS
    check_stacked(state[0].acc)
    _same_sharding(params, _put_params(mesh, helpers.mesh_mlp_params()))


def test_hlo_plain_gather_reduces_every_micro_batch():
    """The trap behind the issue's first probe: a forward that gathers the
    reduced weight with ``jax.reshard(w, P(None, None))`` drops its reduced
    type; the gradient still *types* as {U:data}, but the backward pass has
    all-reduced it over 'data' already (the transposed cast then zeroes all
    but one copy). Kept as evidence of why loss_fn must keep the reduced
    axes (docs/scaling.md)."""
    mesh = _mesh("data2xfsdp4")

    def loss(params, x, y, mask):
        w1 = jax.reshard(params["w1"], P(None, None))
        h = jnp.tanh(x @ w1)
        w2 = jax.reshard(params["w2"], P(None, None))
        return (mask * ((h @ w2 - y) ** 2).mean(-1)).sum() / mask.sum()

    def grads(params, x, y, mask):
        g = oa.unreduced_value_and_grad(loss, "data")(params, x, y, mask)[1]
        return g["w1"], g["w2"]

    with jax.set_mesh(mesh):
        params = _put_params(mesh, helpers.mesh_mlp_params())
        batch = _put_batch(mesh, *(a[0] for a in _make_data(1)))
        g = jax.jit(grads)(params, *batch)
        text = jax.jit(grads).lower(params, *batch).compile().as_text()
    assert all(x.sharding.spec.unreduced == {"data"} for x in g)
    per_step = collectives.over(
        collectives.collective_census(text, mesh), "data"
    )
    w_bytes = 4 * (D_IN * HIDDEN + HIDDEN * D_OUT)
    assert any(
        o["op"] == "all-reduce" and o["bytes"] >= w_bytes // 2 for o in per_step
    ), per_step


def test_accumulator_per_device_bytes_are_tree_over_fsdp():
    """data=2 x fsdp=4: each device holds 1/4 of every fsdp-sharded leaf of
    the accumulator (and of Adam's moments), never a gathered copy."""
    mesh = _mesh("data2xfsdp4")
    tx = oa.chain(oa.accumulate(K, axis_name="data"), optax.adam(0.1))
    _, state = _run(tx, mesh, _make_data(K))
    acc = state[0].acc
    for name in ("w1", "w2"):
        assert (
            _shard_bytes(acc[name]) * 4
            == np.asarray(helpers.mesh_mlp_params()[name]).nbytes
        )
        assert (
            _shard_bytes(state[1][0].mu[name]) * 4
            == np.asarray(helpers.mesh_mlp_params()[name]).nbytes
        )
    assert _shard_bytes(acc["b1"]) == 4 * HIDDEN  # replicated like b1


# ------------------------------------------------- non-finite micro-batches


@pytest.mark.parametrize("mesh_name", [*MESHES, *ONE_DEVICE])
def test_skip_nonfinite_one_device_skips_everywhere(mesh_name):
    """A NaN in one data shard's partial gradient drops the micro-batch on
    every device: equals the reference without that micro-batch (on a
    mesh of size-1 axes too)."""
    mesh = _mesh(mesh_name)
    data = _make_data(K * WINDOWS + 1)
    bad = 2
    data = _nan_on_one_device(data, bad)
    tx = oa.chain(
        oa.accumulate(K, axis_name="data", skip_nonfinite=True),
        optax.adam(0.05),
    )
    params, state = _run(tx, mesh, data)
    keep = [t for t in range(K * WINDOWS + 1) if t != bad]
    want = _reference(
        optax.adam(0.05), helpers.mesh_mlp_params(), *(a[keep] for a in data)
    )
    chex.assert_trees_all_close(jax.tree.map(np.asarray, params), want, **TOL)
    assert int(state[0].gradient_step) == WINDOWS


@pytest.mark.parametrize("mesh_name", ["data2xfsdp4", *ONE_DEVICE])
def test_dynamic_loss_scale_axis_name_agrees_across_devices(mesh_name):
    """dynamic_loss_scale(axis_name='data') before the accumulation, with
    unreduced gradients of the scaled loss: the NaN micro-batch is dropped
    everywhere, the scale halves once, the rest equals the reference (on a
    mesh of size-1 axes too)."""
    mesh = _mesh(mesh_name)
    data = _nan_on_one_device(_make_data(K * WINDOWS + 1), 1)
    tx = oa.chain(
        oa.dynamic_loss_scale(2.0**8, axis_name="data"),
        oa.accumulate(K, axis_name="data"),
        optax.sgd(0.3),
    )

    with jax.set_mesh(mesh):
        params = _put_params(mesh, helpers.mesh_mlp_params())
        state = jax.jit(tx.init)(params)
        jstep = _scaled_step(tx, mesh)
        for t in range(len(data[0])):
            params, state = jstep(
                params, state, *_put_batch(mesh, *(a[t] for a in data))
            )
    keep = [t for t in range(K * WINDOWS + 1) if t != 1]
    want = _reference(
        optax.sgd(0.3), helpers.mesh_mlp_params(), *(a[keep] for a in data)
    )
    chex.assert_trees_all_close(
        jax.tree.map(np.asarray, params), want, rtol=1e-4, atol=1e-5
    )
    assert float(oa.loss_scale(state)) == 2.0**7
    assert int(state[1].gradient_step) == WINDOWS


# ----------------------------------------------------------- state helpers


def test_state_shardings_explicit_and_auto():
    """oa.state_shardings: Adam's moments get the params' shardings, the
    accumulator the params' sharding, stacked over the named axis (explicit
    mesh) or the params' (auto mesh), counters are replicated; usable as
    jax.jit(tx.init)'s out_shardings."""
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh(
            (2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2
        )
        with jax.set_mesh(mesh):
            params = _put_params(mesh, helpers.mesh_mlp_params())
            axis = "data" if axis_type == AxisType.Explicit else None
            tx = oa.chain(oa.accumulate(K, axis_name=axis), optax.adam(0.1))
            shardings = oa.state_shardings(tx, params)
            state = jax.jit(tx.init, out_shardings=shardings)(params)
        _same_sharding(state[1][0].mu, params)
        assert shardings[0].mini_step.spec == P()
        if axis:
            _check_stacked(state[0].acc, mesh)
            continue
        _same_sharding(state[0].acc, params)


def test_map_accumulators_per_device_leaves():
    tx = oa.chain(oa.accumulate(2, axis_name="d"), optax.adam(0.1))
    state = oa.map_accumulators(
        tx.init(helpers.mesh_mlp_params()),
        lambda a: jnp.broadcast_to(a, (3, *a.shape)),
    )
    assert state[0].acc["w1"].shape == (3, D_IN, HIDDEN)
    assert state[0].weight.shape == (3,)
    assert state[0].mini_step.shape == ()
    assert state[1][0].mu["w1"].shape == (D_IN, HIDDEN)


def test_unreduced_value_and_grad_bad_input():
    with pytest.raises(TypeError, match="axis_name"):
        oa.unreduced_value_and_grad(lambda p: p, None)
    f = oa.unreduced_value_and_grad(lambda p: jnp.sum(p), "data")
    with pytest.raises(ValueError, match="Explicit"):
        f(jnp.ones(3))  # no mesh


# ------------------------------------------------------- the benchmark B4


def _run_from_root(script, *args):
    """``python script *args`` from the repository root in a fresh process
    on the CPU, with no XLA_FLAGS (the script picks its own device count)."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, script, *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


OURS_B4 = "oa.unreduced_value_and_grad"


@pytest.mark.slow
def test_bench_mesh_tiny():
    """B4 on toy sizes, in its own process: per window, one call reduces
    the gradient over 'data' (one op) against K for the naive jit step, on
    both meshes; the accumulator is tree / fsdp per device; with
    shard_update a reduce-scatter and an all-gather instead of the
    all-reduce, and Adam's state divided by the data size."""
    import json

    proc = _run_from_root("benchmarks/bench_mesh.py", "--tiny", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for mesh_name, r in res["results"].items():
        ours = r["census"][OURS_B4]
        naive = r["census"]["naive jit"]
        assert ours["data_grad_calls"] == 1 and ours["data_grad_ops"] == 1
        assert ours["top_data_grad_ops"] == 0
        assert naive["data_grad_calls"] == res["k"], (mesh_name, naive)
        fsdp = 4 if "fsdp" in mesh_name else 1
        assert (
            r["acc_bytes"]["oa.unreduced_value_and_grad"] * fsdp
            == (r["tree_bytes"])
        )
        # FSDP's own bytes: all-gather + reduce-scatter.
        assert ours["micro_step_trees"] <= 1 + 1 / fsdp, ours
        assert ours["all_bytes"] < naive["all_bytes"], (ours, naive)
    both = res["results"]["data=2 x fsdp=4"]["census"][
        'unreduced over ("data", "fsdp")'
    ]
    assert both["top_grad_reductions"] == 0 and both["data_grad_calls"] == 1
    for mesh_name, data in (("data=2 x fsdp=4", 2), ("data=8", 8)):
        r = res["results"][mesh_name]
        kinds = r["census"]["shard_update=True"]["data_grad_kinds"]
        shard = r["tree_bytes"] // (4 if "fsdp" in mesh_name else 1)
        assert kinds == {"reduce-scatter": shard // data, "all-gather": shard}
        opt = r["opt_bytes"]
        assert opt["shard_update=True"] * data <= opt[OURS_B4] + 64, opt
    assert len(res["rows"]) == 7


@pytest.mark.slow
def test_example_fsdp_runs_on_8_cpu_devices():
    proc = _run_from_root("examples/fsdp.py", "--steps", "8", "--accum", "4")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    import re

    naive = re.search(r"naive jit +(\d+) ops", out)
    ours = re.search(r"oa.unreduced_value_and_grad +(\d+) ops", out)
    assert naive and int(naive[1]) >= 4, out  # every micro-step
    assert ours and int(ours[1]) == 1, out
    assert "optimizer steps 2" in out, out
    assert "stacked over data" in out and "@data" in out, out
    # In-step, 4 micro-batches: held, each of the 3 weights is gathered and
    # reduce-scattered once per step, nothing in the loop.
    held = re.search(
        r"gather_once +all-gather (\d+) \((\d+) in the loop\), "
        r"reduce-scatter (\d+) \((\d+) in the loop\)",
        out,
    )
    assert held and held.groups() == ("3", "0", "3", "0"), out


# ------------------------------------------------- two processes (gloo)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", ["_mesh_worker.py", "_mesh_worker_shard_update.py"]
)
def test_two_processes_one_mesh_match_single_process(tmp_path, script):
    """Two jax.distributed processes x 4 CPU devices, one explicit
    data=2 x fsdp=4 mesh spanning both, unreduced gradients weighted by
    token counts, several windows: the params equal a single-process
    big-batch run on the same global batches; also with
    ``shard_update=True`` (Adam's state sharded over data and fsdp)."""
    worker = workers.load("_mesh_worker")

    out = workers.run_two_processes(tmp_path, script)
    x, y, mask = worker.make_data(worker.WINDOWS * worker.K)
    opt = optax.adam(worker.LEARNING_RATE)
    params = helpers.mesh_mlp_params(worker.D_IN, worker.HIDDEN, worker.D_OUT)
    state = opt.init(params)

    def window_loss(p, x, y, mask):
        return (mask * worker.per_example(p, x, y)).sum() / mask.sum()

    for t in range(0, len(x), worker.K):
        window = slice(t, t + worker.K)
        g = jax.grad(window_loss)(params, x[window], y[window], mask[window])
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(np.load(out), worker.flatten(params), **TOL)


# ------------------------------------------ in-step microbatching, BatchNorm


def test_microbatched_unreduced_value_and_grad_under_mesh():
    """unreduced_value_and_grad wrapping microbatched_value_and_grad (4
    interleaved micro-batches, token weights): equals jax.value_and_grad
    on one device; the gradients stay unreduced over 'data' through the
    scan; the compiled step has no all-to-all and no data-axis gradient
    reduction (only scalars)."""
    import functools

    mesh = _mesh("data2xfsdp4")
    batch_axes = _batch_axes(mesh)
    x, y, mask = (np.concatenate(a[:2]) for a in _make_data(2))

    def loss(params, batch):
        x, y, mask = batch
        per = _per_example(params, x, y, batch_axes)
        return (mask * per).sum() / jnp.maximum(mask.sum(), 1.0)

    micro = functools.partial(
        oa.microbatched_value_and_grad,
        num_microbatches=4,
        interleave=True,
        weight_fn=lambda batch: batch[2].sum(),
    )
    f = oa.unreduced_value_and_grad(loss, "data", value_and_grad=micro)

    def step(params, batch):
        value, grads = f(params, batch)
        assert all(
            jax.typeof(g).sharding.spec.unreduced == {"data"}
            for g in jax.tree.leaves(grads)
        )
        reduced = jax.tree.map(
            lambda g: jax.reshard(
                g, sharding.without_unreduced(jax.typeof(g).sharding.spec)
            ),
            grads,
        )
        return value, reduced

    with jax.set_mesh(mesh):
        params = _put_params(mesh, helpers.mesh_mlp_params())
        batch = tuple(_put_batch(mesh, x, y, mask))
        value, grads = jax.jit(step)(params, batch)
        ops = oa.collective_census(
            jax.jit(lambda p, b: f(p, b)).lower(params, batch).compile(), mesh
        )
    want_value, want = jax.value_and_grad(_loss(None))(
        helpers.mesh_mlp_params(), x, y, mask
    )
    chex.assert_trees_all_close(grads, want, **TOL)
    np.testing.assert_allclose(value, want_value, **TOL)
    assert not [o for o in ops if o["op"] == "all-to-all"], ops
    data_grads = [o for o in collectives.over(ops, "data") if o["bytes"] > 64]
    assert not data_grads, ops


def test_accum_batch_norm_under_mesh():
    """AccumBatchNorm(accum_steps=2) in a loss differentiated with
    unreduced_value_and_grad on the data=8 mesh (its scale and bias cast
    back to plain, as elementwise ops need): the running statistics equal
    nn.BatchNorm's on the concatenated window, and each micro-batch's
    gradients, unreduced over 'data', equal jax.grad on one device."""
    import flax.linen as nn

    from optaxaccum.flax import AccumBatchNorm

    class Model(nn.Module):
        norm: type = AccumBatchNorm
        accum: bool = True

        @nn.compact
        def __call__(self, x, train):
            kw = {"accum_steps": 2} if self.accum else {}
            x = self.norm(use_running_average=not train, momentum=0.9, **kw)(x)
            return jnp.tanh(x).sum(-1)

    def plain(tree):  # drop the reduced axes: elementwise ops need it
        return jax.tree.map(
            lambda p: jax.reshard(
                p, jax.typeof(p).sharding.spec.update(reduced=frozenset())
            ),
            tree,
        )

    model = Model()

    def loss(params, stats, x):
        out, new = model.apply(
            {"params": plain(params), "batch_stats": stats},
            x,
            train=True,
            mutable=["batch_stats"],
        )
        return jnp.mean(out**2), new["batch_stats"]

    def reduce(tree):
        return jax.tree.map(
            lambda g: jax.reshard(
                g, sharding.without_unreduced(jax.typeof(g).sharding.spec)
            ),
            tree,
        )

    def step(params, stats, x):
        (_, stats), grads = oa.unreduced_value_and_grad(
            loss, "data", has_aux=True
        )(params, stats, x)
        types = jax.tree.leaves(jax.tree.map(jax.typeof, grads))
        assert all(t.sharding.spec.unreduced == {"data"} for t in types)
        return stats, reduce(grads)

    xs = np.random.default_rng(0).normal(size=(2, 16, 4)).astype(np.float32)
    mesh = _mesh("data8")
    with jax.set_mesh(mesh):
        put = lambda a: jax.device_put(a, P("data", None))  # noqa: E731
        variables = jax.jit(
            lambda x: model.init(jax.random.key(0), x, train=False)
        )(put(xs[0]))
        stats = variables["batch_stats"]
        for x in xs:
            stats, grads = jax.jit(step)(variables["params"], stats, put(x))
    single = jax.tree.map(np.asarray, variables)
    want = jax.grad(lambda p: loss(p, single["batch_stats"], xs[1])[0])
    with jax.set_mesh(
        jax.make_mesh(
            (1,),
            ("data",),
            devices=jax.devices()[:1],
            axis_types=(AxisType.Explicit,),
        )
    ):
        ref_grads = jax.jit(want)(single["params"])
    chex.assert_trees_all_close(grads, ref_grads, **TOL)
    ref = Model(norm=nn.BatchNorm, accum=False)
    ref_vars = ref.init(jax.random.key(0), xs[0], train=False)
    _, new = ref.apply(
        ref_vars, xs.reshape(-1, 4), train=True, mutable=["batch_stats"]
    )
    got = stats["AccumBatchNorm_0"]
    for name in ("mean", "var"):
        np.testing.assert_allclose(
            got[name], new["batch_stats"]["BatchNorm_0"][name], **TOL
        )


def test_plan_microbatches_counts_per_device_for_sharded_args():
    """plan_microbatches compiles for the arguments' shardings, so with a
    batch sharded over 8 devices it plans against one device's memory: a
    budget that the sharded step fits whole does not fit the same step on
    one device whole (it needs a split, or none fits: how far splitting
    saves memory is the compiler's)."""
    mesh = _mesh("data8")

    def loss_fn(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    def shapes(sharded):
        def spec(s):
            return NamedSharding(mesh, s) if sharded else None

        return (
            jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=spec(P())),
            jax.ShapeDtypeStruct(
                (512, 256), jnp.float32, sharding=spec(P("data", None))
            ),
        )

    with jax.set_mesh(mesh):
        per_device = oa.microbatched_step_memory(
            loss_fn, *shapes(True), num_microbatches=1, interleave=True
        )
        whole = oa.microbatched_step_memory(
            loss_fn, *shapes(False), num_microbatches=1, interleave=True
        )
        x_bytes = 512 * 256 * 4
        assert per_device + x_bytes * 7 // 8 <= whole
        n = oa.plan_microbatches(
            loss_fn, *shapes(True), memory_budget=per_device, interleave=True
        )
        assert n == 1
        try:
            n_whole = oa.plan_microbatches(
                loss_fn,
                *shapes(False),
                memory_budget=per_device,
                interleave=True,
            )
        except ValueError as e:
            assert "budget" in str(e), e
        else:
            assert n_whole > 1
            assert (
                oa.microbatched_step_memory(
                    loss_fn,
                    *shapes(False),
                    num_microbatches=n_whole,
                    interleave=True,
                )
                <= per_device
            )


# ----------------------------------------------------------- checkpoints


def _ckpt_tx(k):
    return oa.chain(
        oa.dynamic_loss_scale(2.0**8, axis_name="data"),
        oa.accumulate(k, axis_name="data", skip_nonfinite=True),
        optax.adam(0.05),
    )


@pytest.mark.parametrize("k,before,after", [(4, 6, 2), (3, 6, 3)])
def test_checkpoint_round_trip_mid_window_and_boundary(
    tmp_path, k, before, after
):
    """After ``before`` micro-steps of the documented mesh loop
    (mid-window for k=4, at a boundary for k=3), the state leaves the
    device (jax.device_get), saves with orbax and restores into
    jax.eval_shape(tx.init, params) with oa.state_shardings; the restored
    run equals the uninterrupted one and single-device Adam on the
    concatenated windows. Each device's partial sum survives the trip."""
    import orbax.checkpoint as ocp

    mesh = _mesh("data2xfsdp4")
    tx = _ckpt_tx(k)
    data = _make_data(before + after)
    step = _scaled_step(tx, mesh)

    def feed(params, state, ts):
        for t in ts:
            batch = _put_batch(mesh, *(a[t] for a in data))
            params, state = step(params, state, *batch)
        return params, state

    with jax.set_mesh(mesh):
        params = _put_params(mesh, helpers.mesh_mlp_params())
        shardings = oa.state_shardings(tx, params)
        state = jax.device_put(tx.init(params), shardings)
        params, state = feed(params, state, range(before))
        state = jax.jit(lambda s: s, out_shardings=shardings)(state)
        host = jax.device_get(state)
        abstract = jax.eval_shape(tx.init, params)
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp_path / "state", state)
            ckpt.wait_until_finished()
            target = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(
                    s.shape, s.dtype, sharding=sh
                ),
                abstract,
                shardings,
            )
            restored = ckpt.restore(tmp_path / "state", target)
        chex.assert_trees_all_equal(jax.device_get(restored), host)
        _check_stacked(restored[1].acc, mesh)
        if before % k:  # mid-window: the two data rows are two partial sums
            rows = host[1].acc["w1"]
            assert rows.shape[0] == 2 and not np.allclose(rows[0], rows[1])
        resumed, _ = feed(params, restored, range(before, before + after))
        uninterrupted, _ = feed(params, state, range(before, before + after))
    chex.assert_trees_all_close(
        jax.device_get(resumed), jax.device_get(uninterrupted), **TOL
    )
    windows = (before + after) // k
    want = _reference(
        optax.adam(0.05),
        helpers.mesh_mlp_params(),
        *(a[: windows * k] for a in data),
        k=k,
    )
    chex.assert_trees_all_close(jax.device_get(resumed), want, **TOL)


# -------------------------------------------------------- named mistakes


def _one_step(tx, mesh, vg):
    """One jitted step of ``tx`` with the gradients of ``vg`` (a
    value_and_grad of the mesh loss)."""
    with jax.set_mesh(mesh):
        params = _put_params(mesh, helpers.mesh_mlp_params())
        state = jax.jit(tx.init)(params)
        batch = _put_batch(mesh, *(a[0] for a in _make_data(1)))

        def step(params, state, *batch):
            _, grads = vg(_loss(_batch_axes(mesh)))(params, *batch)
            return oa.apply_gradients(tx, grads, state, params)

        return jax.jit(step)(params, state, *batch)


@pytest.mark.parametrize("where", ["accumulate", "loss_scale", "grad"])
def test_axis_name_not_a_mesh_axis_is_named(where):
    """'dp' on a ('data', 'fsdp') mesh raises ValueError naming
    'dp' and the mesh's axes, not JAX's NameError about shard_map."""
    mesh = _mesh("data2xfsdp4")
    bad = "dp"
    tx = oa.chain(
        oa.dynamic_loss_scale(axis_name=bad if where == "loss_scale" else None),
        oa.accumulate(K, axis_name=bad if where == "accumulate" else "data"),
        optax.sgd(0.1),
    )
    axis = bad if where == "grad" else "data"
    with pytest.raises(ValueError, match=r"'dp'.*\('data', 'fsdp'\)"):
        _one_step(tx, mesh, lambda f: oa.unreduced_value_and_grad(f, axis))


def test_unreduced_gradients_without_axis_name_are_named():
    """Unreduced gradients reaching an accumulate that does not
    name their axis raise ValueError naming axis_name and 'data'."""
    mesh = _mesh("data2xfsdp4")
    tx = oa.chain(oa.accumulate(K), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"axis_name.*'data'"):
        _one_step(tx, mesh, lambda f: oa.unreduced_value_and_grad(f, "data"))


def test_reduced_gradients_with_axis_name_warn_once():
    """Jax.value_and_grad (gradients reduced on every micro-step)
    with accumulate(axis_name='data') on an explicit mesh is correct but
    warns, once, naming oa.unreduced_value_and_grad."""
    from optaxaccum._src import sharding

    sharding._WARNED.clear()  # once per process: start afresh
    mesh = _mesh("data8")
    tx = oa.chain(oa.accumulate(K, axis_name="data"), optax.sgd(0.1))
    with pytest.warns(UserWarning, match="oa.unreduced_value_and_grad") as got:
        _one_step(tx, mesh, jax.value_and_grad)
        _one_step(tx, mesh, jax.value_and_grad)  # traced again: no repeat
    assert len(got) == 1, [str(w.message) for w in got]


def test_fsdp_gather_bad_axes():
    mesh = _mesh("data2xfsdp4")
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((8, 4)), P("fsdp", None))
        with pytest.raises(ValueError, match=r"'dp'.*\('data', 'fsdp'\)"):
            oa.fsdp_gather(w, "dp")
        with pytest.raises(ValueError, match=r"\['fsdp'\].*batch_axes='data'"):
            oa.fsdp_gather(w, "data")


def test_docs_scaling_first_step_runs_as_written(capsys):
    """The first step of docs/scaling.md's jit section, exactly
    as written (its first Python block there), runs on the 8 CPU devices
    and closes two windows."""
    import pathlib

    text = (
        pathlib.Path(__file__).resolve().parent.parent / "docs" / "scaling.md"
    ).read_text()
    section = text[text.index("## `jax.jit` on an explicit mesh") :]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "def loss_fn" in block and "Every mesh axis that shards" in block
    exec(compile(block, "docs/scaling.md", "exec"), {})  # noqa: S102
    assert capsys.readouterr().out.split()[-1] == "2"


def test_unreduced_value_and_grad_tuple_argnums_all_unreduced():
    """With ``argnums=(0, 1)`` every differentiated
    argument's gradient comes back unreduced over 'data' (a version that
    converts only the first one passed the suite), with jax.grad's values."""
    mesh = _mesh("data8")

    def loss(w, b, x):  # two weights of a tiny MLP
        return jnp.mean((jnp.tanh(x @ w) @ b) ** 2)

    w0, b0 = jnp.arange(6.0).reshape(3, 2) / 6, jnp.array([0.5, -1.0])
    x0 = jnp.arange(24.0).reshape(8, 3) / 24
    seen = {}

    def f(w, b, x):
        value, grads = oa.unreduced_value_and_grad(
            loss, "data", argnums=(0, 1)
        )(w, b, x)
        seen["types"] = jax.tree.map(jax.typeof, grads)
        return value, jax.tree.map(lambda g: jax.reshard(g, P()), grads)

    with jax.set_mesh(mesh):
        w, b = jax.device_put(w0, P()), jax.device_put(b0, P())
        x = jax.device_put(x0, P("data", None))
        value, grads = jax.jit(f)(w, b, x)
    assert len(seen["types"]) == 2
    for t in seen["types"]:
        assert t.sharding.spec.unreduced == {"data"}, t
    want_value, want = jax.value_and_grad(loss, argnums=(0, 1))(w0, b0, x0)
    chex.assert_trees_all_close(grads, want, **TOL)
    np.testing.assert_allclose(value, want_value, **TOL)


def test_window_emits_reduced_gradients_on_an_explicit_mesh():
    """The closing window reduces the
    unreduced accumulator once, so what it emits is not unreduced (checked
    on the traced types, before anything could fail on them), with the
    values of the global window sum. ``reduction="sum"``: no scaling, so a
    missing reduction would otherwise go unnoticed."""
    mesh = _mesh("data8")

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    w0 = jnp.arange(6.0).reshape(3, 2) / 6
    xs = [jnp.arange(24.0).reshape(8, 3) / (24 * (i + 1)) for i in range(2)]
    tx = oa.accumulate(2, reduction="sum", axis_name="data")
    seen = []

    def step(w, state, x):
        _, g = oa.unreduced_value_and_grad(loss, "data")(w, x)
        u, state = tx.update(g, state, w)
        seen.append(jax.typeof(u))
        return jax.reshard(u, P()), state

    with jax.set_mesh(mesh):
        w = jax.device_put(w0, P())
        state = tx.init(w)
        step = jax.jit(step)
        for x in xs:
            u, state = step(w, state, jax.device_put(x, P("data", None)))
    assert seen and all(not t.sharding.spec.unreduced for t in seen), seen
    want = sum(jax.grad(loss)(w0, x) for x in xs)
    np.testing.assert_allclose(u, want, **TOL)


def test_fsdp_gather_of_an_array_not_on_a_mesh_is_named():
    """An array on no mesh (eager, or traced without jax.set_mesh), with or
    without batch_axes: ValueError saying that w is not sharded on a mesh,
    not a TypeError about an axis_name=() never passed."""
    w = jnp.ones((8, 4))
    for call in (
        lambda: oa.fsdp_gather(w),
        lambda: oa.fsdp_gather(w, "data"),
        lambda: jax.jit(oa.fsdp_gather)(w),
    ):
        with pytest.raises(Exception) as e:  # noqa: PT011 (checked below)
            call()
        assert isinstance(e.value, ValueError), repr(e.value)
        assert "w is not sharded on a mesh" in str(e.value), e.value
        assert "axis_name" not in str(e.value)


def test_fsdp_gather_keeps_the_weights_own_reduced_axes():
    """oa.fsdp_gather(w, "fsdp") of a weight reduced over "data" (as
    oa.unreduced_value_and_grad(..., "data") casts it) stays reduced over
    "data" as well as "fsdp" (dropping it would make its gradient an
    all-reduced one inside the backward pass), with w's values."""
    mesh = _mesh("data2xfsdp4")
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(w, P("fsdp", None))
        types = []

        def gather(w):
            w = jax.reshard(w, P("fsdp", None, reduced={"data"}))
            full = oa.fsdp_gather(w, "fsdp")
            types.append(jax.typeof(full))
            return jax.reshard(full, P(None, None))

        out = jax.jit(gather)(sharded)
    assert types[0].sharding.spec.reduced == {"data", "fsdp"}, types[0]
    np.testing.assert_array_equal(np.asarray(out), w)


# ------------------------------------------ meshes of one device


def _one_device_mesh(shape):
    names = ("data", "fsdp")[: len(shape)]
    return jax.make_mesh(
        shape,
        names,
        axis_types=(AxisType.Explicit,) * len(shape),
        devices=jax.devices()[: int(np.prod(shape))],
    )


@pytest.mark.parametrize(
    "shape,kwargs",
    [
        ((1, 1), {}),
        ((1, 1), {"noise_scale_decay": 0.9}),
        ((1, 1), {"shard_update": True}),
        ((1,), {}),
        ((2, 1), {"shard_update": True}),
        ((1, 2), {"noise_scale_decay": 0.9}),
    ],
)
def test_mesh_of_one_device_steps_like_the_big_batch(shape, kwargs):
    """A run on a mesh whose axes all have size 1 (a run resumed on one
    device) takes the jit-mesh step of docs/scaling.md (oa.fsdp_gather,
    oa.unreduced_value_and_grad, the stacked accumulator, the noise scale's
    sums, shard_update's scatter) and gives Adam on each window's whole
    batch; so do meshes of two devices with one axis of size 1. JAX inlines a shard_map over such a mesh and rejected its
    unreduced outputs (AssertionError: Expected last op to be
    sdy.sharding_constraint), on jax 0.10 and later."""
    mesh = _one_device_mesh(shape)
    data = _make_data(K * WINDOWS)
    opt = optax.adam(0.05)
    tx = oa.chain(oa.accumulate(K, axis_name="data", **kwargs), opt)
    params, state = _run(tx, mesh, data)
    want = _reference(opt, helpers.mesh_mlp_params(), *data)
    chex.assert_trees_all_close(jax.device_get(params), want, **TOL)
    assert int(state[0].gradient_step) == WINDOWS


def test_reshard_state_onto_one_device_mesh_resumes():
    """docs/scaling.md's resumed run on one device: the state of a
    data=2 x fsdp=4 run, mid-window, resharded onto a (1, 1) mesh, steps
    on; the result is that of the run that never moved."""
    data = _make_data(K * WINDOWS)
    opt = optax.adam(0.05)
    tx = oa.chain(oa.accumulate(K, axis_name="data"), opt)
    first = [a[: K + 1] for a in data]  # one window and one micro-batch
    params, state = _run(tx, _mesh("data2xfsdp4"), first)
    saved = jax.device_get((params, state))
    mesh = _one_device_mesh((1, 1))
    with jax.set_mesh(mesh):
        params = _put_params(mesh, saved[0])
        state = oa.reshard_state(tx, saved[1], params)
        step = jax.jit(_step_fn(tx, mesh), donate_argnums=(0, 1))
        for t in range(K + 1, K * WINDOWS):
            micro = _put_batch(mesh, *(a[t] for a in data))
            params, state, _ = step(params, state, *micro)
    want = _reference(opt, helpers.mesh_mlp_params(), *data)
    chex.assert_trees_all_close(jax.device_get(params), want, **TOL)


@pytest.mark.parametrize("where", ["accumulate", "skip", "loss_scale", "flush"])
@pytest.mark.parametrize("jit", [False, True])
def test_axis_name_without_mesh_or_map_says_what_to_change(where, jit):
    """A chain built with axis_name='data' stepped under plain jax.jit (or
    eagerly) with no mesh and no pmap/shard_map (a run resumed on one
    device) raises ValueError naming axis_name and saying what to change,
    not JAX's raw NameError 'Found an unbound axis name'."""
    tx = oa.chain(
        oa.dynamic_loss_scale(
            axis_name="data" if where == "loss_scale" else None
        ),
        oa.accumulate(
            2,
            axis_name=None if where == "loss_scale" else "data",
            skip_nonfinite=where == "skip",
        ),
        optax.sgd(0.1),
    )
    params = jnp.ones(3)
    state = tx.init(params)
    if where == "flush":
        run = lambda s, p: oa.flush(tx, s, p)  # noqa: E731
    else:
        run = lambda s, p: oa.apply_gradients(tx, jnp.ones(3), s, p)  # noqa: E731
    run = jax.jit(run) if jit else run
    with pytest.raises(ValueError, match=r"axis_name='data'.*no mesh.*drop"):
        run(state, params)
