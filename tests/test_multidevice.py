"""Data parallelism: ``oa.accumulate(axis_name=...)`` under
``jax.pmap`` and ``jax.shard_map``, sharded states, two processes.

Each device computes the plain local gradient of its own micro-batch (no
collective in the user's step); the accumulation all-reduces once per
window. References are single-device optax runs on the whole window's batch.
conftest.py gives every test process 8 CPU devices.
"""

import os
import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optaxaccum as oa
from tests import helpers, workers
from tests import hlo_queries as hlo
from tests.data_parallel_helpers import (
    AXIS,
    RUNNERS,
    TOL,
    WINDOWS,
    K,
    N,
    _assert_same_on_every_device,
    _compiled_text,
    _data,
    _first,
    _local_step,
    _mesh,
    _put,
    _reference,
    _replicate,
    worker,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _optimizers():
    return {"sgd": optax.sgd(0.1), "adam": optax.adam(0.05)}


# ------------------------------------------------------------------ tests


_CASES = [  # (optimizer, weighted, ragged token counts)
    ("sgd", False, False),  # equal micro-batches: plain big-batch mean
    ("adam", True, True),  # token-count weights: global per-token mean
    ("adam", False, True),  # unweighted: mean of the micro-batch means
]


@pytest.mark.parametrize(
    "runner,opt_name,weighted,ragged",
    [
        *[
            pytest.param(r, *c, id=f"{r}-{c[0]}-w{int(c[1])}-r{int(c[2])}")
            for r in ("pmap", "shard_map")
            for c in _CASES
        ],
        pytest.param(
            "shard_map_per_device",
            "adam",
            True,
            True,
            id="shard_map_per_device-adam-w1-r1",
        ),
    ],
)
def test_accumulate_axis_name_equals_big_batch(
    runner, opt_name, weighted, ragged
):
    """N devices x K micro-batches, local grads, one all-reduce per window
    == one step on the window's whole batch (per-token mean if weighted)."""
    opt = _optimizers()[opt_name]
    data = _data(K * WINDOWS, ragged=ragged)
    params = helpers.multihost_params()
    tx = oa.chain(oa.accumulate(K, axis_name=AXIS), opt)
    got, state = RUNNERS[runner](tx, params, data, weighted=weighted)
    want = _reference(opt, params, *data, weighted=weighted)
    _assert_same_on_every_device(got)
    chex.assert_trees_all_close(_first(got), want, **TOL[jnp.float32])
    assert (np.asarray(state[0].gradient_step) == WINDOWS).all()
    assert (np.asarray(state[0].mini_step) == 0).all()


@pytest.mark.parametrize(
    "runner,weighted",
    [
        ("pmap", True),
        ("shard_map", True),
        ("shard_map", False),
    ],
)
def test_accumulate_axis_name_sum_reduction(runner, weighted):
    """reduction="sum": the per-device window sums, averaged over devices.
    Through the plain ``tx.update`` protocol."""
    opt = optax.sgd(0.02)
    data = _data(K * WINDOWS, ragged=True, seed=1)
    params = helpers.multihost_params()
    tx = oa.chain(oa.accumulate(K, reduction="sum", axis_name=AXIS), opt)
    with jax.numpy_dtype_promotion("strict"):
        got, _ = RUNNERS[runner](
            tx, params, data, weighted=weighted, fused=False
        )
    want = _reference(opt, params, *data, weighted=weighted, reduction="sum")
    _assert_same_on_every_device(got)
    chex.assert_trees_all_close(_first(got), want, **TOL[jnp.float32])


@pytest.mark.parametrize("dtype", [jnp.bfloat16])  # f32: the tests above
@pytest.mark.parametrize("runner", ["pmap", "shard_map"])
def test_accumulate_axis_name_low_precision_grads(runner, dtype):
    """bf16 params and grads: accumulated and all-reduced in float32, emitted
    in bf16. Oracle: the same local gradients combined in float64."""
    data = tuple(np.asarray(a, dtype) for a in _data(K, ragged=True, seed=2))
    params = helpers.multihost_params(dtype)
    lr = 0.5
    tx = oa.chain(oa.accumulate(K, axis_name=AXIS), optax.sgd(lr))
    with jax.numpy_dtype_promotion("strict"):
        got, _ = RUNNERS[runner](tx, params, data, weighted=True)
    local_grads = jax.jit(
        jax.vmap(
            jax.vmap(jax.grad(worker.local_loss), (None, 0, 0, 0)),
            (None, 0, 0, 0),
        )
    )
    g = local_grads(params, *data)  # (K, N, ...) in dtype
    counts = data[2].sum(-1).astype(np.float64)
    want = jax.tree.map(
        lambda p, gl: (
            np.asarray(p, np.float64)
            - lr
            * np.einsum("kn,kn...->...", counts, np.asarray(gl, np.float64))
            / counts.sum()
        ),
        params,
        g,
    )
    _assert_same_on_every_device(got)
    got = _first(got)
    chex.assert_trees_all_equal_dtypes(got, params)
    chex.assert_trees_all_close(
        jax.tree.map(lambda a: np.asarray(a, np.float64), got),
        want,
        **TOL[dtype],
    )


# ------------------------------------------------------------- HLO counts


def _pmean_step(tx, varying):
    """The optax way: ``lax.pmean`` of the local gradients every
    micro-batch, then ``tx`` (e.g. ``optax.MultiSteps``)."""

    def step(params, state, x, y, mask):
        p = (
            params
            if varying is None
            else lax.pcast(params, varying, to="varying")
        )
        grads = lax.pmean(jax.grad(worker.local_loss)(p, x, y, mask), AXIS)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


@pytest.mark.parametrize("runner", ["pmap", "shard_map"])
def test_hlo_gradient_all_reduce_only_in_closing_branch(runner):
    """Compiled step: the optax way all-reduces the gradient at the top level
    (every micro-step); ours only inside the conditional's true branch."""
    varying = AXIS if runner == "shard_map" else None
    tree_bytes = 4 * (worker.D_IN * worker.D_OUT + worker.D_OUT)

    multi = optax.MultiSteps(optax.adam(0.1), K)
    optax_way = hlo.summarize(
        _compiled_text(runner, multi, _pmean_step(multi, varying))
    )
    assert optax_way["top_ops"] >= 1, optax_way
    assert optax_way["top_bytes"] == tree_bytes, optax_way
    assert optax_way["branch_ops"] == 0, optax_way

    tx = oa.chain(oa.accumulate(K, axis_name=AXIS), optax.adam(0.1))
    for fused in (True, False):
        ours = hlo.summarize(
            _compiled_text(
                runner,
                tx,
                _local_step(tx, weighted=True, fused=fused, varying=varying),
            )
        )
        assert ours["top_ops"] == 0, ours
        assert ours["branch_ops"] >= 1, ours
        assert ours["true_branch_only"], ours
        # The accumulator and its weight (a float32 scalar), once.
        assert ours["branch_bytes"] == tree_bytes + 4, ours

    skip = oa.chain(
        oa.accumulate(K, axis_name=AXIS, skip_nonfinite=True), optax.adam(0.1)
    )
    ours = hlo.summarize(
        _compiled_text(
            runner, skip, _local_step(skip, weighted=True, varying=varying)
        )
    )
    # Every micro-step: only the int32 scalar agreeing on finiteness.
    assert (ours["top_ops"], ours["top_bytes"]) == (1, 4), ours
    assert ours["true_branch_only"], ours
    assert ours["branch_bytes"] == tree_bytes + 4, ours


_KNOWN_HLO = """HloModule m, entry_computation_layout={(f32[])->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%closed (p: f32[4]) -> f32[4] {
  ROOT %p = f32[4]{0} parameter(0)
}

%opened (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  %ar = (f32[], bf16[2,3]{1,0}) all-reduce(%q, %q), to_apply=%add
  ROOT %r = f32[4]{0} all-reduce(%q), to_apply=%add
}

ENTRY %main (x: f32[4], i: s32[]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %i = s32[] parameter(1)
  %pmin.3 = s32[] all-reduce(%i), to_apply=%add
  ROOT %c = f32[4]{0} conditional(%i, %x, %x), BRANCHES
}
""".replace("BRANCHES", "branch_computations={%closed, %opened}")


def test_hlo_parser_on_a_known_module():
    """The parser: entry vs conditional branches, tuple shapes, bytes."""
    ops = hlo.all_reduces(_KNOWN_HLO)
    assert sorted(
        (o["computation"], o["branches"], o["bytes"]) for o in ops
    ) == [("main", (), 4), ("opened", (1,), 16), ("opened", (1,), 16)]
    assert hlo.summarize(_KNOWN_HLO) == dict(
        top_ops=1,
        top_bytes=4,
        branch_ops=2,
        branch_bytes=32,
        true_branch_only=True,
    )


# --------------------------------------------------------- non-finite grads


def _poisoned_data(bad_step, bad_device):
    """K * WINDOWS + 1 micro-steps; at ``bad_step`` one device's input holds
    an Inf, so its local gradient is not finite. Also returns the clean data
    without that micro-step."""
    x, y, mask = _data(K * WINDOWS + 1, ragged=True, seed=3)
    mask[bad_step, bad_device] = 1.0
    x = x.copy()
    x[bad_step, bad_device, 0, 0] = np.inf
    keep = np.arange(len(x)) != bad_step
    return (x, y, mask), (x[keep], y[keep], mask[keep])


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_skip_nonfinite_one_device_drops_micro_batch_everywhere(runner):
    opt = optax.adam(0.05)
    data, clean = _poisoned_data(bad_step=4, bad_device=5)
    params = helpers.multihost_params()
    tx = oa.chain(oa.accumulate(K, axis_name=AXIS, skip_nonfinite=True), opt)
    got, state = RUNNERS[runner](tx, params, data, weighted=True)
    want = _reference(opt, params, *clean, weighted=True)
    _assert_same_on_every_device(got)
    chex.assert_tree_all_finite(got)
    chex.assert_trees_all_close(_first(got), want, **TOL[jnp.float32])
    assert (np.asarray(state[0].gradient_step) == WINDOWS).all()


@pytest.mark.parametrize("runner", ["pmap", "shard_map"])
def test_dynamic_loss_scale_one_device_overflow_skips_everywhere(runner):
    opt = optax.adam(0.05)
    data, clean = _poisoned_data(bad_step=2, bad_device=0)
    params = helpers.multihost_params()
    init_scale = 2.0**6
    tx = oa.chain(
        oa.dynamic_loss_scale(init_scale, axis_name=AXIS),
        oa.accumulate(K, axis_name=AXIS),
        opt,
    )
    got, state = RUNNERS[runner](tx, params, data, weighted=True, scaled=True)
    want = _reference(opt, params, *clean, weighted=True)
    _assert_same_on_every_device(got)
    chex.assert_trees_all_close(_first(got), want, **TOL[jnp.float32])
    # Every device halved its scale once; none stepped on the bad batch.
    np.testing.assert_array_equal(
        np.asarray(oa.loss_scale(state)), init_scale / 2
    )
    assert (np.asarray(state[1].gradient_step) == WINDOWS).all()


# -------------------------------------------------- sharded params (GSPMD)


def _sharded_problem(mesh):
    rng = np.random.default_rng(4)
    params = {
        "w": rng.normal(size=(6, 8)).astype(np.float32),
        "b": np.zeros(8, np.float32),
    }
    specs = {"w": P(None, "model"), "b": P("model")}
    params = _put(mesh, params, specs)
    x = jax.device_put(
        rng.normal(size=(16, 6)).astype(np.float32),
        NamedSharding(mesh, P("data", None)),
    )
    y = jax.device_put(
        rng.normal(size=(16, 8)).astype(np.float32),
        NamedSharding(mesh, P("data", None)),
    )
    return params, x, y


def _same_sharding(tree, params):
    """Each leaf of ``tree`` (a params-like tree) is sharded as in params."""
    for (path, a), p in zip(
        jax.tree_util.tree_leaves_with_path(tree),
        jax.tree.leaves(params),
        strict=True,
    ):
        assert a.sharding.is_equivalent_to(p.sharding, a.ndim), (
            jax.tree_util.keystr(path),
            a.sharding,
            p.sharding,
        )


def _state_shardings_follow_params(state, params):
    acc = state[0]
    assert isinstance(acc, oa.AccumulateState)
    _same_sharding(acc.acc, params)
    adam = state[1][0]
    assert isinstance(adam, optax.ScaleByAdamState)
    _same_sharding(adam.mu, params)
    _same_sharding(adam.nu, params)


def _sharded_step(tx, fused):
    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)

    def step(params, state, x, y):
        grads = jax.grad(loss)(params, x, y)
        if fused:
            return oa.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step)


def _check_sharded_steps(tx, fused, params, state, x, y, inner=lambda s: s):
    """Three jitted steps (non-closing, closing, non-closing with k=2) keep
    the shardings; the compiled step has no all-gather. ``inner`` picks the
    ``oa.chain(accumulate, adam)`` state out of ``tx``'s state."""
    step = _sharded_step(tx, fused)
    text = step.lower(params, state, x, y).compile().as_text()
    assert text.count("all-gather") == 0
    new_params = params
    for _ in range(3):
        new_params, state = step(new_params, state, x, y)
        _same_sharding(new_params, params)
        _state_shardings_follow_params(inner(state), params)
    assert int(inner(state)[0].gradient_step) == 1


@pytest.mark.parametrize("fused", [True, False])
def test_state_sharding_follows_params_explicit_mesh(fused):
    """On a 4x2 ('data', 'model') mesh with explicit sharding (the default
    of ``jax.make_mesh``), params sharded over 'model': ``jax.jit(tx.init)``
    gives the accumulator and Adam's moments the params' sharding, and the
    jitted steps keep it without gathering anything."""
    mesh = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2
    )
    with jax.set_mesh(mesh):
        params, x, y = _sharded_problem(mesh)
        tx = oa.chain(oa.accumulate(2), optax.adam(0.1))
        state = jax.jit(tx.init)(params)
        _state_shardings_follow_params(state, params)
        _check_sharded_steps(tx, fused, params, state, x, y)


@pytest.mark.parametrize("fused", [True, False])
def test_state_sharding_follows_params_auto_mesh(fused):
    """Auto (GSPMD) sharding: ``optax.tree_map_params`` finds the params-like
    trees of the state, so ``jax.jit(tx.init, out_shardings=...)`` places
    them like the params; the jitted steps keep that placement."""
    mesh = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2
    )
    params, x, y = _sharded_problem(mesh)
    tx = optax.chain(
        optax.identity(), oa.chain(oa.accumulate(2), optax.adam(0.1))
    )
    shardings = optax.tree_map_params(
        tx,
        lambda _, p: p.sharding,
        jax.eval_shape(tx.init, params),
        params,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )
    state = jax.jit(tx.init, out_shardings=shardings)(params)
    _state_shardings_follow_params(state[1], params)
    _check_sharded_steps(tx, fused, params, state, x, y, inner=lambda s: s[1])


# ------------------------------------------- device-varying chain updates


def test_chain_inside_shard_map_with_device_varying_updates():
    """Inside ``shard_map``, each device its own params and Adam state (no
    ``axis_name``): the updates differ per device, and the zeros a closed
    gate emits must have that same device-varying type for ``lax.cond``.
    Equals the same chain vmapped over devices."""
    tx = oa.chain(oa.accumulate(2), optax.adam(0.1))
    params = _replicate(helpers.multihost_params())
    params = jax.tree.map(
        lambda a: (
            a + jnp.arange(N, dtype=a.dtype).reshape((N,) + (1,) * (a.ndim - 1))
        ),
        params,
    )
    state = jax.vmap(tx.init)(params)
    data = _data(3, ragged=False, seed=5)
    mesh = _mesh()

    def local(params, state, x, y, mask):
        grads = jax.grad(worker.local_loss)(params, x, y, mask)
        updates, state = tx.update(grads, state, params)  # plain protocol
        params = optax.apply_updates(params, updates)
        return oa.apply_gradients(tx, grads, state, params)  # fused

    def body(*args):
        return jax.tree.map(
            lambda a: a[None], local(*jax.tree.map(lambda a: a[0], args))
        )

    d = P(AXIS)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=d, out_specs=d))
    ref = jax.jit(jax.vmap(local))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, d))  # noqa: E731
    got, want = put((params, state)), (params, state)
    for t in range(len(data[0])):
        micro = tuple(a[t] for a in data)
        got = fn(*got, *put(micro))
        want = ref(*want, *micro)
    chex.assert_trees_all_close(got, want, **TOL[jnp.float32])


# ------------------------------------------------- two processes (gloo)


def test_two_processes_match_single_process(tmp_path):
    """Two ``jax.distributed`` processes x 2 CPU devices (gloo collectives),
    pmap + ``accumulate(axis_name)``, weighted by token counts: the params
    equal a single-process big-batch run on the same global batches."""
    out = workers.run_two_processes(tmp_path, "_multihost_worker.py")
    data = worker.make_data(2 * worker.LOCAL_DEVICES, worker.WINDOWS * worker.K)
    want = _reference(
        optax.adam(worker.LEARNING_RATE),
        helpers.multihost_params(),
        *data,
        weighted=True,
        k=worker.K,
    )
    np.testing.assert_allclose(
        np.load(out), worker.flatten(want), **TOL[jnp.float32]
    )


# ------------------------------------------------ example and benchmark


def _run_script(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_example_data_parallel_runs_on_8_cpu_devices():
    out = _run_script(
        "examples/data_parallel.py",
        "--steps",
        "6",
        "--accum",
        "2",
        "--log-every",
        "3",
    )
    assert out.startswith("8 cpu device(s)"), out
    assert "optimizer steps   3" in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("final loss"), out
    assert np.isfinite(float(last.split()[2])), out


def test_bench_multidevice_tiny():
    import json

    res = json.loads(
        _run_script("benchmarks/bench_multidevice.py", "--tiny", "--json")
        .strip()
        .splitlines()[-1]
    )
    per_window = res["all_reduces_per_window"]
    assert per_window["oa.accumulate(axis_name)"] == 1, res
    assert per_window["pmean + MultiSteps"] == res["k"], res
    assert per_window["pmean + oa.accumulate"] == res["k"], res
    assert res["all_reduces"]["oa.accumulate(axis_name)"]["top_ops"] == 0
    assert set(res["seconds"]) == set(per_window)


@pytest.mark.parametrize("runner", ["pmap", "shard_map"])
def test_window_beyond_2_to_the_24_on_one_device_keeps_its_low_part(runner):
    """Device 0's window of weight 2**24 + 2 (a call of 2**24, gradient 0,
    then two of weight 1, gradient 1; float32 alone rounds each +1 away),
    the other devices' weight 0: each device's low part is added to its
    weight before the one sum over the devices, so the budget of
    every_weight(2**24 + 2) is reached on the third call, and the window's
    mean is 2 / (2**24 + 2)."""
    budget = 2**24 + 2
    tx = oa.chain(
        oa.accumulate(oa.every_weight(budget), axis_name=AXIS), optax.sgd(1.0)
    )
    params = jnp.zeros(2)

    def local(state, g, w):
        u, state = tx.update(g, state, params, accum_weight=w)
        return u, state, oa.has_updated(state)

    put = lambda t: t  # noqa: E731
    if runner == "pmap":
        step = jax.pmap(local, axis_name=AXIS)
    else:  # pmap's layout: every leaf with a leading device axis
        mesh, d = _mesh(), P(AXIS)
        put = lambda t: jax.device_put(t, NamedSharding(mesh, d))  # noqa: E731

        def body(*args):
            out = local(*jax.tree.map(lambda a: a[0], args))
            return jax.tree.map(lambda a: a[None], out)

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=d, out_specs=d))
    state = put(_replicate(tx.init(params)))
    closed, u = [], None
    for g, w in [(0.0, 2.0**24), (1.0, 1.0), (1.0, 1.0)]:
        weights = jnp.zeros(N).at[0].set(w)
        grads = jnp.zeros((N, 2)).at[0].set(g)
        u, state, flag = step(state, *put((grads, weights)))
        closed.append(bool(np.asarray(flag)[0]))
    assert closed == [False, False, True], closed
    want = -2.0 / budget  # float64
    np.testing.assert_allclose(np.asarray(u), np.full((N, 2), want), rtol=1e-7)
