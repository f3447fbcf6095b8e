"""docs/scaling.md's gather-once figures against their records.

Every memory figure (``N.NN MB``) of the "Gather once per step" section is
one of ``benchmarks/GATHER_ONCE_PEEL.md``'s records, for the compiler and
structure the sentence names; the exposed-time table and chart name the
held schedules as the library builds them (peeling is the default, the
other is ``peel=False``); the table of ``oa.overlap_compiler_options`` is
the one generated from the library.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "scaling.md"
RECORD = ROOT / "benchmarks" / "GATHER_ONCE_PEEL.md"
MB = r"(\d+\.\d\d)\s+MB"
# (pattern with one MB figure per group, the record of each group:
# (backend, compiler version, k, structure)).
GPU10, GPU12, TPU = "jaxlib 0.10.2", "jaxlib 0.12.0.1", "libtpu 0.0.42.1"
ANCHORS = [
    (
        rf"XLA:GPU at `k = 8` \(jaxlib 0\.10\.2, [^)]*\):\s+{MB} held\s+"
        rf"\({MB} with `peel=False`: the held copies and sums of 0\.75\s+"
        rf"MB of weights, less what the loop no longer gathers\) against\s+"
        rf"{MB} not\s+held",
        [
            ("gpu", GPU10, 8, "peeled"),
            ("gpu", GPU10, 8, "all in the scan"),
            ("gpu", GPU10, 8, "not held"),
        ],
    ),
    (
        rf"jaxlib 0\.12\.0\.1\): per-device memory {MB} peeled against\s+"
        rf"{MB} with\s+every micro-batch in the scan at `k = 8` \(\+1\.7%\),"
        rf"\s+{MB} against {MB}\s+at `k = 4` \(\+3\.4%\), and {MB} against"
        rf"\s+{MB} at `k = 2`",
        [
            ("gpu", GPU12, 8, "peeled"),
            ("gpu", GPU12, 8, "all in the scan"),
            ("gpu", GPU12, 4, "peeled"),
            ("gpu", GPU12, 4, "all in the scan"),
            ("gpu", GPU12, 2, "peeled"),
            ("gpu", GPU12, 2, "all in the scan"),
        ],
    ),
    (
        rf"jaxlib 0\.10\.2's XLA:GPU\s+packs the peeled step less tightly:"
        rf"\s+{MB} against {MB} at `k = 8`\s+\(\+27%\)",
        [("gpu", GPU10, 8, "peeled"), ("gpu", GPU10, 8, "all in the scan")],
    ),
    (
        rf"needs no temporaries \({MB}: its arguments and outputs\), "
        rf"peeled\s+{MB}\s+at `k = 8`",
        [("tpu", TPU, 8, "all in the scan"), ("tpu", TPU, 8, "peeled")],
    ),
]
NOT_RECORDS = {"0.75"}  # the weights' size, not a compiled figure


def records() -> dict:
    """``{(backend, version, k, structure): memory bytes}`` of the
    record's tables; the version is the jaxlib or libtpu named last in
    the text above the table."""
    out, versions = {}, {}
    for line in RECORD.read_text().splitlines():
        if not line.startswith("|"):
            for name in ("jaxlib", "libtpu"):
                found = re.findall(rf"{name} (\d[\d.]*\d)", line)
                if found:
                    versions[name] = found[-1]
            if "jaxlib" in line and "libtpu" not in line:
                versions.pop("libtpu", None)
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 6 or not cells[1].isdigit():
            continue
        name = "libtpu" if cells[0] == "tpu" else "jaxlib"
        key = (cells[0], f"{name} {versions[name]}", int(cells[1]), cells[2])
        out[key] = int(cells[3])
    return out


def _section() -> str:
    text = PAGE.read_text()
    start = text.index("### Gather once per step")
    return text[start : text.index("\n### ", start + 1)]


def test_every_memory_figure_is_its_record():
    record, section = records(), _section()
    quoted = []
    for pattern, keys in ANCHORS:
        m = re.search(pattern, section)
        assert m, f"docs/scaling.md no longer says: {pattern}"
        for got, key in zip(m.groups(), keys, strict=True):
            assert got == f"{record[key] / 1e6:.2f}", (key, got, record[key])
            quoted.append(got)
    every = re.findall(MB, section)
    left = list(every)
    for got in quoted + sorted(NOT_RECORDS):
        left.remove(got)
    assert not left, f"MB figures of no record: {left}"


def test_held_schedules_are_named_as_built():
    from tools import comm_model as cm

    assert "once, peel=False" in cm.SCHEDULES
    table = ROOT / "docs" / "comm_exposed_table.md"
    for path in (PAGE, table):
        assert "once, today" not in path.read_text(), path
    assert table.read_text() == cm.exposed_markdown()
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import overlap_options
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    assert (
        overlap_options.PAGE.read_text() == overlap_options.options_markdown()
    )
