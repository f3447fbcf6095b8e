"""Gather once per step: ``oa.microbatched_value_and_grad(...,
gather_once=oa.GatherOnce(...))`` on ``data=2 x fsdp=4`` and
``replica=2 x fsdp=4`` meshes of the 8 CPU devices conftest.py gives.

References: the per-micro-batch path (``gather_once=None``) and
``jax.value_and_grad`` of the whole batch on one device. The collective
census reads the compiled step's HLO: which collectives run inside the
scan's ``while`` loop (once per micro-batch) and which once per step.
XLA:CPU hoists the per-micro-batch all-gathers of the default path out of
the loop on its own (loop-invariant code motion); its reduce-scatters stay
inside, and those are what holding moves out.
"""

import dataclasses
import functools

import chex
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from optaxaccum._src import sharding
from tests import helpers

pytestmark = pytest.mark.devices(8)

D_IN, HIDDEN, D_OUT = 8, 16, 2  # weights of distinct sizes
BATCH = 64
TOL = dict(rtol=2e-5, atol=2e-6)
# (mesh shape, axis names, the fsdp-sharded weights' dimension entry)
MESHES = {
    "data2xfsdp4": ((2, 4), ("data", "fsdp"), "fsdp"),
    "replica2xfsdp4": ((2, 4), ("replica", "fsdp"), ("fsdp", "replica")),
}
# A mesh whose axes all have size 1: a run resumed on one device.
ONE_DEVICE = {"one1x1": ((1, 1), ("data", "fsdp"), "fsdp")}
# Data parallelism alone (fsdp=1), as a run resumed on data=8.
NO_FSDP = {"data8xfsdp1": ((8, 1), ("data", "fsdp"), "fsdp")}
ALL_MESHES = {**MESHES, **ONE_DEVICE, **NO_FSDP}
W_BYTES = {"w1": 4 * D_IN * HIDDEN, "w2": 4 * HIDDEN * D_OUT}


def _mesh(name):
    shape, names, _ = ALL_MESHES[name]
    return jax.make_mesh(
        shape,
        names,
        axis_types=(AxisType.Explicit,) * 2,
        devices=jax.devices()[: int(np.prod(shape))],
    )


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(BATCH, D_OUT)).astype(np.float32)
    mask = (rng.random(BATCH) < 0.7).astype(np.float32)
    mask[:2] = 1.0
    return x, y, mask


def _loss(axes):
    """Per-token mean squared error; ``axes=None``: one device, else the
    weights gathered with oa.fsdp_gather over the batch axes ``axes``."""

    def gather(w):
        return w if axes is None else oa.fsdp_gather(w, axes)

    def loss(params, batch):
        x, y, mask = batch
        h = x @ gather(params["w1"])
        b = jnp.broadcast_to(gather(params["b1"]), h.shape)
        if axes is not None:
            b = jax.reshard(b, jax.typeof(h).sharding.spec)
        h = jnp.tanh(h + b)
        per = ((h @ gather(params["w2"]) - y) ** 2).mean(-1)
        return (mask * per).sum() / jnp.maximum(mask.sum(), 1.0)

    return loss


def _put(mesh_name, params, batch):
    mesh = _mesh(mesh_name)
    entry = ALL_MESHES[mesh_name][2]
    specs = {"w1": P(entry, None), "b1": P(), "w2": P(entry, None)}
    params = {
        k: jax.device_put(v, NamedSharding(mesh, specs[k]))
        for k, v in params.items()
    }
    rows = NamedSharding(mesh, P(mesh.axis_names))
    return params, tuple(jax.device_put(a, rows) for a in batch)


def _grad_fn(mesh_name, k, gather_once, unreduced=True):
    """The step's value_and_grad: on data x fsdp wrapped in
    oa.unreduced_value_and_grad(..., "data") (the window's deferred
    reduction), token-weighted, interleaved micro-batches."""
    axes = ALL_MESHES[mesh_name][1]
    micro = functools.partial(
        oa.microbatched_value_and_grad,
        num_microbatches=k,
        interleave=True,
        weight_fn=lambda batch: batch[2].sum(),
        gather_once=gather_once,
    )
    if unreduced and "data" in axes:
        return oa.unreduced_value_and_grad(
            _loss(axes), "data", value_and_grad=micro
        )
    return micro(_loss(axes))


def _reduced(g):
    """``g`` summed over the axes it is unreduced over (for comparing)."""
    return jax.reshard(
        g, sharding.without_unreduced(jax.typeof(g).sharding.spec)
    )


def _run(mesh_name, k, gather_once, params=None, batch=None):
    """(loss, reduced grads as numpy, grads' types) of one jitted step."""
    mesh = _mesh(mesh_name)
    f = _grad_fn(mesh_name, k, gather_once)
    types = {}

    def step(p, b):
        value, grads = f(p, b)
        types.update(jax.tree.map(jax.typeof, grads))
        return value, jax.tree.map(_reduced, grads)

    with jax.set_mesh(mesh):
        p, b = _put(
            mesh_name,
            params or helpers.mesh_mlp_params(D_IN, HIDDEN, D_OUT),
            batch or _data(),
        )
        value, grads = jax.jit(step)(p, b)
    return float(value), jax.tree.map(np.asarray, grads), types


def _census(mesh_name, k, gather_once, unreduced=True):
    """The compiled step's collectives (its gradients left unreduced) and
    its per-device memory (argument + output - alias + temp bytes)."""
    mesh = _mesh(mesh_name)
    f = _grad_fn(mesh_name, k, gather_once, unreduced)
    with jax.set_mesh(mesh):
        p, b = _put(
            mesh_name, helpers.mesh_mlp_params(D_IN, HIDDEN, D_OUT), _data()
        )
        compiled = jax.jit(f).lower(p, b).compile()
    m = compiled.memory_analysis()
    memory = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    return oa.collective_census(compiled, mesh), memory


def _of_weight(ops, name, op, *, loop):
    """The census entries of ``op`` carrying weight ``name`` (its whole
    bytes for an all-gather, a shard of it for a reduce-scatter)."""
    full = W_BYTES[name]
    sizes = {"all-gather": {full}, "reduce-scatter": {full // 8, full // 4}}
    return [
        o
        for o in ops
        if o["op"] == op and o["loop"] == loop and o["bytes"] in sizes[op]
    ]


def _want(batch=None):
    x, y, mask = batch or _data()
    return jax.value_and_grad(_loss(None))(
        helpers.mesh_mlp_params(D_IN, HIDDEN, D_OUT), (x, y, mask)
    )


# ------------------------------------------------------------- numerics


@pytest.mark.parametrize("mesh_name", [*MESHES, *ONE_DEVICE])
def test_held_step_equals_per_micro_batch_and_big_batch(mesh_name):
    """Holding every fsdp-sharded weight: the loss and the gradients equal
    the per-micro-batch path's and jax.value_and_grad of the whole batch
    on one device (float32 rounding); the gradients come back in the
    params' shardings, still unreduced over 'data' where
    oa.unreduced_value_and_grad asked for it. Also on a mesh whose axes
    all have size 1 (the held gradient's scatter is then the identity)."""
    over = ("replica", "fsdp") if mesh_name == "replica2xfsdp4" else None
    axes = ALL_MESHES[mesh_name][1]
    held = oa.GatherOnce(axes, over=over)
    value, grads, types = _run(mesh_name, 4, held)
    value0, grads0, types0 = _run(mesh_name, 4, None)
    want_value, want = _want()
    chex.assert_trees_all_close(grads, want, **TOL)
    # Every micro-batch in the scan (peel=False): the same numbers.
    _, unpeeled, _ = _run(mesh_name, 4, dataclasses.replace(held, peel=False))
    chex.assert_trees_all_close(unpeeled, want, **TOL)
    chex.assert_trees_all_close(grads, grads0, **TOL)
    np.testing.assert_allclose(value, want_value, **TOL)
    np.testing.assert_allclose(value, value0, **TOL)
    assert types == types0, (types, types0)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_peeled_step_keeps_order_of_losses_aux_and_state(k):
    """Holding, the first and last micro-batch run outside the scan: for
    every k (no scan at 1 and 2) the loss, the gradients, the stacked aux
    (in micro-batch order) and the threaded state equal the per-micro-batch
    path's."""
    mesh = _mesh("data2xfsdp4")
    loss = _loss(("data", "fsdp"))

    def loss_aux(params, batch, count):
        value = loss(params, batch)
        return value, (count + 1, value + batch[2].sum())

    def run(hold):
        f = oa.microbatched_value_and_grad(
            loss_aux,
            k,
            has_aux=True,
            state_argnums=2,
            interleave=True,
            weight_fn=lambda batch: batch[2].sum(),
            gather_once=hold,
        )

        def step(p, b):
            (value, (count, aux)), grads = f(p, b, jnp.int32(0))
            return value, count, aux, jax.tree.map(_reduced, grads)

        rows = 16 * k if k < 4 else BATCH  # 2 rows per device
        batch = tuple(a[:rows] for a in _data())
        with jax.set_mesh(mesh):
            p, b = _put(
                "data2xfsdp4",
                helpers.mesh_mlp_params(D_IN, HIDDEN, D_OUT),
                batch,
            )
            return jax.tree.map(np.asarray, jax.jit(step)(p, b))

    got = run(oa.GatherOnce(("data", "fsdp")))
    want = run(None)
    assert int(got[1]) == k and got[2].shape == (k,)
    chex.assert_trees_all_close(got, want, **TOL)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("hold", [False, True])
def test_data_parallel_mesh_one_row_per_device_per_micro_batch(rows, hold):
    """data=8 x fsdp=1, interleaved micro-batches of ``rows`` row(s) per
    device, with and without holding: the loss and gradients equal
    jax.value_and_grad of the whole batch on one device. (Splitting the
    batch must keep a micro-batch's rows sharded as the batch's were, not
    hand the size-1 fsdp axis to the micro-batch index.)"""
    batch = tuple(a[: 8 * 4 * rows] for a in _data())
    held = oa.GatherOnce(("data", "fsdp")) if hold else None
    value, grads, _ = _run("data8xfsdp1", 4, held, batch=batch)
    want_value, want = _want(batch)
    chex.assert_trees_all_close(grads, want, **TOL)
    np.testing.assert_allclose(value, want_value, **TOL)


def test_bf16_held_copy_within_bf16_rounding():
    """dtype=bfloat16: the forward and backward run on a bf16 copy; the
    gradients (float32, the params' dtype) are within bf16's rounding of
    the float32 reference: |g - g_ref| <= 2e-2 * max|g_ref| (bf16 keeps 8
    significant bits, a relative step of 2**-8 = 0.4%, compounded through
    two matrix products and tanh)."""
    held = oa.GatherOnce(("data", "fsdp"), dtype=jnp.bfloat16)
    value, grads, types = _run("data2xfsdp4", 4, held)
    want_value, want = _want()
    for name, g in grads.items():
        assert g.dtype == np.float32, (name, g.dtype)
        scale = np.abs(want[name]).max()
        np.testing.assert_allclose(g, want[name], rtol=0, atol=2e-2 * scale)
    np.testing.assert_allclose(value, want_value, rtol=2e-2)
    exact = _run("data2xfsdp4", 4, oa.GatherOnce(("data", "fsdp")))[1]
    assert not all(np.array_equal(grads[n], exact[n]) for n in grads)


# ------------------------------------------------------------ the census


def _per_step(ops, name, op, k):
    """How many times per step ``op`` of weight ``name`` runs: k times
    inside the loop, once outside."""
    return sum(k if o["loop"] else 1 for o in _of_weight_any(ops, name, op))


def _of_weight_any(ops, name, op):
    return _of_weight(ops, name, op, loop=True) + _of_weight(
        ops, name, op, loop=False
    )


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_census_one_gather_one_scatter_per_held_leaf_whatever_k(k):
    """data=2 x fsdp=4, k micro-batches. Today's path (the baseline): each
    weight's reduce-scatter over fsdp runs inside the scan's loop, k per
    step (XLA:CPU hoists the all-gathers out of the loop itself: 1 per
    step). Held: per weight 1 all-gather and 1 reduce-scatter per step,
    none inside the loop; the unheld bias's all-reduce over fsdp moves its
    bytes once per micro-batch as before (the first and last micro-batch's
    outside the loop, which XLA may combine into one); over 'data' only
    the few scalars per micro-batch of the default path move, inside the
    loop or out (the gradients stay unreduced over 'data')."""
    base, _ = _census("data2xfsdp4", k, None)
    held, _ = _census("data2xfsdp4", k, oa.GatherOnce(("data", "fsdp")))
    for name in W_BYTES:
        assert _per_step(base, name, "reduce-scatter", k) == k, (name, base)
        assert _per_step(base, name, "all-gather", k) == 1, (name, base)
        for op in ("all-gather", "reduce-scatter"):
            assert not _of_weight(held, name, op, loop=True), (name, held)
            assert _per_step(held, name, op, k) == 1, (name, op, held)
    gathers = [o for o in held if o["op"] == "all-gather"]
    scatters = [o for o in held if o["op"] == "reduce-scatter"]
    assert len(gathers) == len(scatters) == len(W_BYTES), held
    assert all(o["axes"] == {"fsdp"} for o in gathers + scatters), held

    def per_step(ops, keep, trips):  # bytes per step (XLA may combine)
        return sum(
            (trips if o["loop"] else 1) * o["bytes"] for o in ops if keep(o)
        )

    # Held, the first and last micro-batch run outside the loop (peeled).
    both = ((held, max(k - 2, 0)), (base, k))
    bias = lambda o: o["op"] == "all-reduce" and o["axes"] == {"fsdp"}  # noqa: E731
    for ops, trips in both:
        assert per_step(ops, bias, trips) == k * 4 * HIDDEN, ops
    over_data = lambda o: "data" in o["axes"]  # noqa: E731
    assert all(o["bytes"] <= 16 for o in base if over_data(o)), base
    scalars = {per_step(ops, over_data, trips) for ops, trips in both}
    assert len(scalars) == 1, held


def test_without_deferral_data_is_reduced_once_per_step():
    """Without oa.unreduced_value_and_grad (gradients reduced in the step):
    the held copy is reduced over every batch axis, so the weights'
    gradients are summed over 'data' once per step, after the loop (the
    default path: per micro-batch, inside it); equal to one device's."""
    hold = oa.GatherOnce(("data", "fsdp"))
    held, _ = _census("data2xfsdp4", 4, hold, unreduced=False)
    base, _ = _census("data2xfsdp4", 4, None, unreduced=False)
    shards = sum(W_BYTES.values()) // 4  # each weight's fsdp shard

    def over_data(ops):  # (XLA may combine the weights' reductions)
        ops = [o for o in ops if o["axes"] == {"data"} and o["bytes"] > 16]
        return sum(o["bytes"] for o in ops), {o["loop"] for o in ops}

    assert over_data(base) == (shards, {True}), base  # k per step
    assert over_data(held) == (shards, {False}), held  # once per step
    value, grads = _grad_fn("data2xfsdp4", 4, hold, unreduced=False), None
    with jax.set_mesh(_mesh("data2xfsdp4")):
        value, grads = jax.jit(value)(
            *_put(
                "data2xfsdp4",
                helpers.mesh_mlp_params(D_IN, HIDDEN, D_OUT),
                _data(),
            )
        )
    chex.assert_trees_all_close(
        jax.tree.map(np.asarray, grads), _want()[1], **TOL
    )


def test_hierarchical_over_the_slow_axis_only():
    """replica=2 x fsdp=4, weights sharded over ("fsdp", "replica") (all 8
    devices), over=("replica",): per weight one all-gather and one
    reduce-scatter over 'replica' per step, outside the loop; the
    reduce-scatter over 'fsdp' stays in the loop (per micro-batch, as
    ZeRO++ hpZ); nothing over 'replica' of weight size in the loop. The
    gradients equal the one-device ones."""
    axes = ("replica", "fsdp")
    held = oa.GatherOnce(axes, over="replica")
    ops, _ = _census("replica2xfsdp4", 4, held)
    for name, full in W_BYTES.items():
        out = [o for o in ops if not o["loop"] and o["axes"] == {"replica"}]
        assert [o["bytes"] for o in out if o["op"] == "all-gather"].count(
            full // 4
        ) == 1, (name, ops)
        assert [o["bytes"] for o in out if o["op"] == "reduce-scatter"].count(
            full // 8
        ) == 1, (name, ops)
        inner = [
            o
            for o in ops
            if o["loop"]
            and o["op"] == "reduce-scatter"
            and o["bytes"] == full // 4
        ]
        assert len(inner) == 1 and inner[0]["axes"] == {"fsdp"}, (name, ops)
    slow = [
        o
        for o in ops
        if o["loop"] and "replica" in o["axes"] and o["bytes"] > 64
    ]
    assert [o["op"] for o in slow] == ["all-reduce"], ops  # the bias only
    _, grads, _ = _run("replica2xfsdp4", 4, held)
    chex.assert_trees_all_close(grads, _want()[1], **TOL)


def test_fsdp_gather_of_a_held_leaf_moves_nothing():
    """loss_fn sees each held weight replicated and reduced over every
    batch axis: oa.fsdp_gather of such a copy (forward and backward)
    returns its type and compiles to no collective at all."""
    mesh = _mesh("data2xfsdp4")
    axes = ("data", "fsdp")
    seen = {}

    def loss(params, batch):
        seen.update(jax.tree.map(jax.typeof, params))
        return _loss(axes)(params, batch)

    f = oa.microbatched_value_and_grad(
        loss, 2, interleave=True, gather_once=oa.GatherOnce(axes)
    )
    with jax.set_mesh(mesh):
        jax.jit(f).trace(
            *_put(
                "data2xfsdp4",
                helpers.mesh_mlp_params(D_IN, HIDDEN, D_OUT),
                _data(),
            )
        )
        spec = seen["w1"].sharding.spec
        assert spec.partitions in ((), (None, None)), spec
        assert spec.reduced == set(axes), spec
        w = jax.device_put(jnp.ones((8, 4)), P(None, None, reduced=set(axes)))

        def g(w):
            full = oa.fsdp_gather(w, axes)
            assert jax.typeof(full) == jax.typeof(w)
            return jax.grad(lambda w: jnp.sum(oa.fsdp_gather(w, axes)))(w)

        compiled = jax.jit(g).lower(w).compile()
    assert oa.collective_census(compiled, mesh) == []


def test_gather_once_none_changes_nothing():
    """gather_once=None compiles to the very program of the default."""
    mesh = _mesh("data2xfsdp4")
    loss, micro = _loss(("data", "fsdp")), oa.microbatched_value_and_grad
    with jax.set_mesh(mesh):
        p, b = _put(
            "data2xfsdp4", helpers.mesh_mlp_params(D_IN, HIDDEN, D_OUT), _data()
        )
        texts = [
            jax.jit(micro(loss, 4, interleave=True, **kw)).lower(p, b).as_text()
            for kw in ({}, {"gather_once": None})
        ]
    assert texts[0] == texts[1]


# ------------------------------------------------------------ the budget


def test_memory_budget_zero_half_all():
    """Budgets 0, half the held bytes, all of them (per device: a held copy
    plus a float32 gradient sum per weight), and w1's alone. 0 holds
    nothing (the program of gather_once=None); all holds both weights;
    half holds the largest weight that fits (w2, as w1 alone is over it);
    w1's holds w1 (largest first, not w2 then nothing). Every compiled
    step needs at most the step without holding plus its budget."""
    axes = ("data", "fsdp")
    costs = {n: 2 * b for n, b in W_BYTES.items()}  # f32 copy + f32 sum
    base, base_memory = _census("data2xfsdp4", 2, None)
    assert costs["w1"] > sum(costs.values()) / 2 >= costs["w2"]
    held_names = {}
    for label, budget in (
        ("0", 0),
        ("half", sum(costs.values()) / 2),
        ("all", sum(costs.values())),
        ("w1", costs["w1"]),
    ):
        hold = oa.GatherOnce(axes, memory_budget=budget)
        ops, memory = _census("data2xfsdp4", 2, hold)
        assert memory <= base_memory + budget, (label, memory, base_memory)
        held_names[label] = {
            n for n in W_BYTES if _per_step(ops, n, "reduce-scatter", 2) == 1
        }
        if label == "0":
            assert ops == base
    assert held_names == {
        "0": set(),
        "half": {"w2"},
        "all": {"w1", "w2"},
        "w1": {"w1"},
    }


def test_leaves_predicate_chooses_the_held_leaves():
    """leaves=(path, leaf) -> bool: only w1 is held."""
    hold = oa.GatherOnce(
        ("data", "fsdp"),
        leaves=lambda path, leaf: "w1" in jax.tree_util.keystr(path),
    )
    ops, _ = _census("data2xfsdp4", 2, hold)
    assert _per_step(ops, "w1", "reduce-scatter", 2) == 1, ops
    assert _per_step(ops, "w2", "reduce-scatter", 2) == 2, ops
    _, grads, _ = _run("data2xfsdp4", 2, hold)
    chex.assert_trees_all_close(grads, _want()[1], **TOL)


# ------------------------------------------------------------ bad input


def test_bad_input_is_named():
    axes = ("data", "fsdp")
    with pytest.raises(ValueError, match=r"memory_budget=-1"):
        oa.GatherOnce(axes, memory_budget=-1)
    with pytest.raises(ValueError, match=r"over='model' names 'model'"):
        oa.GatherOnce(axes, over="model")
    with pytest.raises(TypeError, match="dtype"):
        oa.GatherOnce(axes, dtype=jnp.int32)
    with pytest.raises(TypeError, match="leaves"):
        oa.GatherOnce(axes, leaves=3)
    with pytest.raises(TypeError, match="peel"):
        oa.GatherOnce(axes, peel="yes")
    with pytest.raises(TypeError, match="gather_once"):
        oa.microbatched_value_and_grad(lambda w, x: 0.0, 2, gather_once=axes)
    # At trace time: an axis not on the mesh; 'data' shards the batch only.
    for hold, match in (
        (oa.GatherOnce(("data", "fsdp", "dp")), r"'dp'.*\('data', 'fsdp'\)"),
        (oa.GatherOnce(axes, over="data"), r"'data'.*shards the batch but"),
    ):
        with pytest.raises(ValueError, match=match):
            _census("data2xfsdp4", 2, hold)


def test_messages_name_the_field_once():
    """Each message says "GatherOnce:" once and names the field as given
    (no "got GatherOnce: dtype=..."); a non-floating dtype is a TypeError,
    as documented."""
    axes = ("data", "fsdp")
    cases = [
        (TypeError, dict(dtype=jnp.int32), r"dtype=<class"),
        (TypeError, dict(dtype="nope"), r"dtype='nope'"),
        (TypeError, dict(memory_budget="1"), r"memory_budget='1'"),
        (ValueError, dict(memory_budget=-1), r"memory_budget=-1"),
        (TypeError, dict(leaves=3), r"leaves=3"),
    ]
    for error, kwargs, match in cases:
        with pytest.raises(error, match=match) as info:
            oa.GatherOnce(axes, **kwargs)
        message = str(info.value)
        assert message.startswith("GatherOnce: "), message
        assert message.count("GatherOnce") == 1, message


def test_no_mesh_says_to_drop_gather_once():
    """On one device with no mesh there is nothing to gather: the message
    says to drop gather_once= (GatherOnce has no axis_name)."""
    step = oa.microbatched_value_and_grad(
        _loss(None), 2, gather_once=oa.GatherOnce(("data", "fsdp"))
    )
    with pytest.raises(ValueError, match=r"drop gather_once=") as info:
        jax.jit(step)(helpers.mesh_mlp_params(D_IN, HIDDEN, D_OUT), _data())
    message = str(info.value)
    assert "axis_name" not in message, message
    assert message.count("GatherOnce") == 1, message


def _equations(mesh_name, k, gather_once):
    """The equations of the traced step (its jaxpr's, sub-jaxprs'
    included)."""
    f = _grad_fn(mesh_name, k, gather_once)
    with jax.set_mesh(_mesh(mesh_name)):
        p, b = _put(
            mesh_name, helpers.mesh_mlp_params(D_IN, HIDDEN, D_OUT), _data()
        )
        closed = jax.jit(f).trace(p, b).jaxpr

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return list(walk(closed.jaxpr))


def _scan_lengths(mesh_name, k, gather_once):
    """The lengths of the scans in the traced step."""
    eqns = _equations(mesh_name, k, gather_once)
    return [e.params["length"] for e in eqns if e.primitive.name == "scan"]


def test_peel_false_runs_every_micro_batch_in_the_scan():
    """k = 4, held: peeled, the scan runs the k - 2 micro-batches between
    the first and the last; ``peel=False`` runs all k in it (and so does
    the path without holding)."""
    hold = oa.GatherOnce(("data", "fsdp"))
    peeled = _scan_lengths("data2xfsdp4", 4, hold)
    no_peel = dataclasses.replace(hold, peel=False)
    unpeeled = _scan_lengths("data2xfsdp4", 4, no_peel)
    assert peeled == [2], peeled
    assert unpeeled == [4], unpeeled
    assert _scan_lengths("data2xfsdp4", 4, None) == [4]


def test_each_held_copy_is_pinned_in_the_program():
    """Each held copy, gathered whole, goes through one
    ``optimization_barrier`` (the pin that keeps XLA:TPU from repeating
    its gather into each of its users: tests/gpu_compile/
    test_gather_once_program.py; XLA:CPU gathers once either way); the
    path without holding has none."""

    def pinned(hold):
        eqns = _equations("data2xfsdp4", 4, hold)
        barriers = [
            e for e in eqns if e.primitive.name == "optimization_barrier"
        ]
        return sorted(tuple(v.aval.shape) for e in barriers for v in e.outvars)

    want = sorted([(D_IN, HIDDEN), (HIDDEN, D_OUT)])  # w1, w2 (b1 unsharded)
    assert pinned(oa.GatherOnce(("data", "fsdp"))) == want
    assert pinned(None) == []
