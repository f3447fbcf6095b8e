"""A communication model of one accumulation window, checked against HLO.

For a parameter count, a mesh ``dcn x data x fsdp`` (``dcn``: slices or
nodes joined by the slow network; ``data`` and ``fsdp``: devices inside a
slice), a window of ``k`` micro-batches and a mode, :func:`collectives`
lists the collectives a window runs (op, mesh axes, result bytes per device,
runs per window) and :func:`window_cost` turns them into bytes over the fast
links (ICI / NVLink) and the slow ones (DCN / InfiniBand), a projected time,
and the bytes each device holds. Modes:

* ``naive``: ``jax.value_and_grad`` + ``oa.accumulate(k)``: every micro-step
  gathers the params over ``fsdp``, reduce-scatters the gradient over
  ``fsdp`` and all-reduces its shard over the data axes;
* ``deferred``: ``oa.unreduced_value_and_grad`` + ``oa.accumulate(k,
  axis_name=<data axes>)``: the data-axes all-reduce runs once per window;
* ``shard_update``: the same with ``shard_update=True`` (API.md §7): once
  per window a reduce-scatter over the data axes, the optimizer on
  ``1/(data axes)`` of each shard, an all-gather of the updates;
* ``fsdp_all``: FSDP over every device, slices included (params and
  optimizer state sharded ``n`` ways): every micro-step gathers the params
  and reduce-scatters the gradient over all devices;
* ``owned``: ``shard_update=True`` with a follower that needs whole
  matrices (``optax.contrib.muon``): each matrix owned by one device of the
  data axes. Once per window, the reduce-scatter of ``shard_update``, an
  all-gather over ``fsdp`` of each device's data-slice of the gradient and
  the params, one all-to-all of those slices to the owners, and an
  all-gather of the owners' updates; muon's one moment per device is
  ``1/(data axes)`` of the tree, replicated over ``fsdp`` (balanced
  ownership assumed: the census test checks the padded rows exactly).

Gather once per step (``HELD_MODES``; the window is one jitted step of
``k`` micro-batches, ``oa.microbatched_value_and_grad`` with
``gather_once=oa.GatherOnce(...)``):

* ``held``: ``deferred`` with every leaf held over ``fsdp``: one all-gather
  of the params and one reduce-scatter of the gradient per step, whatever
  ``k`` (``deferred`` is the same step without holding);
* ``fsdp_all_held_dcn``: ``fsdp_all`` with ``over=("dcn",)``: the params
  gathered over the slow axis once per step (to the slice's shard), over
  the slice's devices every micro-batch; the gradient reduce-scattered over
  the slice every micro-batch and over ``dcn`` once.

Assumptions (docs/scaling.md, "Communication model"): ring algorithms
(all-reduce ``2 S (m-1)/m`` bytes sent per device for a result of ``S``
bytes over ``m`` devices; reduce-scatter and all-gather ``S (m-1)/m`` of the
full size ``S``); a collective spanning slices runs hierarchically (inside
the slice first, then across slices on the ``1/q`` piece); each device uses
its whole per-direction bandwidth; no overlap of communication with compute
nor between collectives; float32 params, gradients, accumulator and Adam
moments; activations and latency (a few microseconds per collective, times
the number of leaves or buckets) are not counted.

B6 of the benchmarks (``python benchmarks/comm_model.py``, ``make bench``)
prints the projected tables and writes ``docs/comm_model_table.md`` and
``docs/comm_exposed_table.md`` from this module. The model's bytes are
checked against the HLO census of compiled steps on 8 CPU devices by
``tests/repo/test_comm_model.py``.
"""

from __future__ import annotations

import dataclasses
import math

from tools.tables import markdown_table

MODES = ("naive", "deferred", "shard_update", "fsdp_all")
HELD_MODES = ("held", "fsdp_all_held_dcn")
OWNED = "owned"  # modelled, not in the projected tables' columns
MUON_MOMENTS = 1
BYTES = 4  # float32 params, gradients, accumulator, Adam moments
ADAM_MOMENTS = 2
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Mesh:
    """``dcn`` slices (or nodes) of ``data x fsdp`` devices each."""

    dcn: int = 1
    data: int = 1
    fsdp: int = 1

    @property
    def sizes(self) -> dict[str, int]:
        return {"dcn": self.dcn, "data": self.data, "fsdp": self.fsdp}

    @property
    def devices(self) -> int:
        return self.dcn * self.data * self.fsdp

    def axes(self, *names: str) -> frozenset[str]:
        """The axes among ``names`` of size > 1 (the others move nothing)."""
        return frozenset(n for n in names if self.sizes[n] > 1)

    def size(self, axes: frozenset[str]) -> int:
        return math.prod(self.sizes[a] for a in axes)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a window, for the whole parameter tree."""

    op: str  # "all-reduce", "reduce-scatter" or "all-gather"
    axes: frozenset[str]  # the mesh axes it spans
    result_bytes: float  # per device: the HLO result shape's bytes
    per_window: int  # runs per window


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-device bandwidths (bytes/s, one direction) and memory."""

    name: str
    fast: float  # ICI / NVLink
    slow: float  # DCN / InfiniBand
    memory: float  # bytes of HBM
    per_slice: int  # devices per slice (TPU) or node (GPU)
    source: str


# Bidirectional figures are halved: a ring sends one way at a time.
HARDWARE = {
    "tpu-v5p": Hardware(
        "TPU v5p",
        1200e9 / 2,
        50e9 / 8,
        95 * GIB,
        256,
        "Cloud TPU v5p docs: ICI 1,200 GB/s bidirectional per chip, "
        "DCN 50 Gbps per chip, 95 GiB HBM",
    ),
    "tpu-v5e": Hardware(
        "TPU v5e",
        400e9 / 2,
        6.4e12 / 8 / 256,
        16e9,
        256,
        "Cloud TPU v5e docs: ICI 400 GB/s bidirectional per chip, DCN "
        "6.4 Tbps per 256-chip pod (2 x 100 Gbps NICs per 8-chip host), "
        "16 GB HBM",
    ),
    "h100": Hardware(
        "H100 (DGX)",
        900e9 / 2,
        400e9 / 8,
        80e9,
        8,
        "NVIDIA H100 SXM datasheet: NVLink 900 GB/s bidirectional, 80 GB; "
        "DGX H100 user guide: one ConnectX-7 400 Gb/s InfiniBand port per "
        "GPU",
    ),
}


def collectives(
    n_params: int, mesh: Mesh, k: int, mode: str, held_bytes: int = BYTES
) -> list[Collective]:
    """The collectives of one window of ``k`` micro-batches (see module);
    ``held_bytes``: bytes per parameter of a held copy (2: bf16)."""
    modes = (*MODES, *HELD_MODES, OWNED)
    if mode not in modes:
        raise ValueError(f"mode must be one of {modes}, got {mode=!r}")
    tree = BYTES * n_params
    fsdp, data = mesh.axes("fsdp"), mesh.axes("dcn", "data")
    everything = fsdp | data
    out = []

    def add(op, axes, result, runs):
        if axes:
            out.append(Collective(op, axes, result, runs))

    if mode in HELD_MODES:
        _held_collectives(n_params, mesh, k, mode, held_bytes, add)
        return out
    if mode == "fsdp_all":
        n = mesh.size(everything)
        add("all-gather", everything, tree, k)
        add("reduce-scatter", everything, tree / n, k)
        return out
    shard = tree / mesh.size(fsdp)
    add("all-gather", fsdp, tree, k)  # the params, for the forward pass
    add("reduce-scatter", fsdp, shard, k)  # the gradient, to fsdp shards
    if mode == "naive":
        add("all-reduce", data, shard, k)
    elif mode == "deferred":
        add("all-reduce", data, shard, 1)
    else:  # shard_update: reduce-scatter, then gather the updates
        add("reduce-scatter", data, shard / mesh.size(data), 1)
        if mode == OWNED:  # the data-slices of gradient and params, to owners
            piece = tree / mesh.size(data)
            add("all-gather", fsdp, 2 * piece, 1)
            add("all-to-all", data, 2 * piece, 1)
        add("all-gather", data, shard, 1)
    return out


def _held_collectives(n_params, mesh, k, mode, held_bytes, add) -> None:
    """Adds the collectives of a step of ``k`` micro-batches with held
    leaves (``add(op, axes, result bytes, runs)`` appends one)."""
    tree, held = BYTES * n_params, held_bytes * n_params
    fsdp, data = mesh.axes("fsdp"), mesh.axes("dcn", "data")
    if mode == "held":  # every leaf held over fsdp
        shard = tree / mesh.size(fsdp)
        add("all-gather", fsdp, held, 1)
        add("reduce-scatter", fsdp, shard, 1)
        add("all-reduce", data, shard, 1)
    else:  # fsdp_all_held_dcn: held over dcn, gathered in the slice
        inner, dcn = mesh.axes("data", "fsdp"), mesh.axes("dcn")
        q = mesh.size(inner)
        add("all-gather", dcn, held / q, 1)
        add("all-gather", inner, held, k)
        add("reduce-scatter", inner, tree / q, k)
        add("reduce-scatter", dcn, tree / mesh.devices, 1)


def link_bytes(c: Collective, mesh: Mesh) -> tuple[float, float]:
    """Bytes one device sends over fast and slow links for ``c``, per run.

    A ring over ``m`` devices sends ``(m-1)/m`` of the full size for a
    reduce-scatter or an all-gather, twice that for an all-reduce. Across
    slices the collective is hierarchical: over the ``q`` devices of the
    slice first (fast), then over the ``s`` slices on ``1/q`` of it (slow).
    """
    q = mesh.size(c.axes - {"dcn"})
    s = mesh.size(c.axes & {"dcn"})
    full = c.result_bytes * (q * s if c.op == "reduce-scatter" else 1)
    fast = full * (q - 1) / q
    slow = full / q * (s - 1) / s
    if c.op == "all-reduce":
        return 2 * fast, 2 * slow
    return fast, slow


def memory(
    n_params: int, mesh: Mesh, k: int, mode: str, held_bytes: int = BYTES
) -> dict[str, float]:
    """Bytes per device: params, accumulator (none for ``k == 1``; for the
    held modes the unsharded gradient sum), Adam's moments, and the held
    copy (``held_copy``, the held modes only)."""
    tree = BYTES * n_params
    fsdp = mesh.size(mesh.axes("fsdp"))
    if mode in ("fsdp_all", "fsdp_all_held_dcn"):
        fsdp = mesh.devices
    opt = ADAM_MOMENTS * tree / fsdp
    if mode == "shard_update":
        opt /= mesh.size(mesh.axes("dcn", "data"))
    if mode == OWNED:  # muon's momentum, whole matrices on their owners
        opt = MUON_MOMENTS * tree / mesh.size(mesh.axes("dcn", "data"))
    out = {
        "params": tree / fsdp,
        "accumulator": tree / fsdp if k > 1 else 0.0,
        "optimizer": opt,
    }
    if mode in HELD_MODES:  # per device: unsharded over the held axes
        kept = 1 if mode == "held" else mesh.size(mesh.axes("data", "fsdp"))
        out["accumulator"] = tree / kept
        out["held_copy"] = held_bytes * n_params / kept
    return out


def window_cost(
    n_params: int,
    mesh: Mesh,
    k: int,
    mode: str,
    hw: Hardware,
    held_bytes: int = BYTES,
) -> dict[str, float]:
    """Per device and window: fast and slow bytes, collectives (of the whole
    tree), projected seconds, and the bytes held (``fits``: within HBM,
    activations not counted)."""
    fast = slow = runs = 0.0
    for c in collectives(n_params, mesh, k, mode, held_bytes):
        f, s = link_bytes(c, mesh)
        fast, slow = fast + f * c.per_window, slow + s * c.per_window
        runs += c.per_window
    held = memory(n_params, mesh, k, mode, held_bytes)
    total = sum(held.values())
    return dict(
        fast_bytes=fast,
        slow_bytes=slow,
        collectives=runs,
        seconds=fast / hw.fast + slow / hw.slow,
        held=total,
        fits=total <= hw.memory,
        **held,
    )


def slice_mesh(slices: int, hw: Hardware) -> Mesh:
    """FSDP inside each slice (or node), data parallel across them: the
    layout MaxText uses for multi-slice runs (``ici_fsdp``, ``dcn_data``)."""
    return Mesh(dcn=slices, data=1, fsdp=hw.per_slice)


SIZES = {"1B": 10**9, "8B": 8 * 10**9, "70B": 70 * 10**9}
SLICES = (1, 4, 16)
WINDOWS = (1, 4, 16)


def _fmt_gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _held(cost: dict) -> str:
    return _fmt_gb(cost["held"]) + ("" if cost["fits"] else " (no)")


def table(hw: Hardware) -> tuple[list[str], list[list[str]]]:
    """The projected table for ``hw``: one row per size, slices and k."""
    headers = [
        "params",
        "slices",
        "k",
        "slow-link GB/device/window naive",
        "deferred",
        "shard_update",
        "fsdp_all",
        "naive / deferred",
        "comm s/window naive",
        "deferred",
        "shard_update",
        "fsdp_all",
        "GB/device naive",
        "shard_update",
        "fsdp_all",
    ]
    rows = []
    for size, n in SIZES.items():
        for slices in SLICES:
            mesh = slice_mesh(slices, hw)
            for k in WINDOWS:
                cost = {m: window_cost(n, mesh, k, m, hw) for m in MODES}
                ratio = (
                    cost["naive"]["slow_bytes"] / cost["deferred"]["slow_bytes"]
                    if cost["deferred"]["slow_bytes"]
                    else float("nan")
                )

                rows.append(
                    [size, str(slices), str(k)]
                    + [_fmt_gb(cost[m]["slow_bytes"]) for m in MODES]
                    + ["-" if math.isnan(ratio) else f"{ratio:.1f}x"]
                    + [f"{cost[m]['seconds']:.3f}" for m in MODES]
                    + [
                        _held(cost[m])
                        for m in ("naive", "shard_update", "fsdp_all")
                    ]
                )
    return headers, rows


# The projected table, split for reading: (caption, header of each column
# after params, slices and k, and the columns of ``table``'s rows they are).
MARKDOWN_PARTS = (
    (
        "bytes over the slow links (DCN, InfiniBand), GB per device and "
        "window, by mode",
        ["naive", "deferred", "shard_update", "fsdp_all", "naive / deferred"],
        range(3, 8),
    ),
    (
        "communication time, seconds per window, by mode",
        ["naive", "deferred", "shard_update", "fsdp_all"],
        range(8, 12),
    ),
    (
        "memory held, GB per device (params, accumulator, Adam moments), "
        "by mode",
        ["naive and deferred", "shard_update", "fsdp_all"],
        range(12, 15),
    ),
)


# Gather once per step, projected: (caption, hardware, slices, modes
# compared). 256 H100 (32 DGX nodes) is the setting of marin's FSDP +
# microbatching report (marin-community/marin #6304).
HELD_SETTINGS = (
    ("256 H100 (32 nodes of 8)", "h100", 32),
    ("4 TPU v5p slices of 256 chips", "tpu-v5p", 4),
    ("one TPU v5e pod slice of 256 chips", "tpu-v5e", 1),
)
HELD_PAIRS = (("deferred", "held"), ("fsdp_all", "fsdp_all_held_dcn"))
HELD_SIZES = ("1B", "8B")
HELD_WINDOWS = (2, 4, 8)


def held_rows(hw: Hardware, slices: int) -> list[list[str]]:
    """One row per size, k and mode of :data:`HELD_PAIRS`: slow and fast
    GB per device and step, whole-tree collectives per step, seconds and
    GB held per device."""
    rows = []
    for size in HELD_SIZES:
        for k in HELD_WINDOWS:
            for mode in (m for pair in HELD_PAIRS for m in pair):
                if slices == 1 and mode.startswith("fsdp_all"):
                    continue  # one slice: fsdp_all is deferred's mesh
                mesh = slice_mesh(slices, hw)
                c = window_cost(SIZES[size], mesh, k, mode, hw)
                rows.append(
                    [
                        size,
                        str(k),
                        mode,
                        _fmt_gb(c["slow_bytes"]),
                        _fmt_gb(c["fast_bytes"]),
                        f"{c['collectives']:.0f}",
                        f"{c['seconds']:.3f}",
                        _held(c),
                    ]
                )
    return rows


def held_markdown() -> str:
    """The gather-once projections as Markdown, one table per setting."""
    parts = [
        "**Gather once per step** (one jitted step of k micro-batches, "
        "float32 held copies: bf16 halves the gathers' bytes and the held "
        "copy). *deferred* / *fsdp_all*: the step without holding; *held*: "
        "every leaf held over `fsdp`; *fsdp_all_held_dcn*: FSDP over every "
        'device, held over the slow axis only (`over=("dcn",)`). '
        "Collectives are counted per whole tree: multiply by the number of "
        "leaves (or buckets) for the launches a step pays.\n"
    ]
    headers = [
        "params",
        "k",
        "mode",
        "slow GB",
        "fast GB",
        "ops",
        "comm s",
        "GB held",
    ]
    for caption, name, slices in HELD_SETTINGS:
        parts.append(f"*{caption}.*\n")
        rows = held_rows(HARDWARE[name], slices)
        parts.append(markdown_table(headers, rows) + "\n")
    return "\n".join(parts)


# ------------------------------------------------------------ exposed time
#
# Gather once, hidden: how much of a step's FSDP communication waits with
# no compute to hide under, for three schedules of one jitted step of k
# micro-batches (FSDP over the ``fsdp`` devices; ``held`` in the others):
#
# * ``per-micro-batch``: every micro-batch gathers each layer and
#   reduce-scatters its gradient, overlapped layer by layer as FSDP2 does
#   (layer l+1's gather under layer l's forward, layer l's reduce-scatter
#   under the backward of the layers below): per micro-batch, the first
#   layer's gather, the last reduce-scatter and whatever a layer's
#   collective takes beyond its neighbour's compute are exposed;
# * ``once, peel=False``: held with every micro-batch in the scan
#   (``oa.GatherOnce(..., peel=False)``): every gather before the scan,
#   every reduce-scatter after it, nothing to hide under: all exposed, once
#   per step;
# * ``once, hidden``: held and peeled (the default): the first and last
#   micro-batch run outside the scan, overlapped as FSDP2 overlaps one
#   micro-batch, once per step.
#
# Assumptions: a decoder of ``layers`` equal layers (embeddings ignored),
# 6 FLOPs per parameter and token (forward 2, backward 4) at MFU
# :data:`MFU` of the bf16 dense peak; gathers in bfloat16 (2 bytes per
# parameter), reduce-scatters in float32; ring collectives as above, one
# collective at a time; the window's one data-axes reduction (the same for
# the three) is not counted.

DECODERS = {"7B": (7 * 10**9, 32), "70B": (70 * 10**9, 80)}
H100_BF16_FLOPS = 989e12  # dense, NVIDIA H100 SXM datasheet
MFU = 0.4
EXPOSED_TOKENS = 4096  # tokens per device per micro-batch: one sequence
EXPOSED_SETTINGS = (  # caption, devices per node, nodes
    ("8 H100 (NVLink)", 8, 1),
    ("4 x 8 H100 (400 Gb/s per GPU between nodes)", 8, 4),
)
EXPOSED_WINDOWS = (4, 16)
SCHEDULES = ("per-micro-batch", "once, peel=False", "once, hidden")


def _layer_times(n_params, layers, per_node, nodes, tokens):
    """Per layer and micro-batch: (forward s, backward s, gather s,
    reduce-scatter s), FSDP over all ``per_node * nodes`` GPUs."""
    hw = HARDWARE["h100"]
    mesh = Mesh(dcn=nodes, fsdp=per_node)
    per_layer = n_params / layers
    flops = 2 * per_layer * tokens / (H100_BF16_FLOPS * MFU)
    axes = mesh.axes("dcn", "fsdp")
    gather = Collective("all-gather", axes, 2 * per_layer, 1)
    scatter = Collective(
        "reduce-scatter", axes, BYTES * per_layer / mesh.devices, 1
    )

    def secs(c):
        fast, slow = link_bytes(c, mesh)
        return fast / hw.fast + slow / hw.slow

    return flops, 2 * flops, secs(gather), secs(scatter)


def _hidden_pass(compute: float, comm: float, layers: int) -> float:
    """Exposed seconds of one pass over ``layers`` layers whose collective
    (``comm`` each) overlaps the neighbouring layer's compute: the first
    (or last) has nothing to hide under."""
    return comm + (layers - 1) * max(0.0, comm - compute)


def exposed(size: str, per_node: int, nodes: int, k: int) -> dict:
    """Per step of ``k`` micro-batches: compute seconds and the exposed
    collective seconds of each of :data:`SCHEDULES`."""
    n, layers = DECODERS[size]
    fwd, bwd, ag, rs = _layer_times(n, layers, per_node, nodes, EXPOSED_TOKENS)
    one = _hidden_pass(fwd, ag, layers) + _hidden_pass(bwd, rs, layers)
    return {
        "compute": k * layers * (fwd + bwd),
        "per-micro-batch": k * one,
        "once, peel=False": layers * (ag + rs),
        "once, hidden": one,
    }


def exposed_rows() -> list[list[str]]:
    """One row per decoder, setting and k: compute seconds per step, then
    per schedule the exposed seconds and their share of the step."""
    rows = []
    for size in DECODERS:
        for caption, per_node, nodes in EXPOSED_SETTINGS:
            for k in EXPOSED_WINDOWS:
                e = exposed(size, per_node, nodes, k)
                cells = []
                for s in SCHEDULES:
                    share = e[s] / (e["compute"] + e[s])
                    cells.append(f"{e[s] * 1e3:.1f} ({100 * share:.1f}%)")
                rows.append(
                    [size, caption, str(k), f"{e['compute']:.2f}", *cells]
                )
    return rows


def exposed_markdown() -> str:
    """The exposed-time table as Markdown."""
    headers = ["params", "GPUs", "k", "compute s/step"]
    headers += [f"exposed ms: {s}" for s in SCHEDULES]
    return (
        "<!-- Generated by benchmarks/comm_model.py (make bench); do not "
        "edit by hand. -->\n\n" + markdown_table(headers, exposed_rows()) + "\n"
    )


def markdown() -> str:
    """The projected tables for every hardware, as Markdown: for each, one
    table of slow-link bytes, one of seconds and one of memory."""
    parts = [
        "<!-- Generated by benchmarks/comm_model.py (make bench); do not "
        "edit by hand. -->\n"
    ]
    for hw in HARDWARE.values():
        _, rows = table(hw)
        parts.append(
            f"**{hw.name}**, {hw.per_slice} devices per "
            f"{'node' if hw.per_slice == 8 else 'slice'} (FSDP inside, data "
            f"parallel across); source: {hw.source}. GB/device: params + "
            "accumulator + Adam moments, '(no)' where it exceeds "
            f"{hw.memory / 1e9:.0f} GB of HBM (activations not counted).\n"
        )
        unit = "nodes" if hw.per_slice == 8 else "slices"
        for caption, headers, columns in MARKDOWN_PARTS:
            parts.append(f"*{hw.name}: {caption}.*\n")
            part = [[r[0], r[1], r[2]] + [r[i] for i in columns] for r in rows]
            parts.append(
                markdown_table(["params", unit, "k", *headers], part) + "\n"
            )
    parts.append(held_markdown())
    return "\n".join(parts)
