"""Data parallelism: all-reduce once per window, not once per micro-batch.

A window of ``K = 4`` micro-batches on 8 devices (8 host CPU devices unless
the default backend has 8 or more), an MLP, Adam, each device computing the
plain local gradient of its own micro-batch, in a ``jax.shard_map`` step
(params and optimizer state donated). Three variants:

* ``pmean + MultiSteps`` (the optax way): ``lax.pmean`` of the gradients on
  every micro-batch, then ``optax.MultiSteps(adam, K)``;
* ``pmean + oa.accumulate``: the same per-micro-batch ``pmean``, then
  ``oa.chain(oa.accumulate(K), adam)`` (isolates the cost of the
  communication from that of the optimizer wrapper);
* ``oa.accumulate(axis_name)``: no collective in the user's step;
  ``oa.chain(oa.accumulate(K, axis_name="d"), adam)`` all-reduces the
  window's sum once, in the closing call.

Reported: the all-reduce ops of each compiled step, split into those at the
top level (executed on every call) and those inside the branch of a
``conditional`` (executed only when the window closes), with the bytes they
reduce; the all-reduces executed per window derived from them; and the
wall time of a whole window (``K`` calls), median of interleaved rounds, as
a ratio to ``oa.accumulate(axis_name)``.

Run: ``python benchmarks/bench_multidevice.py [--tiny]``. ``main()`` returns
the results as a dict (see ``run_all.py``). The device count is fixed when
JAX starts; when the running process has fewer than 8 devices, ``main()``
measures in a fresh subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _devices  # noqa: E402
from _devices import N_DEVICES  # noqa: E402

_devices.ask_as_a_script(__name__)  # before JAX starts

import _common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optaxaccum as oa  # noqa: E402

K = 4
LEARNING_RATE = 1e-3
AXIS = "d"
FULL = dict(widths=(256, 1024, 1024, 256), batch=8, rounds=15, warmup=1)
TINY = dict(widths=(16, 32, 16), batch=2, rounds=3, warmup=0)

# ------------------------------------------------------------- the model


def mlp_loss(params, x, y):
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h - y) ** 2)


def per_device_state_specs(state, axis=AXIS):
    """In/out specs of an optimizer state inside ``shard_map``: the
    accumulators (``acc`` and ``weight`` of every ``oa.AccumulateState``)
    differ from device to device and are stored with a leading device axis;
    everything else is replicated."""
    specs = jax.tree.map(lambda _: P(), state)
    return oa.map_accumulators(specs, lambda _: P(axis))


def make_steps(mesh, params):
    """Compiled window steps of the three variants and their initial states.

    Returns ``{name: (compiled step, init_fn)}``; a step maps ``(params,
    state, x, y) -> (params, state)``.
    """
    adam = optax.adam(LEARNING_RATE)
    n = mesh.shape[AXIS]

    def local_grads(p, x, y):
        return jax.grad(mlp_loss)(lax.pcast(p, AXIS, to="varying"), x, y)

    def pmean_multisteps(tx):
        def step(p, s, x, y):
            g = lax.pmean(local_grads(p, x, y), AXIS)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return step

    def pmean_accumulate(tx):
        def step(p, s, x, y):
            g = lax.pmean(local_grads(p, x, y), AXIS)
            return oa.apply_gradients(tx, g, s, p)

        return step

    def ours(tx):
        def step(p, s, x, y):
            s = oa.map_accumulators(s, lambda a: a[0])
            p, s = oa.apply_gradients(tx, local_grads(p, x, y), s, p)
            return p, oa.map_accumulators(s, lambda a: a[None])

        return step

    variants = {
        "pmean + MultiSteps": (optax.MultiSteps(adam, K), pmean_multisteps),
        "pmean + oa.accumulate": (
            oa.chain(oa.accumulate(K), adam),
            pmean_accumulate,
        ),
        "oa.accumulate(axis_name)": (
            oa.chain(oa.accumulate(K, axis_name=AXIS), adam),
            ours,
        ),
    }
    batch_spec = P(AXIS)
    out = {}
    for name, (tx, make) in variants.items():
        state0 = tx.init(params)
        if name.startswith("oa.accumulate(axis"):
            specs = per_device_state_specs(state0)

            def init(p, tx=tx):
                return oa.map_accumulators(
                    tx.init(p), lambda a: jnp.broadcast_to(a, (n, *a.shape))
                )
        else:
            specs = jax.tree.map(lambda _: P(), state0)
            init = tx.init
        step = jax.jit(
            jax.shard_map(
                make(tx),
                mesh=mesh,
                in_specs=(P(), specs, batch_spec, batch_spec),
                out_specs=(P(), specs),
            ),
            donate_argnums=(0, 1),
        )
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        out[name] = (step, init, shardings)
    return out


# ------------------------------------------------------------ measuring


def _measure(tiny: bool) -> dict:

    cfg = TINY if tiny else FULL
    devices = jax.devices()[:N_DEVICES]
    mesh = jax.make_mesh(
        (N_DEVICES,),
        (AXIS,),
        devices=devices,
        axis_types=(jax.sharding.AxisType.Explicit,),
    )
    widths, batch = cfg["widths"], cfg["batch"]
    replicated = NamedSharding(mesh, P())
    data_sharding = NamedSharding(mesh, P(AXIS))

    def fresh_params():
        return jax.device_put(_common.init_mlp(widths), replicated)

    params = fresh_params()
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    xs = [
        jax.device_put(
            rng.normal(size=(N_DEVICES * batch, widths[0])).astype(np.float32),
            data_sharding,
        )
        for _ in range(K)
    ]
    ys = [
        jax.device_put(
            rng.normal(size=(N_DEVICES * batch, widths[-1])).astype(np.float32),
            data_sharding,
        )
        for _ in range(K)
    ]

    steps = make_steps(mesh, params)
    compiled, hlo, loops = {}, {}, {}
    for name, (step, init, shardings) in steps.items():
        p = fresh_params()
        s = jax.device_put(init(p), shardings)
        compiled[name] = step.lower(p, s, xs[0], ys[0]).compile()
        hlo[name] = _common.all_reduce_summary(compiled[name], mesh)
        loops[name] = {"params": p, "state": s}

    # Sanity (and a first, untimed window): from the same params, one window
    # of each variant moves them the same way. Adam's first step is about
    # +-lr per entry, less where the gradient is near 0 (there summation
    # order shows): compare against lr.
    seconds = _common.windows_alike_then_timed(
        compiled,
        loops,
        list(zip(xs, ys, strict=True)),
        "pmean + MultiSteps",
        1e-2 * LEARNING_RATE,
        cfg,
    )
    ours = "oa.accumulate(axis_name)"
    rows = []
    per_window = {}
    for name in steps:
        h = hlo[name]
        executed = K * h["top_ops"] + h["branch_ops"]
        per_window[name] = executed
        rows.append(
            [
                name,
                f"{h['top_ops']} ({_common.format_bytes(h['top_bytes'])})",
                f"{h['branch_ops']} "
                f"({_common.format_bytes(h['branch_bytes'])})",
                str(executed),
                _common.format_bytes(K * h["top_bytes"] + h["branch_bytes"]),
                f"{1e3 * seconds[name]:.2f}",
                f"{seconds[name] / seconds[ours]:.2f}x",
            ]
        )
    headers = [
        "variant",
        "all-reduce every call (bytes)",
        "all-reduce in closing branch (bytes)",
        f"all-reduces per window of {K}",
        "bytes per window",
        "ms/window",
        f"vs {ours}",
    ]
    tree_bytes = 4 * n_params
    target = _common.target
    targets = [
        target(
            f"{ours}: no all-reduce outside the closing branch",
            str(hlo[ours]["top_ops"]),
            hlo[ours]["top_ops"] == 0,
        ),
        target(
            f"{ours}: 1 gradient all-reduce per window "
            f"(>= one tree, {_common.format_bytes(tree_bytes)})",
            f"{per_window[ours]} "
            f"({_common.format_bytes(hlo[ours]['branch_bytes'])})",
            per_window[ours] == 1 and hlo[ours]["branch_bytes"] >= tree_bytes,
        ),
        target(
            f"pmean + MultiSteps: {K} gradient all-reduces per window",
            str(per_window["pmean + MultiSteps"]),
            per_window["pmean + MultiSteps"] == K,
        ),
        target(
            f"{ours} window not slower than pmean + MultiSteps",
            seconds["pmean + MultiSteps"] / seconds[ours],
            seconds[ours] <= seconds["pmean + MultiSteps"],
            suffix="x faster",
        ),
    ]
    return {
        "name": "B3",
        "title": (
            f"B3: data parallel, a window of k={K} micro-batches on "
            f"{N_DEVICES} {devices[0].platform.upper()} devices, "
            f"{n_params:,} float32 params, Adam; "
            f"median of {cfg['rounds']} interleaved rounds"
        ),
        "headers": headers,
        "rows": rows,
        "ratios": {
            f"B3 {n}": seconds[n] / seconds[ours] for n in steps if n != ours
        },
        "ratio_label": f"window time / {ours}",
        "targets": targets,
        "seconds": seconds,
        "all_reduces": hlo,
        "all_reduces_per_window": per_window,
        "k": K,
    }


def main(tiny: bool = False) -> dict:
    """Runs the benchmark; returns the results (see ``run_all.py``)."""
    return _common.on_devices(__file__, _measure, tiny, N_DEVICES)


if __name__ == "__main__":
    _common.run_script(main)
