"""The gallery's pages (``docs/gallery``) show every example with its code,
its recorded output and its plot, and the site reads no inventory from the
network."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GALLERY = ROOT / "docs" / "gallery"


def _make_gallery():
    spec = importlib.util.spec_from_file_location(
        "make_gallery", GALLERY / "make_gallery.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_has_a_gallery_page():
    shown = {name for name, _ in _make_gallery().GALLERY}
    # transformer_lm has its own page (docs/lm_example.md); _digits is data.
    scripts = {
        p.stem
        for p in (ROOT / "examples").glob("*.py")
        if not p.stem.startswith("_") and p.stem != "transformer_lm"
    }
    assert scripts == shown


def test_gallery_pages_are_up_to_date():
    # The pages are written by docs/gallery/make_gallery.py from the
    # examples' docstrings and their recorded outputs.
    for name, text in _make_gallery().pages().items():
        path = GALLERY / name
        assert path.exists(), f"{path}: run python docs/gallery/make_gallery.py"
        assert path.read_text() == text, (
            f"{path} is out of date: run python docs/gallery/make_gallery.py"
        )


def test_each_page_shows_code_output_and_plot():
    mg = _make_gallery()
    for name, _ in mg.GALLERY:
        page = (GALLERY / f"{name}.md").read_text()
        assert f"{{literalinclude}} ../../examples/{name}.py" in page
        assert "## What it prints" in page and "```text" in page
    assert (
        "![quickstart.png](outputs/quickstart.png)"
        in (GALLERY / "quickstart.md").read_text()
    )


def test_pages_name_the_example_helpers_their_code_imports():
    # A snippet copied from a page that starts with `from _mesh import ...`
    # needs examples/_mesh.py: the page says where it lives.
    mg = _make_gallery()
    helpers = {p.stem for p in (ROOT / "examples").glob("_*.py")}
    shown = {}
    for name, _ in mg.GALLERY:
        code = (ROOT / "examples" / f"{name}.py").read_text()
        used = sorted(
            h for h in helpers if re.search(rf"^\s*from {h} import", code, re.M)
        )
        page = (GALLERY / f"{name}.md").read_text()
        code_part = page.split("## The code", 1)[1].split("```", 1)[0]
        for h in used:
            assert f"`examples/{h}.py`" in code_part, (name, h)
        if not used:
            assert "helpers" not in code_part, name
        shown[name] = used
    for name in ("data_parallel", "fsdp", "nnx_example"):
        assert shown[name], name


def test_intersphinx_reads_vendored_inventories_only():
    conf = runpy.run_path(str(ROOT / "docs" / "conf.py"))
    mapping = conf["intersphinx_mapping"]
    assert set(mapping) == {"optax", "jax", "flax"}
    for url, inventory in mapping.values():
        assert url.startswith("https://")
        assert pathlib.Path(inventory).is_file(), inventory
        assert (
            pathlib.Path(inventory)
            .read_bytes()
            .startswith(b"# Sphinx inventory version 2")
        )


def test_every_entry_has_a_thumbnail():
    # The index showed 11 titles and 2 pictures: each entry now has one,
    # drawn by make_gallery.py (the example's plot, or what it prints).
    mg = _make_gallery()
    index = (GALLERY / "index.md").read_text()
    names = ["lm_example", *(name for name, _ in mg.GALLERY)]
    for name in names:
        assert f"(thumbs/{name}.png)" in index, name
        png = GALLERY / "thumbs" / f"{name}.png"
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), png
    # Each entry names its page once, not its title twice.
    assert index.count("Quickstart: accumulating") == 0


def test_docstring_layout_survives_on_the_pages():
    # The AdaScale docstring's aligned (a)-(d) list ran into one paragraph.
    mg = _make_gallery()
    page = mg.page("adascale")
    assert "```text\n(a) base batch      every micro-batch" in page
    # A hanging indent is a list item; an indented snippet is code.
    assert "\n- (b) ``16 x accumulate(4)``" in mg.page("quickstart")
    assert "```python\nloss, grads = oa.unreduced_value_and_grad" in (
        mg.page("fsdp")
    )


def test_adascale_page_shows_its_figure_and_no_machine_path():
    page = (GALLERY / "adascale.md").read_text()
    assert "![adascale.png](outputs/adascale.png)" in page
    assert "saved adascale.png" in page and "/work/" not in page


def _grid_min_px() -> float:
    """The narrowest column of the gallery's grid (docs/_static/custom.css),
    in CSS pixels."""
    css = (ROOT / "docs" / "_static" / "custom.css").read_text()
    m = re.search(r"\.gallery-grid ul\s*\{[^}]*minmax\(([\d.]+)rem", css)
    assert m, "custom.css: the gallery grid's minmax(...rem, 1fr)"
    return float(m.group(1)) * 16


def test_text_thumbnails_are_title_cards_readable_in_the_grid(
    tmp_path, monkeypatch
):
    # 8 of 11 thumbnails were the first lines of printed output at about
    # 5 px per glyph in the grid: they identified nothing. An example
    # without a plot gets a card with its title, large enough to read.
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    mg = _make_gallery()
    monkeypatch.setattr(mg, "THUMBS", str(tmp_path))
    drawn = []
    text = Axes.text

    def recording(self, x, y, s, *args, **kwargs):
        out = text(self, x, y, s, *args, **kwargs)
        px = out.get_fontsize() * self.figure.dpi / 72
        drawn.append((s, px, self.figure.get_figwidth() * self.figure.dpi))
        return out

    monkeypatch.setattr(Axes, "text", recording)
    cards = [n for n, _ in mg.GALLERY if mg.thumbnail_source(n) is None]
    assert len(cards) >= 5
    for name in cards:
        drawn.clear()
        mg.make_thumbnail(name, None)
        assert (tmp_path / f"{name}.png").exists(), name
        words = " ".join(s for s, _, _ in drawn).split()
        title = mg.docstring(name).partition("\n\n")[0].replace("``", "")
        head = title.rstrip(".").split(":")[0].split()
        assert words[: len(head)] == head, (name, words)
        printed = (GALLERY / "outputs" / f"{name}.txt").read_text()
        first = printed.split("\n", 2)[2].splitlines()[0]
        assert first not in " ".join(words), name
        for s, px, width in drawn:
            shown = px * _grid_min_px() / width
            assert shown >= 10, f"{name}: {s!r} is {shown:.1f} px high"


# The quickstart's recorded table (docs/gallery/outputs/quickstart.txt,
# shown on its gallery page) quotes the compiled memory of each run's step.
QUICKSTART_RUNS = {
    "(a) batch 64": (64, 1),
    "(b) 16 x accumulate(4)": (16, 4),
    "(c) batch 16": (16, 1),
}
RERECORD = "python docs/gallery/make_gallery.py --run quickstart"


@pytest.mark.slow
def test_quickstart_page_memory_is_what_the_code_compiles_to():
    # The page said 485.8 / 325.6 KiB for run (b) after the micro-step had
    # changed and the step compiled to 506.0 / 345.9 KiB: figures on a page
    # come from the current code. Compiled here, not run.
    pytest.importorskip("sklearn", reason="needs the examples extra")
    import importlib.metadata

    recorded = (GALLERY / "outputs" / "quickstart.txt").read_text()
    m = re.search(r"^# recorded \S+ with jax (\S+) ", recorded, re.M)
    assert m, f"quickstart.txt names no jax version: run {RERECORD}"
    if m.group(1) != importlib.metadata.version("jax"):
        pytest.skip(f"recorded with jax {m.group(1)}; the memory differs")
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import _digits
        import quickstart
    finally:
        sys.path.remove(str(ROOT / "examples"))
    data = _digits.load_data()
    for run, (batch, accum) in QUICKSTART_RUNS.items():
        row = re.search(rf"^{re.escape(run)}\s.*$", recorded, re.M)
        assert row, run
        page = row.group().split()[-2:]
        total, temp = quickstart.step_memory(batch, accum, data)
        now = [f"{total / 1024:.1f}", f"{temp / 1024:.1f}"]
        assert page == now, (
            f"{run}: the page records {page} KiB (step, temp), the code "
            f"compiles to {now}: run {RERECORD}"
        )
