"""B4: sharded meshes under ``jax.jit``: one data-axis reduction per window.

A window of ``K = 4`` micro-batches on 8 devices (8 host CPU devices unless
the default backend has 8 or more), an MLP whose weights and biases are
sharded over ``fsdp`` (FSDP) and whose batch is sharded over every mesh axis,
Adam, the fused ``oa.apply_gradients`` step jitted with params and state
donated, on two explicit meshes: ``data=2 x fsdp=4`` and ``data=8``. Two
variants on each, side by side in one run:

* ``naive jit``: ``jax.value_and_grad`` + ``oa.chain(oa.accumulate(K),
  adam)``: every micro-batch's backward pass all-reduces the gradient over
  ``data`` (the compiler cannot defer it);
* ``oa.unreduced_value_and_grad``: ``+ oa.chain(oa.accumulate(K,
  axis_name="data"), adam)``: the gradients stay unreduced over ``data``,
  the accumulator adds them locally and reduces once, in the closing branch;
* ``shard_update=True``: the same with ``oa.accumulate(K, axis_name="data",
  shard_update=True)``: the window's reduction over ``data`` is a
  reduce-scatter, Adam runs on each device's shard with its moments sharded
  over ``data`` and ``fsdp``, and the updates are all-gathered (ZeRO-1 once
  per window);
* on the FSDP mesh also ``unreduced over ("data", "fsdp")``: both axes
  named, so no gradient reduction at all on micro-steps, at the cost of an
  accumulator as large as the unsharded tree.

Reported from the compiled step (the project's HLO reader, replica groups
mapped to mesh axes): collectives over ``data`` executed per window (every
call's times ``K`` plus the closing branch's), split into gradient
reductions (larger than a few scalars) and scalar ones (the loss); their
bytes (result shapes) and kinds; collectives over ``fsdp`` only; the
accumulator's and the optimizer state's bytes per device; and the wall
time of a whole window (``K`` calls), median of interleaved rounds, as a
ratio to ours.

Run: ``python benchmarks/bench_mesh.py [--tiny]``. ``main()`` returns the
results as a dict (see ``run_all.py``); with fewer than 8 devices it
measures in a subprocess with
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
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optaxaccum as oa  # noqa: E402
from tools.mesh_mlp import make_loss  # noqa: E402

K = 4
LEARNING_RATE = 1e-3
SCALAR_BYTES = 64  # collectives this small carry scalars (loss, counts)
MESHES = {"data=2 x fsdp=4": (2, 4), "data=8": (8,)}
FULL = dict(widths=(256, 1024, 1024, 256), batch=64, rounds=11, warmup=1)
TINY = dict(widths=(16, 32, 16), batch=16, rounds=2, warmup=0)
OURS = "oa.unreduced_value_and_grad"
NAIVE = "naive jit"
BOTH = 'unreduced over ("data", "fsdp")'
SHARD = "shard_update=True"
AXES = {NAIVE: None, OURS: "data", BOTH: ("data", "fsdp"), SHARD: "data"}

# ------------------------------------------------------------ measuring


def _mesh(shape):
    names = ("data", "fsdp")[: len(shape)]
    return jax.make_mesh(
        shape,
        names,
        axis_types=(AxisType.Explicit,) * len(shape),
        devices=jax.devices()[:N_DEVICES],
    )


def _variant(mesh, axis, shard_update=False):
    loss = make_loss(tuple(mesh.axis_names))
    adam = optax.adam(LEARNING_RATE)
    if axis is not None:
        acc = oa.accumulate(K, axis_name=axis, shard_update=shard_update)
        tx = oa.chain(acc, adam)
        value_and_grad = oa.unreduced_value_and_grad(loss, axis)
    else:
        tx = oa.chain(oa.accumulate(K), adam)
        value_and_grad = jax.value_and_grad(loss)

    def step(params, state, x, y):
        _, grads = value_and_grad(params, x, y)
        return oa.apply_gradients(tx, grads, state, params)

    return tx, jax.jit(step, donate_argnums=(0, 1))


def _per_window(ops):
    """Collectives executed in a window: every call's K times, plus the
    closing branch's once."""
    return [o for o in ops for _ in range(K if not o["branches"] else 1)]


def _scalar(o):
    """Whether ``o`` reduces scalars (the loss, counts): a small
    all-reduce (a shard_update reduce-scatter of a bias can be as small)."""
    return o["op"] == "all-reduce" and o["bytes"] <= SCALAR_BYTES


def _over(ops, axis, *, top=None):
    """The collectives of ``ops`` spanning ``axis``; with ``top`` only those
    run on every call (True) or only inside a conditional (False)."""
    return [
        o
        for o in ops
        if axis in o["axes"] and (top is None or (not o["branches"]) == top)
    ]


def _census_row(ops, tree_bytes):
    top = [o for o in _over(ops, "data", top=True) if not _scalar(o)]
    data = _over(_per_window(ops), "data")
    grads = [o for o in data if not _scalar(o)]
    fsdp = [o for o in _per_window(ops) if o["axes"] == {"fsdp"}]
    micro = [o for o in ops if not o["branches"]]
    kinds = {}
    for o in grads:
        kinds[o["op"]] = kinds.get(o["op"], 0) + o["bytes"]
    return {
        # Result bytes per window over data, by kind of collective.
        "data_grad_kinds": kinds,
        # Collective output of a micro-step (outside the closing branch),
        # in parameter trees.
        "micro_step_trees": sum(o["bytes"] for o in micro) / tree_bytes,
        "all_bytes": sum(o["bytes"] for o in _per_window(ops)),
        "data_grad_ops": len(grads),
        "data_grad_bytes": sum(o["bytes"] for o in grads),
        "data_scalar_ops": len(data) - len(grads),
        "fsdp_ops": len(fsdp),
        "fsdp_bytes": sum(o["bytes"] for o in fsdp),
        "top_data_grad_ops": len(top),
        "top_grad_reductions": len(
            [
                o
                for o in ops
                if not o["branches"]
                and o["op"] in ("all-reduce", "reduce-scatter")
                and o["bytes"] > SCALAR_BYTES
            ]
        ),
        # Calls of the window that reduce the gradient over data.
        "data_grad_calls": K * bool(top)
        + bool([o for o in _over(ops, "data", top=False) if not _scalar(o)]),
    }


def _measure_mesh(shape, cfg):

    mesh = _mesh(shape)
    widths, batch = cfg["widths"], cfg["batch"]
    specs = [
        {
            "w": P("fsdp" if "fsdp" in mesh.axis_names else None, None),
            "b": P("fsdp" if "fsdp" in mesh.axis_names else None),
        }
        for _ in widths[1:]
    ]
    rng = np.random.default_rng(0)
    batch_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    xs = [
        jax.device_put(
            rng.normal(size=(batch, widths[0])).astype(np.float32),
            batch_sharding,
        )
        for _ in range(K)
    ]
    ys = [
        jax.device_put(
            rng.normal(size=(batch, widths[-1])).astype(np.float32),
            batch_sharding,
        )
        for _ in range(K)
    ]

    def fresh_params():
        return jax.tree.map(
            lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
            _common.init_mlp(widths),
            specs,
        )

    tree_bytes = 4 * sum(
        int(np.prod(a.shape)) for a in jax.tree.leaves(_common.init_mlp(widths))
    )
    names = [NAIVE, OURS, SHARD] + [BOTH] * ("fsdp" in mesh.axis_names)
    compiled, census, loops, acc_bytes, opt_bytes = {}, {}, {}, {}, {}
    with jax.set_mesh(mesh):
        for name in names:
            tx, step = _variant(mesh, AXES[name], name == SHARD)
            p = fresh_params()
            s = jax.jit(tx.init)(p)
            compiled[name] = step.lower(p, s, xs[0], ys[0]).compile()
            census[name] = _census_row(
                oa.collective_census(compiled[name].as_text(), mesh),
                tree_bytes,
            )
            acc_bytes[name] = sum(
                a.addressable_shards[0].data.nbytes
                for a in jax.tree.leaves(s[0].acc)
            )
            opt_bytes[name] = sum(
                a.addressable_shards[0].data.nbytes
                for a in jax.tree.leaves(s[1])
            )
            loops[name] = {"params": p, "state": s}

    # Sanity: one window moves all alike.
    seconds = _common.windows_alike_then_timed(
        compiled,
        loops,
        list(zip(xs, ys, strict=True)),
        NAIVE,
        1e-2 * LEARNING_RATE,
        cfg,
    )
    return census, seconds, acc_bytes, opt_bytes, tree_bytes


def _measure(tiny: bool) -> dict:

    cfg = TINY if tiny else FULL
    fmt = _common.format_bytes
    rows, targets, results = [], [], {}
    target = _common.target
    for mesh_name, shape in MESHES.items():
        census, seconds, acc_bytes, opt_bytes, tree_bytes = _measure_mesh(
            shape, cfg
        )
        fsdp = shape[1] if len(shape) > 1 else 1
        results[mesh_name] = dict(
            census=census,
            seconds=seconds,
            acc_bytes=acc_bytes,
            opt_bytes=opt_bytes,
            tree_bytes=tree_bytes,
        )
        for name in census:
            c = census[name]
            rows.append(
                [
                    mesh_name,
                    name,
                    f"{c['data_grad_calls']}: {c['data_grad_ops']} ops "
                    f"({fmt(c['data_grad_bytes'])})",
                    ", ".join(
                        f"{op} {fmt(b)}"
                        for op, b in sorted(c["data_grad_kinds"].items())
                    ),
                    str(c["data_scalar_ops"]),
                    f"{c['fsdp_ops']} ({fmt(c['fsdp_bytes'])})",
                    fmt(c["all_bytes"]),
                    f"{c['micro_step_trees']:.2f}",
                    fmt(acc_bytes[name]),
                    fmt(opt_bytes[name]),
                    f"{1e3 * seconds[name]:.2f}",
                    f"{seconds[name] / seconds[OURS]:.2f}x",
                ]
            )
        ours, naive = census[OURS], census[NAIVE]
        targets += [
            target(
                f"{mesh_name}: calls reducing the gradient over data "
                f"per window 1 (naive {K})",
                f"{ours['data_grad_calls']} vs {naive['data_grad_calls']}",
                ours["data_grad_calls"] == 1
                and naive["data_grad_calls"] == K
                and ours["data_grad_ops"] == 1,
            ),
            target(
                f"{mesh_name}: their bytes per window <= 1/{K} of naive",
                ours["data_grad_bytes"] / naive["data_grad_bytes"],
                ours["data_grad_bytes"] * K <= naive["data_grad_bytes"],
                suffix="x naive",
            ),
            target(
                f"{mesh_name}: collective output per micro-step <= "
                f"1 + 1/{fsdp} trees (all-gather + reduce-scatter)",
                f"{ours['micro_step_trees']:.2f} trees",
                ours["micro_step_trees"] <= 1 + 1 / fsdp,
            ),
            target(
                f"{mesh_name}: fsdp-only bytes per window <= (1 + 1/{fsdp})"
                " x naive's (its all-gathers)",
                fmt(ours["fsdp_bytes"]),
                ours["fsdp_bytes"] <= (1 + 1 / fsdp) * naive["fsdp_bytes"],
            ),
            target(
                f"{mesh_name}: all collective bytes per window below naive",
                f"{fmt(ours['all_bytes'])} vs {fmt(naive['all_bytes'])}",
                ours["all_bytes"] < naive["all_bytes"],
            ),
            target(
                f"{mesh_name}: accumulator per device = tree / {fsdp}",
                fmt(acc_bytes[OURS]),
                acc_bytes[OURS] * fsdp == tree_bytes,
            ),
            target(
                f"{mesh_name}: window not slower than naive",
                seconds[NAIVE] / seconds[OURS],
                seconds[OURS] <= seconds[NAIVE],
                suffix="x faster",
            ),
        ]
        targets += _shard_targets(
            mesh_name, census, acc_bytes, opt_bytes, shape[0]
        )
        if BOTH in census:
            both = census[BOTH]
            targets.append(
                target(
                    f"{mesh_name}, {BOTH}: no gradient reduction on "
                    "micro-steps (fsdp: all-gathers only), accumulator = "
                    "whole tree",
                    f"{both['top_grad_reductions']} ops, "
                    f"{fmt(acc_bytes[BOTH])}",
                    both["top_grad_reductions"] == 0
                    and both["data_grad_calls"] == 1
                    and acc_bytes[BOTH] == tree_bytes,
                )
            )
    n_params = results["data=8"]["tree_bytes"] // 4
    return {
        "name": "B4",
        "title": (
            f"B4: jit on an explicit mesh, a window of k={K} "
            f"micro-batches on {N_DEVICES} "
            f"{jax.devices()[0].platform.upper()} devices, "
            f"{n_params:,} float32 params (FSDP-sharded on "
            f"data=2 x fsdp=4), Adam; median of {cfg['rounds']} "
            "interleaved rounds"
        ),
        "headers": [
            "mesh",
            "variant",
            "calls reducing grads over data / window: ops (bytes)",
            "over data / window, by op (result bytes)",
            "scalar reductions over data / window",
            "fsdp-only collectives / window (bytes)",
            "all collectives / window (bytes)",
            "collective output / micro-step (trees)",
            "accumulator / device",
            "Adam state / device",
            "ms/window",
            f"vs {OURS}",
        ],
        "rows": rows,
        "ratios": {
            f"B4 {m} {name}": r["seconds"][name] / r["seconds"][OURS]
            for m, r in results.items()
            for name in r["seconds"]
            if name != OURS
        },
        "ratio_label": f"window time / {OURS}",
        "targets": targets,
        "notes": [
            "Collectives counted in the compiled (SPMD-partitioned) step. "
            "Scalar reductions are the loss's.",
            "Ours gathers the weights with oa.fsdp_gather, whose backward "
            "reduce-scatters the gradient over fsdp in the HLO (a plain "
            "reshard's is all-reduced whole, then sliced, on XLA:CPU); the "
            "data-axis reduction runs only in the closing branch.",
        ],
        "results": results,
        "k": K,
    }


def _shard_targets(mesh_name, census, acc_bytes, opt_bytes, data):
    """shard_update against the default (``OURS``) on one mesh."""
    target, fmt = _common.target, _common.format_bytes
    ours, shard = census[OURS], census[SHARD]
    tree = ours["data_grad_kinds"].get("all-reduce", 0)
    kinds = shard["data_grad_kinds"]
    return [
        target(
            f"{mesh_name}, {SHARD}: one call per window reduce-scatters "
            f"(1/{data} of the default's all-reduce) and all-gathers (the "
            "same bytes) over data, no all-reduce of the tree",
            ", ".join(f"{op} {fmt(b)}" for op, b in sorted(kinds.items())),
            shard["data_grad_calls"] == 1
            and shard["top_data_grad_ops"] == 0
            and set(kinds) == {"reduce-scatter", "all-gather"}
            and kinds["reduce-scatter"] * data == tree
            and kinds["all-gather"] == tree,
        ),
        target(
            f"{mesh_name}, {SHARD}: Adam state per device = the default's "
            f"/ {data}, accumulator unchanged",
            f"{fmt(opt_bytes[SHARD])} vs {fmt(opt_bytes[OURS])}",
            opt_bytes[SHARD] * data <= opt_bytes[OURS] + 64
            and acc_bytes[SHARD] == acc_bytes[OURS],
        ),
    ]


def main(tiny: bool = False) -> dict:
    """Runs the benchmark; returns the results (see ``run_all.py``)."""
    return _common.on_devices(__file__, _measure, tiny, N_DEVICES)


if __name__ == "__main__":
    _common.run_script(main)
