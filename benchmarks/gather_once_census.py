"""Gather once per step: the collectives of a compiled step, per step.

Compiles one jitted step of ``k`` in-step micro-batches
(``oa.microbatched_value_and_grad``, interleaved, token-weighted, wrapped in
``oa.unreduced_value_and_grad(..., "data")`` on ``data x fsdp``) of a
3-leaf MLP whose weights are sharded over ``fsdp`` and gathered with
``oa.fsdp_gather``, with and without ``gather_once``, and counts its
weight-sized collectives per step (an op inside the scan's ``while`` loop
runs once per micro-batch it holds: ``k``, or ``k - 2`` held, where the first
and last micro-batch run outside it), how many of them have no compute (a
GEMM or a loop) scheduled between their start and their done (*exposed*)
and the share of their bytes overlapped by compute
(``oa.collective_exposure``), and its per-device memory (argument +
output - alias + temp bytes of ``memory_analysis()``).
``--options k=v,...``: per-jit compiler options (e.g.
``xla_gpu_reduce_scatter_combine_threshold_bytes=0``). Nothing is
run: the step is only compiled, so the same script compiles for GPUs or
TPUs that are not there:

    python benchmarks/gather_once_census.py            # 8 CPU devices
    python benchmarks/gather_once_census.py --backend gpu --target T.txtpb
    python benchmarks/gather_once_census.py --backend tpu  # libtpu, v5e:2x4

``--backend gpu`` needs the jax CUDA plugin wheels on ``PYTHONPATH``
(``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``) and an XLA target
config; it compiles for the topology ``1x1x8`` (8 GPUs of one host).
``--backend tpu`` needs ``libtpu`` and compiles for ``v5e:2x4``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _devices  # noqa: E402

if "--backend" not in sys.argv or "cpu" in sys.argv:
    _devices.ask_for()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optaxaccum as oa  # noqa: E402

D_IN, HIDDEN, D_OUT, BATCH = 256, 512, 128, 256
MESHES = {
    "data2xfsdp4": (("data", "fsdp"), "fsdp", None),
    "replica2xfsdp4": (("replica", "fsdp"), ("fsdp", "replica"), "replica"),
}


def devices(backend: str, target: str | None) -> list:
    """8 devices to compile for."""
    from jax.experimental import topologies

    if backend == "cpu":
        return jax.devices("cpu")[:8]
    if backend == "gpu":
        with open(target) as f:
            config = f.read()
        return topologies.get_topology_desc(
            platform="cuda",
            topology_name="",
            target_config=config,
            topology="1x1x8",
        ).devices
    return topologies.get_topology_desc("v5e:2x4", "tpu").devices


def loss_fn(axes):
    def loss(params, batch):
        x, y, mask = batch
        h = x @ oa.fsdp_gather(params["w1"], axes)
        b = jnp.broadcast_to(oa.fsdp_gather(params["b1"], axes), h.shape)
        h = jnp.tanh(h + jax.reshard(b, jax.typeof(h).sharding.spec))
        per = ((h @ oa.fsdp_gather(params["w2"], axes) - y) ** 2).mean(-1)
        return (mask * per).sum() / jnp.maximum(mask.sum(), 1.0)

    return loss


def compile_step(mesh, mesh_name, k, hold, dtype=None, options=None, peel=True):
    names, entry, over = MESHES[mesh_name]
    gather_once = (
        oa.GatherOnce(names, over=over, dtype=dtype, peel=peel)
        if hold
        else None
    )
    micro = functools.partial(
        oa.microbatched_value_and_grad,
        num_microbatches=k,
        interleave=True,
        weight_fn=lambda b: b[2].sum(),
        gather_once=gather_once,
    )
    loss = loss_fn(names)
    f = (
        oa.unreduced_value_and_grad(loss, "data", value_and_grad=micro)
        if "data" in names
        else micro(loss)
    )

    def sds(shape, spec):
        return jax.ShapeDtypeStruct(
            shape, jnp.float32, sharding=NamedSharding(mesh, spec)
        )

    params = {
        "w1": sds((D_IN, HIDDEN), P(entry, None)),
        "b1": sds((HIDDEN,), P()),
        "w2": sds((HIDDEN, D_OUT), P(entry, None)),
    }
    rows = P(names)
    batch = (
        sds((BATCH, D_IN), rows),
        sds((BATCH, D_OUT), rows),
        sds((BATCH,), rows),
    )
    with jax.set_mesh(mesh):
        return (
            jax.jit(f, compiler_options=options).lower(params, batch).compile()
        )


def census(compiled, mesh, k, hold=False):
    """Weight-sized collectives per step: ``{op: {"loop": n, "out": n,
    "per_step": n}}``, their exposure (``oa.collective_exposure``) and the
    per-device memory."""
    smallest = 4 * HIDDEN * D_OUT // 8  # a weight's smallest shard
    trips = max(k - 2, 0) if hold else k  # held: first and last peeled
    out: dict = {}
    for o in oa.collective_census(compiled, mesh):
        if o["bytes"] < smallest:
            continue
        axes = "+".join(sorted(o["axes"]))
        row = out.setdefault(f"{o['op']} over {axes}", dict(loop=0, out=0))
        row["loop" if o["loop"] else "out"] += 1
    for row in out.values():
        row["per_step"] = trips * row["loop"] + row["out"]
    text = compiled.as_text()
    exposure = oa.collective_exposure(text, min_bytes=4 * HIDDEN * D_OUT)
    m = compiled.memory_analysis()
    memory = None
    if m is not None:
        memory = int(
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + m.temp_size_in_bytes
        )
    return out, exposure, memory


def _options(text):
    """``k=v,...`` as a dict of compiler options (ints and bools parsed)."""
    out = {}
    for kv in filter(None, (text or "").split(",")):
        key, value = kv.split("=", 1)
        parsed = {"true": True, "false": False}.get(value, value)
        out[key] = int(value) if value.lstrip("-").isdigit() else parsed
    return out or None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend", default="cpu", choices=["cpu", "gpu", "tpu"]
    )
    parser.add_argument("--target", help="XLA:GPU target config (txtpb)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--options", help="compiler options, k=v,...")
    args = parser.parse_args(argv)
    devs = devices(args.backend, args.target)
    results = []
    for mesh_name, (names, _, _) in MESHES.items():
        mesh = jax.sharding.Mesh(
            np.array(devs).reshape(2, 4),
            names,
            axis_types=(AxisType.Explicit,) * 2,
        )
        for k in (1, 2, 4, 8):
            for hold in (False, True):
                compiled = compile_step(
                    mesh, mesh_name, k, hold, options=_options(args.options)
                )
                ops, exposure, memory = census(compiled, mesh, k, hold)
                results.append(
                    dict(
                        mesh=mesh_name,
                        k=k,
                        hold=hold,
                        ops=ops,
                        exposure=exposure,
                        memory=memory,
                    )
                )
                cells = ", ".join(
                    f"{name}: {r['per_step']} ({r['loop']} in loop)"
                    for name, r in sorted(ops.items())
                )
                print(
                    f"{args.backend} {mesh_name} k={k} "
                    f"{'held' if hold else 'default'}: {cells}; "
                    f"exposed {exposure['exposed']} of "
                    f"{exposure['collectives']}, "
                    f"{100 * exposure['overlapped']:.0f}% of bytes "
                    f"overlapped; memory {memory} B",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
