"""Gather once, hidden: what peeling the first and last micro-batch off the
scan costs in memory and compile time.

Compiles the step of ``gather_once_census.py`` (a 3-leaf MLP on ``data=2 x
fsdp=4``, ``k`` interleaved micro-batches, every fsdp-sharded weight held)
three times: as the library builds it (the first and last micro-batch
outside the scan), with every micro-batch in the scan (``peel=False``) and
not held (``gather_once=None``), and prints the per-device memory
(argument + output - alias + temp bytes of ``memory_analysis()``), the
temp bytes alone and the compile time (lower + compile, the best of 3; a
timing, not an assertion). Nothing is run:

    python benchmarks/gather_once_peel.py                 # 8 CPU devices
    python benchmarks/gather_once_peel.py --backend gpu --target T.txtpb
    python benchmarks/gather_once_peel.py --backend tpu   # libtpu, v5e:2x4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _devices  # noqa: E402

if "--backend" not in sys.argv or "cpu" in sys.argv:
    _devices.ask_for()

import gather_once_census as census  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

STRUCTURES = {  # label: (hold, peel)
    "not held": (False, True),
    "all in the scan": (True, False),
    "peeled": (True, True),
}


def measure(mesh, k, hold, peel):
    """(memory bytes, temp bytes, best compile seconds of 3)."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        compiled = census.compile_step(mesh, "data2xfsdp4", k, hold, peel=peel)
        times.append(time.perf_counter() - start)
    m = compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    return int(total), int(m.temp_size_in_bytes), min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend", default="cpu", choices=["cpu", "gpu", "tpu"]
    )
    parser.add_argument("--target", help="XLA:GPU target config (txtpb)")
    args = parser.parse_args(argv)
    devs = census.devices(args.backend, args.target)
    mesh = jax.sharding.Mesh(
        np.array(devs).reshape(2, 4),
        ("data", "fsdp"),
        axis_types=(AxisType.Explicit,) * 2,
    )
    print("| backend | k | structure | memory B | temp B | compile s |")
    print("|---|---:|---|---:|---:|---:|")
    for k in (2, 4, 8):
        for label, (hold, peel) in STRUCTURES.items():
            total, temp, secs = measure(mesh, k, hold, peel)
            print(
                f"| {args.backend} | {k} | {label} | {total} | {temp} | "
                f"{secs:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
