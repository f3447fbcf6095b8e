"""Runs every benchmark, prints one table, writes the record and its views.

The record is ``results.json`` (machine-readable, read by
``docs/_ext/figures.py`` for the documentation pages); ``RESULTS.md``,
``results.png`` and README.md's benchmark summary are written from it.

Each benchmark module has ``main(tiny: bool = False) -> dict`` returning

* ``name``, ``title``: a short name and a one-line description;
* ``headers``, ``rows``: its table;
* ``targets``: a list of ``{"target", "measured", "met"}``;
* ``ratios``: ``{label: ratio}``, drawn in the bar chart, with
  ``ratio_label`` naming what the ratios are relative to;
* optionally ``notes``: a list of sentences printed under its tables;
* anything else (raw seconds, bytes), kept out of the report.

B1 (``bench_step``), B1-nnx (``bench_nnx``), B2 (``bench_microbatch``), B5
(``bench_compile``), B5-eager (``bench_eager``), B5-limits
(``compile_limits``) and B6 (``comm_model``) always run; the
multi-device benchmarks (B3 ``bench_multidevice``, B4 ``bench_mesh``) run
when their modules are there.

Run: ``python benchmarks/run_all.py [--tiny] [--out DIR] [--only MODULES]``
(``make bench``). ``--tiny`` runs on toy sizes (a smoke test; the figures
mean nothing), ``--out`` chooses where the files go (default: next to this
script) and ``--only bench_microbatch,...`` reruns those benchmarks alone
and replaces their results in the existing record. Sections of an existing
RESULTS.md below ``HAND_MARKER`` (figures recorded by hand) are kept, and so
is the record's ``hand`` part.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The figures the pages quote are read from the record by the docs'
# extension (docs/_ext/figures.py), which writes README.md's summary too.
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "docs", "_ext"))

import _common  # noqa: E402
import figures  # noqa: E402

BENCHMARKS = (
    "bench_step",
    "bench_nnx",
    "bench_microbatch",
    "bench_compile",
    "bench_eager",
    "compile_limits",
    "comm_model",
)
OPTIONAL = ("bench_multidevice", "bench_mesh")
# The machine-readable record (``docs/_ext/figures.py`` reads it for the pages).
RECORD = "results.json"
RECORD_KEYS = (
    "name",
    "title",
    "headers",
    "rows",
    "targets",
    "ratios",
    "ratio_label",
    "notes",
    "wall_s",
    "date",
    "load",
)

# Everything from this line on in an existing RESULTS.md was recorded by hand
# (before/after comparisons, measurements of single issues) and is kept.
HAND_MARKER = "<!-- Recorded by hand below this line; run_all.py keeps it. -->"

NOISE_NOTE = (
    "Timings are medians of interleaved rounds, reported as ratios. On a "
    "shared machine (a load average near or above the CPU count means other "
    "processes competed for it) individual ratios can be off by tens of "
    "percent; memory figures come from the compiler (`memory_analysis()`) "
    "and do not depend on load. Rerun `make bench` on a quiet machine for "
    "publishable figures."
)


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def run_benchmarks(
    tiny: bool = False, modules: list[str] | None = None
) -> list[dict]:
    """Runs ``modules`` (default: :data:`BENCHMARKS` and those of
    :data:`OPTIONAL` present)."""
    names = list(BENCHMARKS)
    names += [
        n for n in OPTIONAL if os.path.exists(os.path.join(HERE, f"{n}.py"))
    ]
    names = names if modules is None else modules
    results = []
    for name in names:
        module = importlib.import_module(name)
        if not callable(getattr(module, "main", None)):
            continue
        start = time.perf_counter()
        res = module.main(tiny=tiny)
        res["wall_s"] = time.perf_counter() - start
        results.append(res)
    return results


def render(results: list[dict]) -> str:
    """All results as markdown: per benchmark, its table and its targets."""
    parts = []
    for res in results:
        parts.append(f"### {res['title']}\n")
        if res.get("date"):
            parts.append(
                f"Run alone on {res['date']} (wall time {res['wall_s']:.0f} s;"
                f" load average {res['load']}).\n"
            )
        parts.append(_common.markdown_table(res["headers"], res["rows"]))
        parts.append("")
        parts.append(_common.targets_table(res["targets"]))
        parts.append("")
        parts.extend(f"- {note}" for note in res.get("notes", ()))
        if res.get("notes"):
            parts.append("")
    return "\n".join(parts)


def make_record(
    results: list[dict], tiny: bool, load: str, hand: list | None = None
) -> dict:
    """The machine-readable record of a run (``results.json``): ``meta``
    (date, machine, versions, load), ``results`` (each benchmark's
    :data:`RECORD_KEYS`) and ``hand`` (tables recorded by hand, kept)."""
    return {
        "meta": {
            "date": _common.today(),
            "machine": _common.machine_info(),
            "versions": _common.versions(),
            "load": load,
            "tiny": tiny,
        },
        "results": [
            {k: res[k] for k in RECORD_KEYS if k in res} for res in results
        ],
        "hand": list(hand or ()),
    }


def render_report(record: dict) -> str:
    """RESULTS.md above :data:`HAND_MARKER`, from the record."""
    meta, results = record["meta"], record["results"]
    return "\n".join(
        [
            "# optaxaccum benchmarks",
            "",
            "Written by `benchmarks/run_all.py` (`make bench`)"
            + (
                " with `--tiny`: toy sizes, the figures mean nothing."
                if meta.get("tiny")
                else "."
            ),
            "",
            f"- date: {meta['date']}",
            "- machine: "
            + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()),
            "- versions: "
            + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
            "- wall time: "
            + ", ".join(f"{r['name']} {r['wall_s']:.0f} s" for r in results),
            f"- load average (1/5/15 min): {meta['load']}",
            "",
            NOISE_NOTE,
            "",
            "![ratios](results.png)",
            "",
            render(results),
        ]
    )


def read_record(out_dir: str) -> dict | None:
    """The record in ``out_dir``, or None."""
    path = os.path.join(out_dir, RECORD)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_report(
    results: list[dict], out_dir: str, tiny: bool, load: str = ""
) -> list[str]:
    """Writes ``results.json``, ``RESULTS.md`` and ``results.png`` into
    ``out_dir`` (the hand-recorded parts of the old ones kept).

    ``load`` describes the machine's load during the run (shown as is).
    """
    old = read_record(out_dir) or {}
    record = make_record(results, tiny, load or _load(), old.get("hand"))
    return write_record(record, out_dir)


def write_record(record: dict, out_dir: str) -> list[str]:
    """Writes the record and what is made from it into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, RECORD)
    md_path = os.path.join(out_dir, "RESULTS.md")
    png_path = os.path.join(out_dir, "results.png")
    text = render_report(record) + "\n" + _hand_recorded(md_path)
    _replace(json_path, json.dumps(record, indent=1) + "\n")
    _replace(md_path, text)
    plot(record["results"], png_path)
    return [json_path, md_path, png_path]


def _replace(path: str, text: str) -> None:
    """Writes ``path`` whole, or not at all."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def update_readme(record: dict, path: str) -> bool:
    """Rewrites README.md's benchmark summary from the record; False when
    the README has no such block."""
    with open(path) as f:
        text = f.read()
    begin, end = text.find(figures.README_BEGIN), text.find(figures.README_END)
    if begin < 0 or end < begin:
        return False
    head = text[: begin + len(figures.README_BEGIN)]
    _replace(
        path, head + "\n" + figures.readme_summary(record) + "\n" + text[end:]
    )
    return True


def _hand_recorded(md_path: str) -> str:
    """The hand-recorded tail of an existing report (marker included), or
    just the marker."""
    old = ""
    if os.path.exists(md_path):
        with open(md_path) as f:
            old = f.read()
    at = old.find(HAND_MARKER)
    return old[at:] if at >= 0 else HAND_MARKER + "\n"


def plot(results: list[dict], path: str) -> None:
    """A horizontal bar chart of every benchmark's ratios, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    charted = [r for r in results if r.get("ratios")]
    heights = [0.6 + 0.32 * len(r["ratios"]) for r in charted]
    fig, axes = plt.subplots(
        len(charted),
        1,
        figsize=(9, sum(heights) + 0.8),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, res in zip(axes[:, 0], charted, strict=True):
        values = list(res["ratios"].values())
        prefix = f"{res['name']} "
        labels = [k.removeprefix(prefix) for k in res["ratios"]]
        colors = ["tab:green" if v <= 1 else "tab:orange" for v in values]
        ax.barh(range(len(values)), values, color=colors)
        ax.set_yticks(range(len(values)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", linewidth=0.8)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=7)
        ax.set_xlabel(f"ratio: {res.get('ratio_label', 'ratio')}", fontsize=8)
        ax.set_ylabel(res["name"])
        ax.set_xlim(0, max(values + [1.0]) * 1.15)
    fig.suptitle("optaxaccum benchmarks (lower is better; 1 = reference)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(tiny: bool = False, out_dir: str | None = None) -> list[dict]:
    """Runs everything, prints the tables, writes the report files."""
    before = _load()
    results = run_benchmarks(tiny=tiny)
    load = f"{before} before the run, {_load()} after"
    print(render(results))
    out_dir = out_dir or HERE
    for path in write_report(results, out_dir, tiny, load):
        print("wrote", path)
    _readme(out_dir)
    return results


def rerun(modules: list[str], out_dir: str | None = None) -> list[dict]:
    """Reruns ``modules`` alone and replaces their results in the record
    (each marked with its own date and load); the others are kept."""
    out_dir = out_dir or HERE
    record = read_record(out_dir)
    if record is None:
        raise SystemExit(f"no {RECORD} in {out_dir} to update: run all first")
    before = _load()
    results = run_benchmarks(
        tiny=record["meta"].get("tiny", False), modules=modules
    )
    for res in results:
        res.update(
            date=_common.today(), load=f"{before} before, {_load()} after"
        )
        kept = {k: res[k] for k in RECORD_KEYS if k in res}
        names = [r["name"] for r in record["results"]]
        if res["name"] in names:
            record["results"][names.index(res["name"])] = kept
        else:
            record["results"].append(kept)
    print(render(results))
    for path in write_record(record, out_dir):
        print("wrote", path)
    _readme(out_dir)
    return results


def _readme(out_dir: str) -> None:
    """Rewrites README.md's figures after a run written next to this file."""
    readme = os.path.join(HERE, "..", "README.md")
    if os.path.abspath(out_dir) == HERE and os.path.exists(readme):
        record = read_record(out_dir)
        if record and update_readme(record, readme):
            print("wrote", os.path.abspath(readme))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="toy sizes (smoke test)"
    )
    parser.add_argument(
        "--out", default=None, help="directory for RESULTS.md and results.png"
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated modules (bench_microbatch,...) to rerun alone,"
        " replacing their results in the existing record",
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: print RESULTS.md down to the hand-recorded"
        " part, as the record results.json gives it",
    )
    args = parser.parse_args()
    if args.render:
        sys.stdout.write(render_report(figures.load()) + "\n" + HAND_MARKER)
    elif args.only:
        rerun(args.only.split(","), out_dir=args.out)
    else:
        main(tiny=args.tiny, out_dir=args.out)
