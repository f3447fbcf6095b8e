"""What the mesh examples share: their devices, their command line, and
what they print about a compiled step. Importing it starts no JAX backend,
so a script can ask for devices first."""

import argparse
import os

_DEVICE_COUNT = "xla_force_host_platform_device_count"


def ask_for_host_devices(n=8):
    """Asks XLA for ``n`` host CPU devices, unless ``XLA_FLAGS`` already
    sets a count: call before JAX starts its CPU backend (GPUs are used as
    they are)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_COUNT not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{_DEVICE_COUNT}={n}"


def training_parser(description, *, steps, batch, batch_help, hidden):
    """The command line of a mesh example's training run: ``--steps``,
    ``--accum``, ``--batch``, ``--lr`` and ``--hidden``, with these
    defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--steps",
        type=int,
        default=steps,
        help="micro-steps (calls of the train step)",
    )
    parser.add_argument(
        "--accum",
        type=int,
        default=4,
        help="micro-batches per optimizer step (window)",
    )
    parser.add_argument("--batch", type=int, default=batch, help=batch_help)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=hidden)
    return parser


def census_line(compiled, mesh, k):
    """The weights' all-gathers and reduce-scatters per step of ``k``
    micro-batches (one inside the scan's loop runs once per micro-batch)
    and the per-device memory of the compiled step."""
    import optaxaccum as oa

    per_step = {"all-gather": [0, 0], "reduce-scatter": [0, 0]}
    for o in oa.collective_census(compiled, mesh):
        if o["op"] in per_step and o["bytes"] > 64:
            per_step[o["op"]][0] += k if o["loop"] else 1
            per_step[o["op"]][1] += o["loop"]
    m, memory = compiled.memory_analysis(), "n/a"
    if m is not None:
        used = m.argument_size_in_bytes + m.output_size_in_bytes
        used += m.temp_size_in_bytes - m.alias_size_in_bytes
        memory = f"{used / 1024:.0f} KiB"
    counts = ", ".join(
        f"{n} {c[0]} ({c[1]} in the loop)" for n, c in per_step.items()
    )
    return f"{counts}; memory {memory}"
