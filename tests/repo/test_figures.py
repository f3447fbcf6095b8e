"""Every benchmark figure on a page comes from the recorded results.

The record is ``benchmarks/results.json`` (written by
``benchmarks/run_all.py``); ``docs/_ext/figures.py`` reads it for the pages.
These tests fail when RESULTS.md or README.md's summary was not written from
the record, when a page's ``{{ ... }}`` names a figure the record lacks, and
when a page quotes a ratio (``1.51x``) by hand instead of taking it from the
record.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
BENCH = os.path.join(ROOT, "benchmarks")
EXT = os.path.join(ROOT, "docs", "_ext")
DOCS = os.path.join(ROOT, "docs")
# Pages written by hand (comm_model_table.md is generated arithmetic;
# the changelog records what changed, with the figures of its time).
SKIPPED = {"comm_model_table.md", "changelog.md"}
SUBSTITUTION = re.compile(r"\{\{(.*?)\}\}", re.S)
RATIO = re.compile(r"(?<![\w.])(\d+\.\d+)x\b")
# docs/conf.py's own substitutions (the repository's address, from
# pyproject.toml), not benchmark figures.
SITE_SUBSTITUTIONS = {"install", "repository", "issues"}


def _load(name):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(EXT, f"{name}.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def figures():
    import sys

    sys.path.insert(0, EXT)
    try:
        yield _load("figures")
    finally:
        sys.path.remove(EXT)


@pytest.fixture(scope="module")
def record(figures):
    return figures.load()


def _pages():
    names = sorted(
        f for f in os.listdir(DOCS) if f.endswith(".md") and f not in SKIPPED
    )
    return [os.path.join(DOCS, f) for f in names] + [
        os.path.join(ROOT, "README.md")
    ]


def _prose(text: str, figures) -> str:
    """``text`` without code blocks, inline code, substitutions and README's
    generated summary (checked whole by its own test)."""
    begin, end = text.find(figures.README_BEGIN), text.find(figures.README_END)
    if 0 <= begin < end:
        text = text[:begin] + text[end:]
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    text = SUBSTITUTION.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def test_results_md_is_written_from_the_record():
    import subprocess
    import sys

    generated = subprocess.run(
        [sys.executable, os.path.join(BENCH, "run_all.py"), "--render"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert generated.strip(), "run_all.py --render printed nothing"
    with open(os.path.join(BENCH, "RESULTS.md")) as f:
        text = f.read()
    assert text.startswith(generated), (
        "benchmarks/RESULTS.md differs from the record results.json: "
        "rewrite both with benchmarks/run_all.py"
    )


def test_readme_summary_is_written_from_the_record(figures, record):
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    begin = text.index(figures.README_BEGIN) + len(figures.README_BEGIN)
    end = text.index(figures.README_END)
    assert text[begin:end].strip() == figures.readme_summary(record).strip()


def test_every_substitution_names_a_recorded_figure(figures, record):
    names = figures.substitutions(record)
    used = 0
    for path in _pages():
        with open(path) as f:
            text = f.read()
        for expr in SUBSTITUTION.findall(text):
            if expr.strip() in SITE_SUBSTITUTIONS:
                continue
            try:
                eval(expr, {"__builtins__": {}}, names)  # noqa: S307
            except (KeyError, ValueError, IndexError) as err:
                pytest.fail(f"{os.path.basename(path)}: {{{{{expr}}}}}: {err}")
            used += 1
    assert used > 50  # the benchmark pages take their figures from it


def test_no_page_quotes_a_ratio_by_hand(figures, record):
    # A ratio written into a page must be a threshold that a recorded
    # target names ("at most 1.2x the floor"); a measured one is taken
    # from the record with {{ fig(...) }} and friends.
    thresholds = {
        m
        for res in list(record["results"]) + list(record.get("hand", ()))
        for t in res.get("targets", ())
        for m in RATIO.findall(t["target"])
    }
    thresholds |= {"1.1", "1.2", "1.3", "1.5", "1.6", "2.5"}
    found = []
    for path in _pages():
        with open(path) as f:
            prose = _prose(f.read(), figures)
        found += [
            f"{os.path.basename(path)}: {m}x"
            for m in RATIO.findall(prose)
            if m not in thresholds
        ]
    assert not found, (
        "ratios written by hand (take them from the record, "
        f"docs/_ext/figures.py): {found}"
    )


def test_tables_match_the_record(figures, record):
    # One figure per table, read back from the markdown it renders.
    b1 = figures.table(record, "B1")
    assert (
        f"| fused, closing | {figures.fig(record, 'B1', 'fused closing', 'ms/call')} | {figures.fig(record, 'B1', 'fused closing', 'vs floor')} |"
        in b1
    )
    b4 = figures.table(record, "B4-window")
    naive = figures.fig(
        record, "B4", "data=8 / naive jit", "vs oa.unreduced_value_and_grad"
    )
    assert "| `data=8` | naive | " in b4 and f" {naive} |" in b4
