"""Every gate is a real branch on every backend (API.md §1, §10).

XLA:GPU's ``simplify-conditional`` pass rewrites a two-branch conditional
whose branches hold only cheap elementwise ops into a ``select`` that runs
both branches: the optimizer would then run on every micro-step. It leaves a
branch holding an ``optimization_barrier`` alone. XLA:CPU never rewrites the
conditional, so these tests read the lowered module instead of timing: every
``stablehlo.case`` of a gated step returns its results through an
``optimization_barrier`` in each of its regions, on every path a gate takes.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import optaxaccum as oa
from optaxaccum import flax as oa_flax
from optaxaccum.flax import nnx as oa_nnx
from tests import helpers
from tests import mesh_helpers as mh

K = 2
BARRIER = "stablehlo.optimization_barrier"
GATE_LOOP = "optaxaccum_gate/while"


def _walk(op):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _walk(inner)


def _origin(value):
    """The op that made ``value``, looking through Shardy's sharding
    annotations (``sdy.*``: placement only, no computation)."""
    owner = value.owner
    while getattr(owner, "name", "").startswith("sdy.") and owner.operands:
        owner = owner.operands[0].owner
    return getattr(owner, "name", None)


def _unkept_regions(lowered):
    """``(number of cases, [(case index, region index)])`` of the case
    regions whose results do not come from an optimization barrier of that
    region (an empty list: every branch is kept)."""
    module = lowered.compiler_ir("stablehlo")
    ops = list(_walk(module.operation))
    cases = [op for op in ops if op.name == "stablehlo.case"]
    # The fused step's loop of 0 or 1 trips: XLA:GPU keeps a loop (it
    # rewrites conditionals only), so it needs no barrier.
    loops = [
        op
        for op in ops
        if op.name == "stablehlo.while" and GATE_LOOP in str(op.location)
    ]
    bad = []
    for i, case in enumerate(cases):
        for j, region in enumerate(case.regions):
            ret = list(region.blocks[0].operations)[-1]
            owners = [_origin(v) for v in ret.operands]
            if any(o != BARRIER for o in owners) or not owners:
                bad.append((i, j))
    return len(cases) + len(loops), bad


def _fused(tx, **extra):
    def step(params, state, grads):
        return oa.apply_gradients(tx, grads, state, params, **extra)

    return step


def _plain(tx, **extra):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    return step


def _lower(step, tx):
    p = helpers.ones_and_zeros()
    return jax.jit(step).lower(p, tx.init(p), p)


ADAM = optax.adam(1e-3)
CHAINS = {
    "accumulate": lambda: oa.chain(oa.accumulate(K), ADAM),
    "loss_scale": lambda: oa.chain(
        oa.dynamic_loss_scale(), oa.agc(0.01), oa.accumulate(K), ADAM
    ),
    "loss_scale_alone": lambda: oa.chain(oa.dynamic_loss_scale(), ADAM),
    "noise_scale": lambda: oa.chain(
        oa.accumulate(K, noise_scale_decay=0.9), ADAM
    ),
    "nested_in_optax": lambda: optax.chain(
        oa.agc(0.01), oa.chain(oa.accumulate(K), ADAM)
    ),
    "nested_gates": lambda: oa.chain(
        oa.accumulate(K), oa.chain(oa.accumulate(K), ADAM)
    ),
    "skip_nonfinite": lambda: oa.chain(
        oa.accumulate(K, skip_nonfinite=True), ADAM
    ),
    "MultiSteps": lambda: oa.MultiSteps(ADAM, K),
}


def _assert_kept(lowered, at_least=1):
    n, bad = _unkept_regions(lowered)
    assert n >= at_least, f"{n} conditional(s): the gate did not branch"
    assert not bad, f"case regions without an optimization barrier: {bad}"


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("path", ["fused", "plain"])
def test_every_gate_branch_is_kept(name, path):
    tx = CHAINS[name]()
    step = (_fused if path == "fused" else _plain)(tx)
    _assert_kept(_lower(step, tx))


def test_flush_branch_is_kept():
    tx = oa.chain(oa.accumulate(K), ADAM)

    def step(params, state):
        return oa.flush(tx, state, params)

    p = helpers.ones_and_zeros()
    _assert_kept(jax.jit(step).lower(p, tx.init(p)))


def test_weighted_step_branch_is_kept():
    tx = oa.chain(oa.accumulate(K), ADAM)
    p = helpers.ones_and_zeros()
    step = _fused(tx, accum_weight=jnp.float32(3.0))
    _assert_kept(jax.jit(step).lower(p, tx.init(p), p))


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x)


def test_flax_train_state_branch_is_kept():
    model = _Dense()
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    state = oa_flax.TrainState.create(
        apply_fn=model.apply, params=params, tx=oa.chain(oa.accumulate(K), ADAM)
    )

    def step(state, grads):
        return state.apply_gradients(grads=grads)

    _assert_kept(jax.jit(step).lower(state, params))


def test_nnx_optimizer_branch_is_kept():
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    opt = oa_nnx.Optimizer(model, oa.chain(oa.accumulate(K), ADAM))
    graphdef, state = nnx.split((model, opt))
    grads = nnx.state(model, nnx.Param)

    def step(state, grads):
        model, opt = nnx.merge(graphdef, state)
        opt.update(model, grads)
        return nnx.state((model, opt))

    _assert_kept(jax.jit(step).lower(state, grads))


@pytest.mark.parametrize("shard_update", [False, True])
def test_mesh_and_shard_update_branches_are_kept(shard_update):
    """On 4 CPU devices (every machine has them): the window's reduction and
    ``shard_update``'s scatter and gather sit in the kept branch."""
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip(f"needs 4 CPU devices, has {len(devices)}")
    mesh = jax.make_mesh(
        (4,), ("data",), axis_types=(AxisType.Explicit,), devices=devices[:4]
    )
    tx = oa.chain(
        oa.accumulate(K, axis_name="data", shard_update=shard_update), ADAM
    )
    with jax.set_mesh(mesh):
        params = mh._put_params(mesh, helpers.mesh_mlp_params())
        state = jax.jit(tx.init)(params)
        batch = mh._put_batch(mesh, *(a[0] for a in mh._make_data(1)))
        step = jax.jit(mh._step_fn(tx, mesh, axis="data"))
        _assert_kept(step.lower(params, state, *batch))


def test_the_check_sees_an_unkept_branch():
    """The check itself: a bare ``lax.cond`` is reported."""

    def step(x, flag):
        return jax.lax.cond(flag, lambda: x * 2.0, lambda: x)

    lowered = jax.jit(step).lower(np.ones(3, np.float32), True)
    n, bad = _unkept_regions(lowered)
    assert n == 1 and bad == [(0, 0), (0, 1)]


def _load_bench(name):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
    spec = importlib.util.spec_from_file_location(name, path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_gpu_on_cpu(capsys):
    """``make bench-gpu`` without a GPU says so and exits 0; ``--cpu`` runs
    the same code here at a small size: every gated step keeps one
    conditional in the compiled HLO (timings are not checked)."""
    bench = _load_bench("bench_gpu")
    if jax.default_backend() != "gpu":
        assert bench._cli([]) == 0
        assert "no GPU here" in capsys.readouterr().out
    res = bench.main(cpu=True, calls=2)
    gated = {n: v for n, v in res["rows"].items() if v["gated"]}
    assert len(gated) == 6 and not res["lost"]
    assert all(v["conditionals"] >= 1 for v in gated.values()), gated
    assert res["device"]["backend"] == jax.default_backend()
    assert all(v["seconds"] > 0 for v in res["rows"].values())


def _make_dry_run(target, **variables):
    """``make -n target VAR=value ...`` from the repository root: the
    commands make would run."""
    import pathlib
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    root = pathlib.Path(__file__).resolve().parent.parent
    args = [f"{k}={v}" for k, v in variables.items()]
    out = subprocess.run(
        ["make", "-n", target, *args],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def test_make_bench_gpu_on_a_fresh_clone_makes_the_venv(tmp_path):
    """``make bench-gpu`` on a fresh clone (no .venv) whose python cannot
    import jax makes the venv with the package, as the other targets do,
    and runs the benchmark with it (it ran the system python and died
    with ModuleNotFoundError: jax); a python that imports jax (a GPU
    machine's own JAX, offline) is used as it is, installing nothing."""
    import sys

    venv = tmp_path / "venv"
    fresh = _make_dry_run("bench-gpu", PYTHON="false", VENV=venv)
    assert f"false -m venv {venv}" in fresh
    assert f"{venv}/bin/python -m pip install -q -e ." in fresh
    assert f"{venv}/bin/python benchmarks/bench_gpu.py" in fresh
    own = _make_dry_run("bench-gpu", PYTHON=sys.executable, VENV=venv)
    assert "-m venv" not in own and "pip install" not in own
    assert f"{sys.executable} benchmarks/bench_gpu.py" in own
