"""What the mesh examples print about a compiled step."""

import optaxaccum as oa


def census_line(compiled, mesh, k):
    """The weights' all-gathers and reduce-scatters per step of ``k``
    micro-batches (one inside the scan's loop runs once per micro-batch)
    and the per-device memory of the compiled step."""
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
