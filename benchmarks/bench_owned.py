"""Muon under ``shard_update=True`` (owned leaves): per-device state bytes
and step FLOPs against single-device ``optax.contrib.muon``.

On 8 CPU devices (data=8 and data=2 x fsdp=4), for the transformer-shaped
and the stacked-layer parameter sets of ``tools/sharded_steps.py``: each
device's part of muon's state and the compiled step's FLOPs (XLA's cost
analysis, per device; a ``lax.switch`` counts its costliest branch), as a
multiple of ``1/data`` of single-device muon's (1.00: a perfect split).

Run: ``python benchmarks/bench_owned.py`` (about a minute per row on a
busy CPU).
"""

from __future__ import annotations

import os
import pathlib
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import optaxaccum as oa  # noqa: E402
from tools import sharded_steps as steps  # noqa: E402


def row(mesh_name: str, stacked: bool) -> dict:
    mesh, axis = steps.mesh(mesh_name)
    n = steps.data_size(mesh, axis)
    params = steps.transformer_params(stacked)
    opt = steps.stacked_muon() if stacked else steps.muon()
    ours = oa.whole_leaves(opt, layer_axis=0) if stacked else opt
    compiled, state, _, _ = steps.optimizer_step(mesh, axis, ours, params)
    whole = jax.jit(opt.update).lower(params, opt.init(params), params)
    per_device = sum(
        r.addressable_shards[0].data.nbytes for r in state[1].rows.values()
    )
    per_device += sum(
        x.addressable_shards[0].data.nbytes for x in state[1].shared
    )
    whole_bytes = steps.state_bytes(opt.init(params))
    return {
        "mesh": mesh_name,
        "set": "stacked" if stacked else "transformer",
        "state x 1/data": per_device / (whole_bytes / n),
        "flops x 1/data": steps.flops(compiled)
        / (steps.flops(whole.compile()) / n),
        "whole state KiB": whole_bytes / 1024,
    }


def main() -> None:
    for mesh_name in ("data8", "data2xfsdp4"):
        for stacked in (False, True):
            r = row(mesh_name, stacked)
            print(
                f"{r['mesh']:12s} {r['set']:12s} "
                f"state {r['state x 1/data']:.2f}"
                f"  flops {r['flops x 1/data']:.2f}"
                f"  (whole state {r['whole state KiB']:.0f} KiB)",
                flush=True,
            )


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
