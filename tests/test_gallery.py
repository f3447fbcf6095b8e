"""The gallery's pages (``docs/gallery``) show every example with its code,
its recorded output and its plot, and the site reads no inventory from the
network."""

from __future__ import annotations

import importlib.util
import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parent.parent
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
