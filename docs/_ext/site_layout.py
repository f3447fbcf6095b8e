"""How some pages of the site are laid out for their readers.

* ``{peer-comparison}`` shows the README's comparison with the peer tools
  (``optax.MultiSteps``, the TF ``gradient-accumulator`` package, Tunix's
  ``WeightedMultiSteps``) on the site: one feature per entry, each tool's
  answer under it, which a phone reads without scrolling sideways. The
  README, between ``<!-- peer table -->`` and ``<!-- end of peer table -->``,
  is the one source of the table; the site reads it when it is built.
* An image in a ``wide-figure`` container fits the column and links to its
  full-size file (Sphinx links an image whose width is set), so that a
  phone shows the whole figure and opens it at full size.
* The source listings (``[source]``, ``sphinx.ext.viewcode``) are titled by
  the public module whose names a file defines, ``optaxaccum.batchnorm
  (batch_stats.py)``, not by its private path under ``optaxaccum._src``.
"""

from __future__ import annotations

import importlib
import pathlib
import re

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BEGIN = "<!-- peer table -->"
END = "<!-- end of peer table -->"


def peer_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows of the Markdown table between ``BEGIN`` and
    ``END`` in ``text`` (the README)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md: no table between {BEGIN!r} and {END!r}")
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    rows = [_cells(line) for line in lines if line.startswith("|")]
    if len(rows) < 3 or not set(rows[1][0]) <= set("-: "):
        raise ValueError("README.md: the peer table is not a Markdown table")
    header, body = rows[0], rows[2:]
    for row in body:
        if len(row) != len(header):
            raise ValueError(f"README.md: peer table row {row[0]!r}: {row}")
    return header, body


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def peer_markdown(header: list[str], rows: list[list[str]]) -> str:
    """The table as a definition list: per feature, each tool's answer."""
    out = []
    for feature, *answers in rows:
        out.append(feature)
        items = [
            f"**{tool}**: {answer}"
            for tool, answer in zip(header[1:], answers, strict=True)
            if answer not in ("—", "-", "")
        ]
        out.append(": - " + items[0])
        out += [f"  - {item}" for item in items[1:]]
        out.append("")
    return "\n".join(out)


class PeerComparison(SphinxDirective):
    """``{peer-comparison}``: the README's peer table, by feature."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(README))
        header, rows = peer_table(README.read_text(encoding="utf-8"))
        container = nodes.container(classes=["peer-comparison"])
        text = peer_markdown(header, rows)
        self.state.nested_parse(
            StringList(text.splitlines(), source=str(README)),
            self.content_offset,
            container,
        )
        return [container]


def _fit_wide_figures(app, doctree) -> None:
    for container in doctree.findall(nodes.container):
        if "wide-figure" in container["classes"]:
            for image in container.findall(nodes.image):
                image.setdefault("width", "100%")


SOURCE_H1 = re.compile(r"<h1>Source code for (optaxaccum\._src(?:\.\w+)+)</h1>")
INDEX_LINK = re.compile(r'(<a href="[^"]*">)(optaxaccum\._src(?:\.\w+)+)(</a>)')


def private_modules(modules: list[str]) -> dict[str, str]:
    """For each module under ``optaxaccum._src`` that defines a public
    name, the public module that exports most of its names."""
    counts: dict[str, dict[str, int]] = {}
    for public in modules:
        module = importlib.import_module(public)
        for name in getattr(module, "__all__", ()):
            where = getattr(getattr(module, name), "__module__", "") or ""
            if where.startswith("optaxaccum._src"):
                by = counts.setdefault(where, {})
                by[public] = by.get(public, 0) + 1
    return {m: max(by, key=lambda p: by[p]) for m, by in counts.items()}


def source_title(private: str, publics: dict[str, str]) -> str:
    """``optaxaccum.batchnorm (batch_stats.py)`` for
    ``optaxaccum._src.batch_stats``; a module no public name comes from is
    named ``optaxaccum (internal: tree.py)``."""
    file = private.removeprefix("optaxaccum._src.").replace(".", "/") + ".py"
    if private in publics:
        return f"{publics[private]} ({file})"
    return f"optaxaccum (internal: {file})"


def _source_pages(app, pagename, templatename, context, doctree) -> None:
    if not pagename.startswith("_modules/"):
        return
    publics = private_modules(list(app.config.coverage_check_modules))
    title = context.get("title", "")
    if title.startswith("optaxaccum._src"):
        context["title"] = source_title(title, publics)
    body = context.get("body", "")
    body = SOURCE_H1.sub(
        lambda m: f"<h1>Source code for {source_title(m[1], publics)}</h1>",
        body,
    )
    if pagename == "_modules/index":
        body = INDEX_LINK.sub(
            lambda m: m[1] + source_title(m[2], publics) + m[3], body
        )
    context["body"] = body
    for parent in context.get("parents", []):
        if parent.get("title", "").startswith("optaxaccum._src"):
            parent["title"] = source_title(parent["title"], publics)


def setup(app):
    app.add_directive("peer-comparison", PeerComparison)
    app.connect("doctree-read", _fit_wide_figures)
    app.connect("html-page-context", _source_pages)
    return {
        "version": "1.0",
        "parallel_read_safe": True,
        "parallel_write_safe": True,
    }
