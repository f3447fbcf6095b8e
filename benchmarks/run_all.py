"""Runs every benchmark, prints one table, writes RESULTS.md and results.png.

Each benchmark module has ``main(tiny: bool = False) -> dict`` returning

* ``name``, ``title``: a short name and a one-line description;
* ``headers``, ``rows``: its table;
* ``targets``: a list of ``{"target", "measured", "met"}``;
* ``ratios``: ``{label: ratio}``, drawn in the bar chart, with
  ``ratio_label`` naming what the ratios are relative to;
* optionally ``notes``: a list of sentences printed under its tables;
* anything else (raw seconds, bytes), kept out of the report.

B1 (``bench_step``), B1-nnx (``bench_nnx``), B2 (``bench_microbatch``), B5
(``bench_compile``), B5-limits (``compile_limits``) and B6 (``comm_model``)
always run; the
multi-device benchmarks (B3 ``bench_multidevice``, B4 ``bench_mesh``) run
when their modules are there.

Run: ``python benchmarks/run_all.py [--tiny] [--out DIR]`` (``make bench``).
``--tiny`` runs on toy sizes (a smoke test; the figures mean nothing) and
``--out`` chooses where RESULTS.md and results.png go (default: next to this
script). Sections of an existing RESULTS.md below ``HAND_MARKER`` (figures
recorded by hand) are kept.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common  # noqa: E402

BENCHMARKS = (
    "bench_step",
    "bench_nnx",
    "bench_microbatch",
    "bench_compile",
    "compile_limits",
    "comm_model",
)
OPTIONAL = ("bench_multidevice", "bench_mesh")

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


def run_benchmarks(tiny: bool = False) -> list[dict]:
    """Runs :data:`BENCHMARKS` and those of :data:`OPTIONAL` present."""
    names = list(BENCHMARKS)
    names += [
        n for n in OPTIONAL if os.path.exists(os.path.join(HERE, f"{n}.py"))
    ]
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
        parts.append(_common.markdown_table(res["headers"], res["rows"]))
        parts.append("")
        parts.append(_common.targets_table(res["targets"]))
        parts.append("")
        parts.extend(f"- {note}" for note in res.get("notes", ()))
        if res.get("notes"):
            parts.append("")
    return "\n".join(parts)


def write_report(
    results: list[dict], out_dir: str, tiny: bool, load: str = ""
) -> list[str]:
    """Writes ``RESULTS.md`` and ``results.png`` into ``out_dir``.

    ``load`` describes the machine's load during the run (shown as is).
    """
    os.makedirs(out_dir, exist_ok=True)
    md_path = os.path.join(out_dir, "RESULTS.md")
    png_path = os.path.join(out_dir, "results.png")
    machine, versions = _common.machine_info(), _common.versions()
    lines = [
        "# optaxaccum benchmarks",
        "",
        "Written by `benchmarks/run_all.py` (`make bench`)"
        + (
            " with `--tiny`: toy sizes, the figures mean nothing."
            if tiny
            else "."
        ),
        "",
        f"- date: {_common.today()}",
        "- machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "- wall time: "
        + ", ".join(f"{r['name']} {r['wall_s']:.0f} s" for r in results),
        f"- load average (1/5/15 min): {load or _load()}",
        "",
        NOISE_NOTE,
        "",
        "![ratios](results.png)",
        "",
        render(results),
    ]
    lines += ["", _hand_recorded(md_path)]
    with open(md_path + ".tmp", "w") as f:  # replaced whole, or not at all
        f.write("\n".join(lines))
    os.replace(md_path + ".tmp", md_path)
    plot(results, png_path)
    return [md_path, png_path]


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
    for path in write_report(results, out_dir or HERE, tiny, load):
        print("wrote", path)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="toy sizes (smoke test)"
    )
    parser.add_argument(
        "--out", default=None, help="directory for RESULTS.md and results.png"
    )
    args = parser.parse_args()
    main(tiny=args.tiny, out_dir=args.out)
