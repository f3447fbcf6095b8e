"""The recorded benchmark figures, as the pages quote them.

``benchmarks/results.json`` is the record: ``benchmarks/run_all.py`` writes
it with ``RESULTS.md`` (``results``: every table ``make bench`` measured,
``meta``: the machine and the run) and keeps its ``hand`` part, tables
measured by hand elsewhere (the GPU figures). Every benchmark figure on the
documentation pages and in README.md comes from it:

* the Sphinx pages call the functions below through MyST substitutions
  (``docs/conf.py``), e.g. ``{{ fig("B1", "fused closing", "vs floor") }}``
  or ``{{ table("B1") }}``;
* README.md's benchmark summary is :func:`readme_summary`, written between
  :data:`README_BEGIN` and :data:`README_END` by ``benchmarks/run_all.py``.

``tests/repo/test_figures.py`` fails when a page quotes a figure that is not
taken from the record.
"""

from __future__ import annotations

import functools
import json
import os
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
RECORD = os.path.join(ROOT, "benchmarks", "results.json")

README_BEGIN = (
    "<!-- benchmark figures: written by benchmarks/run_all.py from "
    "benchmarks/results.json -->"
)
README_END = "<!-- end of benchmark figures -->"


def load(path: str = RECORD) -> dict:
    """The record at ``path``."""
    with open(path) as f:
        return json.load(f)


def bench(record: Mapping[str, Any], name: str) -> dict:
    """The table named ``name`` (``results`` first, then ``hand``)."""
    for res in list(record["results"]) + list(record.get("hand", ())):
        if res["name"] == name:
            return res
    raise KeyError(f"no benchmark {name!r} in the record")


def _row(res: Mapping[str, Any], key: str) -> list[str]:
    """The row whose first cell is ``key``, or whose first two cells joined
    by `` / `` are (B4's mesh and variant, B5's size and configuration)."""
    for row in res["rows"]:
        if row[0] == key or " / ".join(row[:2]) == key:
            return row
    raise KeyError(f"no row {key!r} in {res['name']}")


def fig(record: Mapping[str, Any], name: str, row: str, column: str) -> str:
    """One cell of a recorded table, as recorded (``"4.12x"``)."""
    res = bench(record, name)
    return _row(res, row)[res["headers"].index(column)]


def value(record: Mapping[str, Any], name: str, row: str, column: str) -> float:
    """One cell as a number (``"4.12x"``, ``"78.540 ms/call"``)."""
    return float(fig(record, name, row, column).split()[0].rstrip("x"))


def ratio(
    record: Mapping[str, Any],
    name: str,
    over: str,
    under: str,
    column: str,
    digits: int = 1,
) -> str:
    """``over / under`` of two cells of one column, as ``"2.6x"``."""
    quotient = value(record, name, over, column) / value(
        record, name, under, column
    )
    return f"{quotient:.{digits}f}x"


def target(record: Mapping[str, Any], name: str, starts: str) -> str:
    """The measured value of the target whose text starts with ``starts``."""
    for t in bench(record, name)["targets"]:
        if t["target"].startswith(starts):
            return t["measured"]
    raise KeyError(f"no target {starts!r} in {name}")


def met(record: Mapping[str, Any], name: str, starts: str) -> str:
    """``"yes"`` or ``"no"``: whether that target was met."""
    for t in bench(record, name)["targets"]:
        if t["target"].startswith(starts):
            return "yes" if t["met"] else "no"
    raise KeyError(f"no target {starts!r} in {name}")


def note(record: Mapping[str, Any], name: str, key: str) -> str:
    """A value recorded with a table (``meta`` of a hand-recorded one), or
    with the run (``name="run"``: its machine and versions)."""
    if name == "run":
        meta = record["meta"]
        return str({**meta["machine"], **meta["versions"]}[key])
    return str(bench(record, name)["meta"][key])


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append(
        "|"
        + "|".join("---" if i == 0 else "---:" for i in range(len(headers)))
        + "|"
    )
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# The tables the pages show: per table, its source, its columns as
# (heading, recorded column) and its rows as (label, recorded row).
_B1_COLUMNS = [
    ("step", ""),
    ("ms per call", "ms/call"),
    ("vs floor", "vs floor"),
    ("temporary", "temp"),
    ("copies", "leaf copies in HLO"),
]
TABLES: dict[str, dict[str, Any]] = {
    "B1": dict(
        source="B1",
        columns=_B1_COLUMNS,
        rows=[
            ("floor (`acc + g`)", "floor"),
            ("Adam step alone", "Adam step alone"),
            ("fused, non-closing", "fused non-closing"),
            ("fused, closing", "fused closing"),
            ("fused, whole window / 4", "fused window/4"),
            ("plain, non-closing", "plain non-closing"),
            ("plain, closing", "plain closing"),
            ("`optax.MultiSteps`, non-closing", "MultiSteps non-closing"),
            ("`optax.MultiSteps`, closing", "MultiSteps closing"),
            (
                "`oa.MultiSteps`, fused, non-closing",
                "oa.MultiSteps(fused) non-closing",
            ),
            (
                "`oa.MultiSteps`, plain, non-closing",
                "oa.MultiSteps(plain) non-closing",
            ),
        ],
    ),
    "migration-B1": dict(
        source="B1",
        columns=[
            ("per micro-step, as a multiple of a bare tree add", ""),
            ("non-closing", "vs floor", " non-closing"),
            ("closing", "vs floor", " closing"),
            ("over a window", "vs floor", " window/4"),
            ("temporary buffers", "temp", " non-closing"),
        ],
        rows=[
            ("`optax.MultiSteps`, `ms.update`", "MultiSteps"),
            ("`oa.MultiSteps`, the same `ms.update`", "oa.MultiSteps(plain)"),
            (
                "`oa.MultiSteps` with "
                "{func}`oa.apply_gradients <optaxaccum.apply_gradients>`",
                "oa.MultiSteps(fused)",
            ),
        ],
    ),
    "B1-nnx": dict(
        source="B1-nnx",
        columns=[
            ("step", ""),
            ("ms per call", "ms/call"),
            ("vs floor", "vs floor"),
            ("temporary", "temp"),
        ],
        rows=[
            ("floor", "floor"),
            (
                "`optaxaccum.flax.nnx.Optimizer`, non-closing",
                "oa nnx.Optimizer non-closing",
            ),
            (
                "`optaxaccum.flax.nnx.Optimizer`, closing",
                "oa nnx.Optimizer closing",
            ),
            (
                "stock `nnx.Optimizer` + `oa.chain`, non-closing",
                "nnx.Optimizer + oa.chain non-closing",
            ),
            (
                "stock `nnx.Optimizer(optax.MultiSteps(...))`, non-closing",
                "nnx.Optimizer(MultiSteps) non-closing",
            ),
            ("an `nnx.jit` call that does nothing", "nnx.jit no-op"),
        ],
    ),
    "B2": dict(
        source="B2",
        columns=[
            ("variant", ""),
            ("ms per step", "ms/step"),
            ("time vs whole batch", "time vs full"),
            ("temporary", "temp"),
            ("temporary vs whole batch", "temp vs full"),
        ],
        rows=[
            ("whole batch", "full batch"),
            (
                "`optax.microbatching.microbatch` of `jax.value_and_grad`",
                "optax microbatch (n=8)",
            ),
            (
                "`oa.microbatched_value_and_grad`",
                "oa.microbatched (n=8)",
            ),
            ("`lax.scan` written by hand", "lax.scan by hand (n=8)"),
            (
                "`optax.microbatching.micro_grad` (per-example gradients)",
                "optax micro_grad (n=8)",
            ),
        ],
    ),
    "B3": dict(
        source="B3",
        columns=[
            ("variant", ""),
            ("all-reduces per window", "all-reduces per window of 4"),
            ("bytes per window", "bytes per window"),
            ("ms per window", "ms/window"),
            (
                "time vs `oa.accumulate(axis_name=...)`",
                "vs oa.accumulate(axis_name)",
            ),
        ],
        rows=[
            ("`pmean` + `optax.MultiSteps`", "pmean + MultiSteps"),
            ("`pmean` + `oa.accumulate`", "pmean + oa.accumulate"),
            (
                "`oa.accumulate(4, axis_name=...)`",
                "oa.accumulate(axis_name)",
            ),
        ],
    ),
    "B4-collectives": dict(
        source="B4",
        columns=[
            ("mesh", "=mesh"),
            ("variant", ""),
            (
                "calls reducing the gradient over `data`",
                "calls reducing grads over data / window: ops (bytes)",
            ),
            (
                "`fsdp`-only collectives (bytes)",
                "fsdp-only collectives / window (bytes)",
            ),
            ("all collectives (bytes)", "all collectives / window (bytes)"),
        ],
        rows=[],  # filled below
    ),
    "B4-window": dict(
        source="B4",
        columns=[
            ("mesh", "=mesh"),
            ("variant", ""),
            (
                "collective output per micro-step (trees)",
                "collective output / micro-step (trees)",
            ),
            ("accumulator per device", "accumulator / device"),
            ("Adam state per device", "Adam state / device"),
            ("window time", "vs oa.unreduced_value_and_grad"),
        ],
        rows=[],
    ),
    "GPU": dict(
        source="GPU",
        columns=[
            ("step", ""),
            ("ms per call", "ms/call"),
            ("vs floor", "vs floor"),
        ],
        rows=[
            ("floor (`acc + g`)", "floor"),
            (
                "`oa.apply_gradients` on `oa.chain(oa.accumulate(k), adam)`,"
                " non-closing",
                "fused non-closing",
            ),
            (
                "`oa.MultiSteps(adam, k)`, fused, non-closing",
                "oa.MultiSteps(fused) non-closing",
            ),
            (
                "`optax.MultiSteps(adam, k)`, non-closing",
                "MultiSteps non-closing",
            ),
            ("Adam step alone", "Adam step alone"),
        ],
    ),
}
TABLES["B5"] = dict(
    source="B5",
    pivot="total CPU s",
    columns=[
        ("leaves", ""),
        ("adam", "adam"),
        ("reference", "optax agc+adam"),
        ("MultiSteps", "MultiSteps"),
        ("README, fused", "README fused"),
        ("README, plain", "README plain"),
        ("scale per micro-batch", "scale per micro-batch fused"),
        ("accumulate", "accumulate fused"),
    ],
    rows=[("100", "100"), ("1,000", "1000"), ("3,000", "3000")],
)
TABLES["B5-eager"] = dict(
    source="B5-eager",
    columns=[
        ("un-jitted call", ""),
        ("ms per call", "ms/call"),
        ("vs the optax chain", "vs optax agc+adam update"),
    ],
    rows=[
        (
            "`optax.chain(adaptive_grad_clip, adam)`, `update`",
            "optax agc+adam update",
        ),
        ("`optax.MultiSteps` of it, non-closing", "MultiSteps non-closing"),
        ("README chain, fused, non-closing", "README fused non-closing"),
        ("README chain, fused, closing", "README fused closing"),
        ("README chain, `tx.update`, non-closing", "README plain non-closing"),
        (
            "`oa.chain(oa.accumulate(4), adam)`, fused, non-closing",
            "accumulate fused non-closing",
        ),
        (
            "`oa.chain(oa.accumulate(4), adam)`, fused, closing",
            "accumulate fused closing",
        ),
    ],
)
_B4_ROWS = [
    ("`data=2 x fsdp=4`", "naive", "data=2 x fsdp=4 / naive jit"),
    (
        "`data=2 x fsdp=4`",
        "deferred",
        "data=2 x fsdp=4 / oa.unreduced_value_and_grad",
    ),
    (
        "`data=2 x fsdp=4`",
        "deferred, `shard_update=True`",
        "data=2 x fsdp=4 / shard_update=True",
    ),
    (
        "`data=2 x fsdp=4`",
        "deferred, both axes",
        'data=2 x fsdp=4 / unreduced over ("data", "fsdp")',
    ),
    ("`data=8`", "naive", "data=8 / naive jit"),
    ("`data=8`", "deferred", "data=8 / oa.unreduced_value_and_grad"),
    ("`data=8`", "deferred, `shard_update=True`", "data=8 / shard_update=True"),
]
for _name in ("B4-collectives", "B4-window"):
    TABLES[_name]["rows"] = [(f"{m}\t{v}", key) for m, v, key in _B4_ROWS]


def table(record: Mapping[str, Any], name: str) -> str:
    """The table :data:`TABLES` names, in markdown, from the record.

    A column is ``(heading, recorded column)`` or ``(heading, recorded
    column, suffix)``: the cell of the row ``key + suffix`` (B1's rows by
    variant and phase). The column ``""`` is the label, ``"=mesh"`` the
    label's first part (a tab separates it from the second).
    """
    spec = TABLES[name]
    res = bench(record, spec["source"])
    if "pivot" in spec:
        return _pivot(res, spec)
    rows = []
    for label, key in spec["rows"]:
        parts = label.split("\t")
        cells = []
        for _heading, column, *suffix in spec["columns"]:
            if column == "":
                cells.append(parts[-1])
            elif column == "=mesh":
                cells.append(parts[0])
            else:
                row = _row(res, key + "".join(suffix))
                cells.append(row[res["headers"].index(column)])
        rows.append(cells)
    return _md_table([c[0] for c in spec["columns"]], rows)


def _pivot(res: Mapping[str, Any], spec: Mapping[str, Any]) -> str:
    """A table of one recorded column (``pivot``), by the rows' first cell
    (``rows``) and second cell (``columns``)."""
    rows = [
        [label]
        + [
            _row(res, f"{key} / {ckey}")[res["headers"].index(spec["pivot"])]
            for _, ckey in spec["columns"][1:]
        ]
        for label, key in spec["rows"]
    ]
    return _md_table([c[0] for c in spec["columns"]], rows)


def substitutions(record: Mapping[str, Any]) -> dict[str, Any]:
    """The names the pages use in ``{{ ... }}``, bound to ``record``."""

    def bind(fn):
        return functools.partial(fn, record)  # picklable, as Sphinx needs

    return {
        "fig": bind(fig),
        "ratio": bind(ratio),
        "target": bind(target),
        "table": bind(table),
        "met": bind(met),
        "note": bind(note),
    }


def readme_summary(record: Mapping[str, Any]) -> str:
    """README.md's benchmark summary, written from the record."""
    f = substitutions(record)
    fig, target = f["fig"], f["target"]
    reductions = "all-reduces per window of 4"
    vs_ours = "vs oa.unreduced_value_and_grad"
    cpu = record["meta"]["machine"]
    paragraphs = [
        f"In the run recorded there (CPU, {cpu['cpu_count']} cores; "
        "timings are ratios of medians):",
        "",
        "- **B1, micro-step cost** (33.6M float32 parameters, Adam, "
        "windows of 4): the fused non-closing step takes "
        f"{fig('B1', 'fused non-closing', 'vs floor')} the time of a bare "
        "tree add (the floor) and needs no tree-sized temporary "
        f"({fig('B1', 'fused non-closing', 'temp')}), against "
        f"{fig('B1', 'MultiSteps non-closing', 'vs floor')} and "
        f"{fig('B1', 'MultiSteps non-closing', 'temp')} for "
        "`optax.MultiSteps`; the fused closing step takes "
        f"{fig('B1', 'fused closing', 'vs floor')} (an Adam step alone "
        f"takes {fig('B1', 'Adam step alone', 'vs floor')}); the plain "
        "`update` + `apply_updates` path takes "
        f"{fig('B1', 'plain non-closing', 'vs floor')} with one tree "
        f"({fig('B1', 'plain non-closing', 'temp')}) of temporary.",
        "- **B2, in-step microbatching** (2.1M-parameter MLP, batch 1024 "
        "in 8 micro-batches): `oa.microbatched_value_and_grad` needs "
        f"{fig('B2', 'oa.microbatched (n=8)', 'temp vs full')} the "
        "temporary memory of the whole batch and takes "
        f"{fig('B2', 'oa.microbatched (n=8)', 'time vs full')} its time; "
        "optax's `optax.microbatching.microbatch` of "
        "`jax.value_and_grad` takes "
        f"{fig('B2', 'optax microbatch (n=8)', 'time vs full')} the time "
        f"and {fig('B2', 'optax microbatch (n=8)', 'temp vs full')} the "
        "memory.",
        "- **B3, data parallel** (8 simulated CPU devices, windows of 4): "
        "`oa.accumulate(4, axis_name=...)` runs "
        f"{fig('B3', 'oa.accumulate(axis_name)', reductions)}"
        " gradient all-reduce per window instead of "
        f"{fig('B3', 'pmean + MultiSteps', reductions)}"
        ", and a window is "
        f"{target('B3', 'oa.accumulate(axis_name) window not slower')}"
        " than `pmean` + `optax.MultiSteps`. On simulated CPU devices "
        "an all-reduce is a memory copy, so the saving in communication "
        "shows on real interconnects, not in this timing.",
        "- **B4, sharded meshes under `jax.jit`** (8 simulated CPU "
        "devices): the naive step's window takes "
        f"{fig('B4', 'data=2 x fsdp=4 / naive jit', vs_ours)}"
        " (`data=2 x fsdp=4`) and "
        f"{fig('B4', 'data=8 / naive jit', vs_ours)}"
        " (`data=8`) the time of one with `oa.unreduced_value_and_grad`.",
        "",
        "**On a GPU** (hand-recorded: "
        f"{note(record, 'GPU', 'device')}, "
        f"jax {note(record, 'GPU', 'jax')}; 8 leaves of "
        "4096 x 4096 float32, Adam; 30 calls back to back, one sync): the "
        "fused non-closing micro-step took "
        f"{fig('GPU', 'fused non-closing', 'vs floor')} a bare tree add, "
        "against "
        f"{fig('GPU', 'MultiSteps non-closing', 'vs floor')} for "
        "`optax.MultiSteps`. `make bench-gpu` measures this on your "
        "card and fails when a gate lost its conditional in the "
        "compiled program.",
    ]
    return "\n".join(
        textwrap.fill(
            p,
            79,
            break_on_hyphens=False,
            subsequent_indent="  " if p[:2] == "- " else "",
        )
        for p in paragraphs
    )
