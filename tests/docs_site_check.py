"""Checks the built docs site as a reader sees it.

``make docs`` runs this file on the HTML build
(``python tests/docs_site_check.py docs/_build/html``) and fails when a
page has a problem; ``tests/test_docs_site.py`` tests the checks. A page
fails when

* a line of a code block is longer than 88 characters (the project's
  line length, which the content column is sized for: a longer line
  scrolls sideways and hides its end);
* a table is wider than the content column: more than 8 columns, or
  columns whose longest words (which a browser cannot break) add up to
  more than the column holds;
* it loads a script, a style sheet or an image from the network (the
  site is read offline);
* its text names the private array class (``jaxlib._jax.Array``) where
  the public one (``jax.Array``) is meant, or shows a type alias as the
  repr of Sphinx's forward reference or expanded into its union
  (``ArrayLike``'s lists ``bool`` twice);
* its text speaks of the project's work log (an issue number, "session",
  "agent", "branch i25") or of the project's own runs ("(two runs)",
  "load average 12", "keeps this as evidence") rather than of the library;
* its math would render wrong: a backslash escape (``\\_``) inside a
  text-mode macro (``\\texttt{trace\\_cov}``: MathJax shows the backslash),
  unbalanced braces, or TeX left in the text outside any math (``$$``,
  ``\\frac``: a formula MyST did not turn into math);
* it shows a ``{{ ... }}`` substitution that was not replaced;
* its header holds more search fields than one (the theme's persistent
  navbar search next to the sidebar's);
* its API summary table lets names break mid-word on a narrow screen (the
  site's style sheet must keep the name column from wrapping).

Standard library only: it runs with the ``docs`` extra alone.
"""

from __future__ import annotations

import html.parser
import pathlib
import re
import sys

CODE_WIDTH = 88
MAX_TABLE_COLUMNS = 8
# The content column (836 px at 1400 px: a 7-column table measured 100 by
# this count and 879 px in Chromium) in characters, counting each cell's
# padding as TABLE_CELL_PADDING characters.
TABLE_CHARS = 90
TABLE_CELL_PADDING = 3
WORK_LOG = re.compile(
    r"\bissues? #?\d+|\bsessions?\b|\bagents?\b|\bbranch\W+i\d+\b", re.I
)
PRIVATE_TYPE = re.compile(
    r"\bjaxlib\._jax\.\w+|TypeAliasForwardRef|bool \| number \| bool"
)
RUN_NOTES = re.compile(
    r"\(two runs\)|\bload average\b|keeps this as evidence|\banother run\b"
    r"|depending on the run|\bother jobs\b|\bone run each\b|\bwe cannot run\b"
    r"|measured by the project",
    re.I,
)
# Text-mode macros: MathJax renders their argument as text, where a
# backslash escape such as \_ shows as a backslash and an underscore.
TEXT_MACRO = re.compile(r"\\(?:text\w*|mbox)\s*\{((?:[^{}]|\{[^{}]*\})*)\}")
TEXT_ESCAPE = re.compile(r"\\[_%&#$]")
STRAY_TEX = re.compile(
    r"\$\$|\\(?:frac|begin\{|end\{|operatorname|mathbb|texttt|sum_|cdot\b)"
)
SUBSTITUTION = re.compile(r"\{\{.*?\}\}")
# Names in the API summary tables (autosummary) must not wrap mid-word.
NOWRAP_RULE = re.compile(
    r"table\.autosummary[^{]*\{[^}]*white-space:\s*nowrap", re.S
)
REMOTE = re.compile(r"^\s*(https?:)?//", re.I)
# Pages made by Sphinx itself (search, index of names), not by the project.
SKIPPED = {"search.html", "genindex.html", "py-modindex.html"}
VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "col"}


class _Page(html.parser.HTMLParser):
    """Collects what the checks need from one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.code_blocks: list[str] = []
        self.tables: list[list[list[str]]] = []
        self.remote: list[str] = []
        self.text: list[str] = []
        self.math: list[str] = []
        self.prose: list[str] = []
        self.search_fields = 0
        self.autosummary = False
        self._math = 0
        self._code = 0
        self._pre = 0
        self._hidden = 0
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("src", "href") if tag in ("script", "img") else ("href",):
            if tag in ("script", "img", "link") and key in attrs:
                if REMOTE.match(attrs[key] or ""):
                    self.remote.append(f"<{tag} {key}={attrs[key]}>")
        classes = (attrs.get("class") or "").split()
        if self._math:
            self._math += tag not in VOID
        elif "math" in classes:
            self._math = 1
            self.math.append("")
        if tag == "code":
            self._code += 1
        if "search-button-field" in classes:
            self.search_fields += 1
        if tag == "table" and "autosummary" in classes:
            self.autosummary = True
        if tag == "pre":
            self._pre += 1
            if self._pre == 1:
                self.code_blocks.append("")
        elif tag in ("script", "style"):
            self._hidden += 1
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th") and self.tables and self.tables[-1]:
            self._cell = []

    def handle_endtag(self, tag):
        if self._math:
            self._math -= 1
        if tag == "code":
            self._code = max(0, self._code - 1)
        if tag == "pre":
            self._pre = max(0, self._pre - 1)
        elif tag in ("script", "style"):
            self._hidden = max(0, self._hidden - 1)
        elif tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append(" ".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._hidden:
            return
        self.text.append(data)
        if self._math:
            self.math[-1] += data
        elif not (self._pre or self._code):
            self.prose.append(data)
        if self._pre:
            self.code_blocks[-1] += data
        if self._cell is not None:
            self._cell.append(data)


def _table_chars(rows: list[list[str]]) -> int:
    """The narrowest width of a table in characters: per column, its longest
    word (cells wrap between words only), plus padding."""
    widest: dict[int, int] = {}
    for row in rows:
        for i, cell in enumerate(row):
            longest = max((len(w) for w in cell.split()), default=0)
            widest[i] = max(widest.get(i, 0), longest)
    return sum(w + TABLE_CELL_PADDING for w in widest.values())


def page_problems(source: str, name: str) -> list[str]:
    """What a reader of the page ``name`` (its HTML ``source``) runs into."""
    page = _Page()
    page.feed(source)
    problems = []
    for block in page.code_blocks:
        for line in block.splitlines():
            if len(line) > CODE_WIDTH:
                problems.append(
                    f"{name}: code line of {len(line)} > {CODE_WIDTH} "
                    f"characters: {line[:60]!r}..."
                )
    for rows in page.tables:
        columns = max((len(r) for r in rows), default=0)
        chars = _table_chars(rows)
        if columns > MAX_TABLE_COLUMNS or chars > TABLE_CHARS:
            head = " | ".join(rows[0])[:60] if rows else ""
            problems.append(
                f"{name}: table of {columns} columns, at least {chars} "
                f"characters wide (at most {MAX_TABLE_COLUMNS} and "
                f"{TABLE_CHARS}): {head!r}"
            )
    problems += [f"{name}: loads {r} from the network" for r in page.remote]
    text = " ".join(" ".join(page.text).split())
    for m in PRIVATE_TYPE.finditer(text):
        problems.append(f"{name}: {m.group()!r} instead of a public type name")
    for m in WORK_LOG.finditer(text):
        context = text[max(0, m.start() - 40) : m.end() + 40]
        problems.append(f"{name}: work-log word {m.group()!r}: ...{context}...")
    for m in RUN_NOTES.finditer(text):
        context = text[max(0, m.start() - 40) : m.end() + 40]
        problems.append(f"{name}: run note {m.group()!r}: ...{context}...")
    problems += _math_problems(page, name)
    prose = " ".join(" ".join(page.prose).split())
    for m in SUBSTITUTION.finditer(prose):
        problems.append(f"{name}: substitution left unreplaced: {m.group()!r}")
    if page.search_fields > 1:
        problems.append(
            f"{name}: {page.search_fields} search fields (one is enough: "
            "the theme's navbar_persistent repeats the sidebar's)"
        )
    return problems


def _math_problems(page: _Page, name: str) -> list[str]:
    """Math that would render wrong, and TeX outside any math."""
    problems = []
    for tex in page.math:
        for arg in TEXT_MACRO.findall(tex):
            for esc in TEXT_ESCAPE.findall(arg):
                problems.append(
                    f"{name}: math shows a literal backslash: {esc!r} in a "
                    f"text-mode macro ({arg!r}); write the character bare"
                )
        if tex.count("{") - tex.count("\\{") != tex.count("}") - tex.count(
            "\\}"
        ):
            problems.append(f"{name}: math with unbalanced braces: {tex!r}")
    prose = " ".join(" ".join(page.prose).split())
    for m in STRAY_TEX.finditer(prose):
        context = prose[max(0, m.start() - 40) : m.end() + 40]
        problems.append(
            f"{name}: TeX outside math, not rendered: ...{context}..."
        )
    return problems


def site_problems(root: str | pathlib.Path) -> list[str]:
    """``page_problems`` of every page of the built site under ``root``."""
    root = pathlib.Path(root)
    pages = sorted(p for p in root.rglob("*.html") if p.name not in SKIPPED)
    if not pages:
        return [f"{root}: no HTML pages (build the docs first)"]
    problems = []
    summary = False
    for path in pages:
        source = path.read_text(encoding="utf-8")
        problems += page_problems(source, str(path.relative_to(root)))
        summary = summary or 'class="autosummary' in source
    css = root / "_static" / "custom.css"
    rules = css.read_text(encoding="utf-8") if css.exists() else ""
    if summary and not NOWRAP_RULE.search(rules):
        problems.append(
            f"{css.relative_to(root) if css.exists() else css}: no "
            "`table.autosummary ... {white-space: nowrap}` rule: on a phone "
            "the API summary breaks names mid-word"
        )
    return problems


BUILT = pathlib.Path(__file__).resolve().parent.parent / "docs/_build/html"


if __name__ == "__main__":
    found = site_problems(sys.argv[1] if len(sys.argv) > 1 else BUILT)
    print("\n".join(found) or "docs site check: no problems")
    sys.exit(1 if found else 0)
