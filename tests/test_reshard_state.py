"""Optimizer states across meshes: ``oa.state_shardings`` for every optax
transformation in a chain, and ``oa.reshard_state``, which places a saved
state (any mesh, or none) for the params on the current mesh, folding the
unclosed window's per-device partial sums (API.md, section 7).

On the 8 CPU devices of conftest.py, against the single-device big-batch
reference of tests/mesh_helpers.py.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from tests import helpers
from tests import mesh_helpers as mh

# optax transformations whose state holds MaskedNode leaves, or wraps another
# optimizer's state: each after a gate, with and without shard_update.
WRAPPERS = {
    "masked": lambda: optax.masked(
        optax.adam(0.05), {"w1": True, "b1": False, "w2": True}
    ),
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(0.05), "sgd": optax.sgd(0.1, momentum=0.9)},
        {"w1": "adam", "b1": "sgd", "w2": "adam"},
    ),
    "partition": lambda: optax.partition(
        {"adam": optax.adam(0.05), "none": optax.set_to_zero()},
        {"w1": "adam", "b1": "none", "w2": "adam"},
    ),
    "muon": lambda: optax.contrib.muon(0.05),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(0.05),
    "named_chain": lambda: optax.named_chain(
        ("clip", optax.clip_by_global_norm(1.0)), ("adam", optax.adam(0.05))
    ),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(0.05), 3),
    "optax_multisteps": lambda: optax.MultiSteps(
        optax.adam(0.05), 2
    ).gradient_transformation(),
    "lookahead_free": lambda: optax.chain(
        optax.add_decayed_weights(1e-3), optax.scale_by_lion()
    ),
}


@pytest.mark.parametrize("mode", ["explicit", "shard_update", "auto"])
@pytest.mark.parametrize("name", list(WRAPPERS))
def test_state_shardings_of_optax_wrappers(name, mode):
    """oa.state_shardings of a chain ending in each optax wrapper (masked
    leaves included) is a tree jax.device_put takes with tx.init's state,
    the values unchanged. On an explicit mesh each leaf lies as
    jax.jit(tx.init) under the mesh puts it (the followers' state placed
    over the data axis too with shard_update); on an auto mesh every leaf
    shaped like a param (Adam's moments, muon's momentum) lies at that
    param's sharding, the others replicated."""
    mesh = mh._mesh("data2xfsdp4")
    if mode == "auto":
        mesh = jax.make_mesh(
            (2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2
        )
    tx = oa.chain(
        oa.accumulate(
            2,
            axis_name=None if mode == "auto" else "data",
            shard_update=mode == "shard_update",
        ),
        WRAPPERS[name](),
    )
    with jax.set_mesh(mesh):
        params = mh._put_params(mesh, helpers.mesh_mlp_params())
        shardings = oa.state_shardings(tx, params)
        state = tx.init(params)
        placed = jax.device_put(state, shardings)
        jitted = jax.jit(tx.init)(params)
    chex.assert_trees_all_equal(placed, state)
    if mode == "auto":
        by_shape = {p.shape: p.sharding for p in jax.tree.leaves(params)}
        for leaf in jax.tree.leaves(placed):
            want = by_shape.get(leaf.shape, NamedSharding(mesh, P()))
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (
                leaf.shape,
                leaf.sharding,
            )
        return
    for got, want in zip(
        jax.tree.leaves(placed), jax.tree.leaves(jitted), strict=True
    ):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (
            got.sharding,
            want.sharding,
        )


# ------------------------------------------------------- oa.reshard_state

A, B = "data2xfsdp4", "data8"


def _tx(k, shard_update):
    return oa.chain(
        oa.dynamic_loss_scale(2.0**8, axis_name="data"),
        oa.accumulate(
            k,
            axis_name="data",
            skip_nonfinite=True,
            noise_scale_decay=0.5,
            shard_update=shard_update,
        ),
        optax.adam(0.05),
    )


def _feed(tx, mesh_name, params, state, data, ts):
    mesh = mh._mesh(mesh_name)
    step = mh._scaled_step(tx, mesh)
    with jax.set_mesh(mesh):
        for t in ts:
            batch = mh._put_batch(mesh, *(a[t] for a in data))
            params, state = step(params, state, *batch)
    return params, state


def _save(state, via, path):
    """The state as saved: host arrays, or an orbax restore without a
    target (dicts and lists)."""
    if via == "device_get":
        return jax.device_get(state)
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, state)
        ckpt.wait_until_finished()
        return ckpt.restore(path)


def _rows_sum(x):
    """The sum of a window leaf's per-device rows (itself if plain)."""
    x = np.asarray(x, np.float64)
    return x.sum(0) if x.ndim else x


def _move(tx, saved, params, mesh_name):
    """``saved`` and the host ``params`` resumed on ``mesh_name``: the
    params put at their specs there, the state by oa.reshard_state, called
    outside any mesh context (its layout does not depend on it)."""
    mesh = mh._mesh(mesh_name)
    params = mh._put_params(mesh, jax.device_get(params))
    state = oa.reshard_state(tx, saved, params)
    with jax.set_mesh(mesh):
        want = jax.jit(tx.init)(params)
    for got, like in zip(
        jax.tree.leaves(state), jax.tree.leaves(want), strict=True
    ):
        assert got.shape == like.shape and got.dtype == like.dtype
        assert got.sharding.is_equivalent_to(like.sharding, got.ndim)
    return params, state


def _window_sums(state):
    """Each accumulator leaf's and the noise scale's sums over the rows,
    with the window's weight and counts: what must survive a reshard."""
    acc = state[1]
    acc = acc if isinstance(acc, dict) else acc._asdict()
    noise = acc["noise_scale"]
    noise = noise if isinstance(noise, dict) else noise._asdict()
    return {
        "acc": jax.tree.map(_rows_sum, dict(acc["acc"])),
        "weight": np.asarray(acc["weight"]),
        "mini_step": np.asarray(acc["mini_step"]),
        "sq_sum": _rows_sum(noise["sq_sum"]),
        "micro_batches": np.asarray(noise["micro_batches"]),
    }


@pytest.mark.parametrize(
    "k,cuts,shard_update,via",
    [
        (4, (6, 10, 12), False, "device_get"),  # mid-window both ways
        (3, (6, 9, 12), False, "orbax"),  # at window boundaries
        (4, (6, 10, 12), True, "orbax"),
        (3, (6, 9, 12), True, "device_get"),
    ],
)
def test_reshard_state_across_meshes_equals_uninterrupted_run(
    tmp_path, k, cuts, shard_update, via
):
    """A state saved on data=2 x fsdp=4 resumes on data=8 and, saved again
    there, back on data=2 x fsdp=4: the window's partial sums (two rows,
    then eight), its weight and the noise scale's sums are kept; the final
    params equal the uninterrupted run on data=2 x fsdp=4 and single-device
    Adam on each window's whole batch."""
    tx = _tx(k, shard_update)
    data = mh._make_data(cuts[-1])
    mesh = mh._mesh(A)
    with jax.set_mesh(mesh):
        params = mh._put_params(mesh, helpers.mesh_mlp_params())
        state = jax.device_put(tx.init(params), oa.state_shardings(tx, params))
    params, state = _feed(tx, A, params, state, data, range(cuts[0]))
    saved = _save(state, via, tmp_path / "a")
    uninterrupted, _ = _feed(
        tx, A, params, state, data, range(cuts[0], cuts[-1])
    )

    params, moved = _move(tx, saved, params, B)
    if cuts[0] % k:  # mid-window: two partial sums become eight rows
        assert (
            np.asarray(
                saved[1]["acc"]["w1"] if via == "orbax" else saved[1].acc["w1"]
            ).shape[0]
            == 2
        )
        assert moved[1].acc["w1"].shape[0] == 8
        chex.assert_trees_all_close(
            _window_sums(jax.device_get(moved)),
            _window_sums(saved),
            rtol=1e-6,
            atol=1e-6,
        )
    params, state = _feed(tx, B, params, moved, data, range(*cuts[:2]))
    saved = _save(state, via, tmp_path / "b")
    params, moved = _move(tx, saved, params, A)
    if cuts[1] % k:
        chex.assert_trees_all_close(
            _window_sums(jax.device_get(moved)),
            _window_sums(saved),
            rtol=1e-6,
            atol=1e-6,
        )
    resumed, state = _feed(tx, A, params, moved, data, range(*cuts[1:]))

    assert int(state[1].gradient_step) == cuts[-1] // k
    chex.assert_trees_all_close(
        jax.device_get(resumed), jax.device_get(uninterrupted), **mh.TOL
    )
    want = mh._reference(
        optax.adam(0.05), helpers.mesh_mlp_params(), *data, k=k
    )
    chex.assert_trees_all_close(jax.device_get(resumed), want, **mh.TOL)
    assert np.isfinite(oa.noise_scale(state).b_simple)


def test_reshard_state_from_a_single_device_and_bad_input():
    """A state saved off any mesh (plain accumulator) is folded into the
    stacked rows of a mesh and back; a leaf of the wrong shape, a missing
    one, or one too many are named."""
    tx = oa.chain(oa.accumulate(3, axis_name="data"), optax.adam(0.05))
    plain = helpers.mesh_mlp_params()
    state = tx.init(plain)  # one micro-batch of weight 2, gradients 1
    acc = state[0]._replace(
        acc=jax.tree.map(lambda p: 2 * jnp.ones_like(p), plain),
        weight=jnp.asarray(2.0),
        mini_step=jnp.asarray(1, jnp.int32),
    )
    saved = jax.device_get((acc, *state[1:]))
    mesh = mh._mesh(A)
    params = mh._put_params(mesh, plain)
    moved = oa.reshard_state(tx, saved, params)
    rows = np.asarray(moved[0].acc["w1"])
    assert rows.shape == (2, *plain["w1"].shape)
    np.testing.assert_array_equal(rows[0], 2 * np.ones_like(plain["w1"]))
    np.testing.assert_array_equal(rows[1], 0)
    assert float(moved[0].weight) == 2.0 and int(moved[0].mini_step) == 1
    back = oa.reshard_state(tx, jax.device_get(moved), plain)
    chex.assert_trees_all_equal(jax.device_get(back), saved)

    bad = jax.device_get(moved)
    wrong = bad[1][0]._replace(count=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"count.*shape \(3,\)"):
        oa.reshard_state(tx, (bad[0], (wrong, *bad[1][1:])), params)
    with pytest.raises(ValueError, match="no leaf at"):
        oa.reshard_state(tx, (bad[0],), params)
    with pytest.raises(ValueError, match="does not have"):
        oa.reshard_state(tx, (*bad, {"extra": np.zeros(1)}), params)


def test_reshard_state_folds_a_complex_accumulator_with_its_imaginary_part():
    """The rows of a complex accumulator are folded as complex numbers: two
    devices' partial sums 1+2j and 3+4j become 4+6j on one device (and in
    the first row on a mesh with more rows), not 4+0j; the dtype stays."""
    tx = oa.chain(oa.accumulate(3, axis_name="data"), optax.sgd(0.1))
    plain = {"w": jnp.zeros(2, jnp.complex64)}
    state = jax.device_get(tx.init(plain))
    rows = np.array([[1 + 2j, -1j], [3 + 4j, 0.5 + 0j]], np.complex64)
    saved = (state[0]._replace(acc={"w": rows}), *state[1:])
    want = np.array([4 + 6j, 0.5 - 1j], np.complex64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a cast to real warns, then check
        moved = oa.reshard_state(tx, saved, plain)
    assert moved[0].acc["w"].dtype == jnp.complex64
    np.testing.assert_array_equal(moved[0].acc["w"], want)
    assert not caught, [str(w.message) for w in caught]
    mesh = jax.make_mesh(
        (4,), ("data",), (AxisType.Explicit,), devices=jax.devices()[:4]
    )
    params = {"w": jax.device_put(plain["w"], NamedSharding(mesh, P()))}
    moved = jax.device_get(oa.reshard_state(tx, saved, params))
    assert moved[0].acc["w"].shape == (4, 2)
    np.testing.assert_array_equal(moved[0].acc["w"][0], want)
    np.testing.assert_array_equal(moved[0].acc["w"][1:], 0)


@pytest.mark.parametrize("one_device", [False, True])
def test_docs_scaling_resume_on_another_mesh_runs_as_written(
    capsys, one_device
):
    """docs/scaling.md: the first block of the jit section, then the
    recipe of "Resuming on another mesh", exactly as written, in one
    namespace on the 8 CPU devices: the window left open on data=2 x
    fsdp=4 closes on data=8; and with the new mesh one of size-1 axes
    (data=1 x fsdp=1 on one device, a run resumed there), which JAX's
    inlined shard_map rejected ("Expected last op to be
    sdy.sharding_constraint")."""
    import pathlib

    text = (
        pathlib.Path(__file__).resolve().parent.parent / "docs" / "scaling.md"
    ).read_text()
    section = text[text.index("## `jax.jit` on an explicit mesh") :]
    first = section.split("```python\n", 1)[1].split("```", 1)[0]
    recipe = section[section.index("### Resuming on another mesh") :]
    recipe = recipe.split("```python\n", 1)[1].split("```", 1)[0]
    assert "oa.reshard_state(tx, saved" in recipe
    rows = 8
    if one_device:  # the recipe's new_mesh statement, on one device
        start = recipe.index("new_mesh = jax.make_mesh((8, 1)")
        end = recipe.index("\n", recipe.index("axis_types=", start))
        one = (
            'new_mesh = jax.make_mesh((1, 1), ("data", "fsdp"), '
            "axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:1])"
        )
        recipe = recipe[:start] + one + recipe[end:]
        rows = 1
    namespace = {}
    exec(compile(first, "docs/scaling.md", "exec"), namespace)  # noqa: S102
    exec(compile(recipe, "docs/scaling.md", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out.split()[-1] == "3"
    assert namespace["state"][0].acc["w1"].shape[0] == rows


def test_reshard_state_onto_fewer_devices_mid_window():
    """After a preemption: a mid-window state of data=2 x fsdp=4 (8
    devices) resumes on data=4 over 4 of them (two rows become four) and
    lands on single-device Adam on each window's whole batch."""
    k, cut, total = 4, 6, 8
    tx = _tx(k, shard_update=False)
    data = mh._make_data(total)
    mesh = mh._mesh(A)
    with jax.set_mesh(mesh):
        params = mh._put_params(mesh, helpers.mesh_mlp_params())
        state = jax.jit(tx.init)(params)
    params, state = _feed(tx, A, params, state, data, range(cut))
    saved = jax.device_get(state)
    small = jax.make_mesh(
        (4,), ("data",), (AxisType.Explicit,), devices=jax.devices()[:4]
    )
    params = mh._put_params(small, jax.device_get(params))
    moved = oa.reshard_state(tx, saved, params)
    assert moved[1].acc["w1"].shape[0] == 4
    assert set(moved[1].acc["w1"].sharding.device_set) == set(
        small.devices.flat
    )
    step = mh._scaled_step(tx, small)
    with jax.set_mesh(small):
        for t in range(cut, total):
            batch = mh._put_batch(small, *(a[t] for a in data))
            params, moved = step(params, moved, *batch)
    want = mh._reference(
        optax.adam(0.05), helpers.mesh_mlp_params(), *data, k=k
    )
    chex.assert_trees_all_close(jax.device_get(params), want, **mh.TOL)
    assert int(moved[1].gradient_step) == total // k
