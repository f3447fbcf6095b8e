"""Checks the built docs site as a reader sees it.

``make docs`` runs this file on the HTML build
(``python tests/repo/docs_site_check.py docs/_build/html``) and fails when a
page has a problem; ``tests/repo/test_docs_site.py`` tests the checks. A page
fails when

* a line of a code block is longer than 88 characters (the project's
  line length, which the content column is sized for: a longer line
  scrolls sideways and hides its end);
* a table is wider than the content column: more than 8 columns, or
  columns whose longest words (which a browser cannot break) add up to
  more than the column holds; or, on a phone, more than half of its columns
  (of three or more) start past the edge of the screen, hidden behind a
  sideways scroll;
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
  site's style sheet must keep the name column from wrapping);
* it names a private class (``optaxaccum._src.batch_stats.Window``) where
  users import a public one, or holds more API entries than a reader
  scrolls through (the reference is split into pages);
* it has no link to the repository in its header, or (the landing page) no
  one-line install in a code block (a copy button, no line broken
  mid-address); its table of contents lists the same title twice under
  one entry; a file of the repository it names (``examples/fsdp.py``)
  is not a link; it shows an absolute path of the machine that built it;
* it writes a formula as code (``W = sum_i w_i``) rather than as math
  (docstrings included: ``:math:``), or has a display equation too wide
  for a phone's column (about 30 characters: a wider one needs line
  breaks, ``\\``);
* it shows a figure wider than a phone can read outside a
  ``wide-figure`` container, or inside one without a link to the
  full-size image (the container fits the figure to the column; the
  style sheet must not give it a fixed width that a phone scrolls);
* search excerpts would start with the theme's buttons ("System Settings
  Light Dark") or the page's table of contents ("Contents"): the site must
  load ``_static/search_excerpts.js``, and what it leaves of a page's main
  element must be the article alone;
* a source listing (``_modules/``) is titled by a private module path
  (``optaxaccum._src.accumulate``).

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
    r"|\boptaxaccum\._src\.\w+"
)
# API entries (functions and classes, not their members) on one page.
MAX_API_ENTRIES = 12
# An absolute path on the machine that built the site or ran an example.
MACHINE_PATH = re.compile(
    r"(?<![\w.:/~-])/(?:home|Users|work|root|tmp|mnt)/[\w.-]+/[\w./-]*"
)
# A file or folder of the repository, named on a page.
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:examples|benchmarks|tests|tools|docs|optaxaccum|\.ci)/"
    r"(?:[\w.-]+/)*(?:[\w.-]*[\w/])?|README\.md|CHANGELOG\.md|Makefile"
    r"|pyproject\.toml|LICENSE)"
)
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# A formula written as inline code rather than math.
FORMULA_CODE = re.compile(
    r"\bsum_\w|\w\^\d|\bSigma\b|\|G\||\btr\s?\(|\bE\[|[²Σ]"
    r"|\bsqrt\(W|\bW / B0\b"
)
# A phone's content column (358 px at 390 px) holds about this many
# characters of display math (tests/repo/docs_site_check.py's tex_width).
DISPLAY_MATH_WIDTH = 30
# ... and about this many characters of a table, counted as _table_chars
# counts them (prose at about 7.7 px a character, code at 8.4, 3 characters
# of padding per cell; gpu's five-column table measured 310 px for a first
# column of 36 in Chromium at 390 px).
PHONE_TABLE_CHARS = 44
# Wider images (in pixels) are unreadable scaled to a phone's column.
WIDE_IMAGE = 800
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
# A fixed width for a wide figure: a phone scrolls it and cuts its title.
FIXED_FIGURE_WIDTH = re.compile(
    r"\.wide-figure\s+img[^{]*\{[^}]*(?<![\w-])width:\s*\d+px", re.S
)
# Pages made by Sphinx itself (search, index of names), not by the project;
# the source listings (_modules/), which show the private modules; and the
# theme's own templates (_static/).
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
        self.display: list[bool] = []  # per math element: a display?
        self.inline_code: list[tuple[str, bool]] = []  # (text, in a link)
        self.unlinked_prose: list[str] = []
        # (src, in a wide-figure, the href of the link around it or "")
        self.images: list[tuple[str, bool, str]] = []
        # Per table, per row, per cell: its widest unbreakable piece on a
        # phone (a word, or a formula by tex_width).
        self.phone_cells: list[list[list[float]]] = []
        # Titles listed twice under one entry of a table of contents.
        self.toc_repeats: list[str] = []
        self._toc: list[list[str]] = []
        self._toc_depth = 0
        self._links: list[str] = []
        self._units: list[float] | None = None
        self.api_entries = 0
        self.repository_link = False
        self.theme_buttons = False
        self._stack: list[tuple[str, list[str]]] = []
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
            self.display.append(tag == "div")
        if tag == "code":
            self._code += 1
            if not self._pre:
                self.inline_code.append(("", self._inside("a")))
        if tag == "img":
            wide = any("wide-figure" in c for _, c in self._stack)
            href = self._links[-1] if self._links else ""
            self.images.append((attrs.get("src") or "", wide, href))
        if tag == "a":
            self._links.append(attrs.get("href") or "")
            if self._toc:
                self._toc[-1].append("")
        if "toctree-wrapper" in classes:
            self._toc_depth = len(self._stack) + 1
        if tag == "ul" and self._toc_depth:
            self._toc.append([])
        if tag == "dl" and "py" in classes:
            self.api_entries += bool({"function", "class"} & set(classes))
        if tag == "a" and "btn-source-repository-button" in classes:
            self.repository_link = True
        if "theme-switch-container" in classes:
            self.theme_buttons = True
        if tag not in VOID:
            self._stack.append((tag, classes))
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
            self.phone_cells.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
            self.phone_cells[-1].append([])
        elif tag in ("td", "th") and self.tables and self.tables[-1]:
            self._cell = []
            self._units = []

    def _inside(self, tag: str) -> bool:
        return any(t == tag for t, _ in self._stack)

    def handle_endtag(self, tag):
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == tag:
                del self._stack[i:]
                break
        if len(self._stack) < self._toc_depth:
            self._toc_depth = 0
        if tag == "a" and self._links:
            self._links.pop()
        if tag == "ul" and self._toc:
            titles = [t for t in self._toc.pop() if t]
            self.toc_repeats += sorted(
                {t for t in titles if titles.count(t) > 1}
            )
        if self._math:
            self._math -= 1
            if not self._math and self._units is not None:
                inner = self.math[-1].strip()
                inner = inner.removeprefix("\\(").removesuffix("\\)")
                self._units.append(tex_width(inner) if inner else 0)
        if tag == "code":
            self._code = max(0, self._code - 1)
        if tag == "pre":
            self._pre = max(0, self._pre - 1)
        elif tag in ("script", "style"):
            self._hidden = max(0, self._hidden - 1)
        elif tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append(" ".join(self._cell))
            self.phone_cells[-1][-1].append(max(self._units or [0]))
            self._cell = self._units = None

    def handle_data(self, data):
        if self._hidden:
            return
        self.text.append(data)
        if self._math:
            self.math[-1] += data
        elif not (self._pre or self._code):
            self.prose.append(data)
            if not self._inside("a"):
                self.unlinked_prose.append(data)
        if self._code and not self._pre and self.inline_code:
            text, linked = self.inline_code[-1]
            self.inline_code[-1] = (text + data, linked)
        if self._pre:
            self.code_blocks[-1] += data
        if self._cell is not None:
            self._cell.append(data)
            if not self._math and self._units is not None:
                self._units += [len(w) for w in data.split()]
        if self._toc and self._links:
            self._toc[-1][-1] = " ".join(
                (self._toc[-1][-1] + " " + data).split()
            )


def _table_chars(rows: list[list[str]]) -> int:
    """The narrowest width of a table in characters: per column, its longest
    word (cells wrap between words only), plus padding."""
    widest: dict[int, int] = {}
    for row in rows:
        for i, cell in enumerate(row):
            longest = max((len(w) for w in cell.split()), default=0)
            widest[i] = max(widest.get(i, 0), longest)
    return sum(w + TABLE_CELL_PADDING for w in widest.values())


def page_problems(
    source: str, name: str, repo: pathlib.Path | None = None
) -> list[str]:
    """What a reader of the page ``name`` (its HTML ``source``) runs into;
    with ``repo``, the repository the site documents, also the files of it
    the page names without linking them."""
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
    for rows, units in zip(page.tables, page.phone_cells, strict=True):
        hidden = phone_hidden_columns(units)
        columns = max((len(r) for r in rows), default=0)
        if columns >= 3 and 2 * hidden > columns:
            head = " | ".join(rows[0])[:60] if rows else ""
            problems.append(
                f"{name}: on a phone {hidden} of the {columns} columns of a "
                f"table start past the screen's edge (fewer columns, or a "
                f"list): {head!r}"
            )
    problems += [
        f"{name}: its table of contents lists {title!r} twice under one entry"
        for title in page.toc_repeats
    ]
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
    problems += _source_problems(page, name, text, repo)
    problems += _formula_problems(page, name)
    if page.api_entries > MAX_API_ENTRIES:
        problems.append(
            f"{name}: {page.api_entries} API entries on one page (at most "
            f"{MAX_API_ENTRIES}: split the reference into pages)"
        )
    if page.search_fields > 1:
        problems.append(
            f"{name}: {page.search_fields} search fields (one is enough: "
            "the theme's navbar_persistent repeats the sidebar's)"
        )
    return problems


def phone_hidden_columns(units: list[list[float]]) -> int:
    """How many columns of a table (each cell's widest unbreakable piece,
    ``units``) start past the edge of a phone's column."""
    widths: dict[int, float] = {}
    for row in units:
        for i, unit in enumerate(row):
            widths[i] = max(widths.get(i, 0), unit + TABLE_CELL_PADDING)
    start, hidden = 0.0, 0
    for i in sorted(widths):
        hidden += start >= PHONE_TABLE_CHARS
        start += widths[i]
    return hidden


def repository_names(text: str, repo: pathlib.Path) -> list[str]:
    """The files and folders of ``repo`` that ``text`` names."""
    found = []
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if ".." not in path and (repo / path).exists():
            found.append(path)
    return found


def _source_problems(
    page: _Page, name: str, text: str, repo: pathlib.Path | None
) -> list[str]:
    """No way back to the source: no repository link, no install line on
    the landing page, file names that are not links; and machine paths."""
    problems = []
    if not page.repository_link:
        problems.append(f"{name}: no link to the repository in the header")
    if name == "index.html" and not any(
        "pip install" in block for block in page.code_blocks
    ):
        problems.append(
            f"{name}: no one-line install (`pip install ...`) in a code block"
        )
    for m in MACHINE_PATH.finditer(text):
        problems.append(
            f"{name}: an absolute path of the machine that made it: "
            f"{m.group()!r}"
        )
    if repo is None:
        return problems
    unlinked = [code for code, linked in page.inline_code if not linked]
    prose = " ".join(" ".join(page.unlinked_prose).split())
    for found in [repository_names(code, repo) for code in unlinked] + [
        repository_names(prose, repo)
    ]:
        problems += [
            f"{name}: names the repository's {path!r} without a link"
            for path in found
        ]
    return problems


def tex_width(tex: str) -> float:
    """About how many characters wide a TeX formula renders: its widest
    line (``\\``), a fraction as wide as its wider part, sub- and
    superscripts at 0.7, spaced operators at 1.8."""
    widths = []
    for line in tex.split("\\\\"):
        line = re.sub(r"\\(?:begin|end)\{\w+\*?\}|&", "", line)
        line = re.sub(r"\\(?:left|right|[Bb]ig+)\b|\\[,;!: ]", "", line)
        widths.append(_group_width(line, 0)[0])
    return max(widths)


def _group_width(tex: str, i: int) -> tuple[float, int]:
    """The width of ``tex`` from ``i`` to its group's closing brace, and
    the position after it."""
    width = 0.0
    while i < len(tex):
        c = tex[i]
        if c == "}":
            return width, i + 1
        if c == "{":
            w, i = _group_width(tex, i + 1)
            width += w
        elif c in "_^":
            w, i = _atom_width(tex, i + 1)
            width += 0.7 * w
        elif c == "\\":
            m = re.match(r"\\([a-zA-Z]+)|\\(.)", tex[i:])
            assert m is not None
            macro, i = m.group(1) or m.group(2), i + m.end()
            if macro in ("frac", "dfrac", "tfrac"):
                top, i = _atom_width(tex, i)
                bottom, i = _atom_width(tex, i)
                width += max(top, bottom) + 0.5
            elif macro in ("text", "texttt", "mathrm", "operatorname", "mbox"):
                m = re.match(r"\s*\{([^{}]*)\}", tex[i:])
                arg = m.group(1) if m else ""
                i += m.end() if m else 0
                width += len(arg) * (1.1 if macro == "texttt" else 0.9)
            elif macro in ("qquad", "quad"):
                width += 2 if macro == "qquad" else 1
            elif macro not in ("mathbb", "mathbf", "sqrt", "displaystyle"):
                width += 1.8 if macro in ("leftarrow", "le", "ge") else 1
        elif c in "=+<>":
            width += 1.8
        elif not c.isspace():
            width += 1
        i += c not in "{_^\\"
    return width, i


def _atom_width(tex: str, i: int) -> tuple[float, int]:
    """The width of the group or single token at ``i``."""
    while i < len(tex) and tex[i].isspace():
        i += 1
    if i < len(tex) and tex[i] == "{":
        return _group_width(tex, i + 1)
    if i < len(tex) and tex[i] == "\\":
        m = re.match(r"\\[a-zA-Z]+|\\.", tex[i:])
        assert m is not None
        return 1.0, i + m.end()
    return (1.0 if i < len(tex) else 0.0), i + 1


def _formula_problems(page: _Page, name: str) -> list[str]:
    """Formulas as code beside rendered math; display math too wide."""
    problems = []
    for code, _ in page.inline_code:
        if FORMULA_CODE.search(code):
            problems.append(f"{name}: a formula written as code: {code!r}")
    for tex, display in zip(page.math, page.display, strict=True):
        inner = tex.strip().removeprefix("\\[").removesuffix("\\]")
        width = tex_width(inner) if display else 0
        if width > DISPLAY_MATH_WIDTH:
            problems.append(
                f"{name}: a display equation about {width:.0f} characters "
                f"wide (a phone's column holds {DISPLAY_MATH_WIDTH}): break "
                f"it into lines: {' '.join(inner.split())[:60]!r}..."
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


def png_width(path: pathlib.Path) -> int:
    """The width in pixels of a PNG file (0 for anything else)."""
    try:
        head = path.read_bytes()[:24]
    except OSError:
        return 0
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        return 0
    return int.from_bytes(head[16:20], "big")


def site_problems(
    root: str | pathlib.Path, repo: pathlib.Path | None = REPO_ROOT
) -> list[str]:
    """``page_problems`` of every page of the built site under ``root``
    (with ``repo``, the repository it documents), and the site's own."""
    root = pathlib.Path(root)
    pages = sorted(
        p
        for p in root.rglob("*.html")
        if p.name not in SKIPPED
        and not {"_modules", "_static"} & set(p.relative_to(root).parts)
    )
    if not pages:
        return [f"{root}: no HTML pages (build the docs first)"]
    problems = _source_listing_problems(root)
    summary = buttons = False
    script_path = root / "_static" / "search_excerpts.js"
    hidden = excerpt_hidden(script_path)
    for path in pages:
        source = path.read_text(encoding="utf-8")
        name = str(path.relative_to(root))
        problems += page_problems(source, name, repo)
        summary = summary or 'class="autosummary' in source
        page = _Page()
        page.feed(source)
        buttons = buttons or page.theme_buttons
        for src, wide, href in page.images:
            width = png_width(path.parent / src)
            if width > WIDE_IMAGE and not wide:
                problems.append(
                    f"{name}: {src} is {width} px wide, unreadable on a "
                    "phone: put it in a `wide-figure` container"
                )
            full = pathlib.PurePosixPath(src).name
            if wide and pathlib.PurePosixPath(href).name != full:
                problems.append(
                    f"{name}: {src} in a `wide-figure` container is not a "
                    "link to its full-size image"
                )
        problems += _excerpt_problems(source, name, hidden)
    search = root / "search.html"
    script = "search_excerpts.js"
    if buttons and not (
        (root / "_static" / script).exists()
        and search.exists()
        and script in search.read_text(encoding="utf-8")
    ):
        problems.append(
            f"search.html: does not load _static/{script}: search excerpts "
            "start with the theme's buttons ('System Settings Light Dark')"
        )
    css = root / "_static" / "custom.css"
    rules = css.read_text(encoding="utf-8") if css.exists() else ""
    if FIXED_FIGURE_WIDTH.search(rules):
        problems.append(
            f"{css.relative_to(root)}: a fixed width for `.wide-figure img`: "
            "on a phone the figure scrolls and its title is cut"
        )
    if summary and not NOWRAP_RULE.search(rules):
        problems.append(
            f"{css.relative_to(root) if css.exists() else css}: no "
            "`table.autosummary ... {white-space: nowrap}` rule: on a phone "
            "the API summary breaks names mid-word"
        )
    return problems


def excerpt_hidden(script: pathlib.Path) -> list[str]:
    """The selectors ``search_excerpts.js`` leaves out of an excerpt (its
    ``HIDDEN``), with those Sphinx's own search leaves out."""
    text = script.read_text(encoding="utf-8") if script.exists() else ""
    m = re.search(r"\bHIDDEN\s*=\s*[\"']([^\"']*)[\"']", text)
    found = m.group(1).split(",") if m else []
    return [s.strip() for s in found if s.strip()] + [".headerlink"]


class _MainText(html.parser.HTMLParser):
    """The text of a page's ``[role="main"]`` element outside its article,
    leaving out the elements that match ``selectors`` (``.class``,
    ``#id``, ``tag``, ``tag.class``), as the search's excerpts see it."""

    def __init__(self, selectors: list[str]) -> None:
        super().__init__(convert_charrefs=True)
        self.selectors = selectors
        self.text: list[str] = []
        self._stack: list[str] = []  # per open element: "main", "skip", ""

    def _matches(self, tag: str, attrs: dict) -> bool:
        classes = set((attrs.get("class") or "").split())
        for sel in self.selectors:
            m = re.fullmatch(r"([\w-]*)(?:([.#])([\w-]+))?", sel)
            if not m:
                continue
            want_tag, kind, value = m.groups()
            if want_tag and want_tag != tag:
                continue
            if kind == "." and value not in classes:
                continue
            if kind == "#" and attrs.get("id") != value:
                continue
            if want_tag or kind:
                return True
        return False

    def handle_starttag(self, tag, attrs):
        if tag in VOID:
            return
        attrs = dict(attrs)
        inside = "main" in self._stack
        skipped = "skip" in self._stack
        if attrs.get("role") == "main" and not inside:
            self._stack.append("main")
        elif (
            inside
            and not skipped
            and (
                tag in ("script", "style", "article")
                or self._matches(tag, attrs)
            )
        ):
            self._stack.append("skip")
        else:
            self._stack.append("")

    def handle_endtag(self, tag):
        if tag not in VOID and self._stack:
            self._stack.pop()

    def handle_data(self, data):
        if "main" in self._stack and "skip" not in self._stack:
            self.text.append(data)


def _excerpt_problems(source: str, name: str, hidden: list[str]) -> list[str]:
    """What a search excerpt of the page shows before its article."""
    if 'role="main"' not in source or "<article" not in source:
        return []
    parser = _MainText(hidden)
    parser.feed(source)
    outside = " ".join(" ".join(parser.text).split())
    if not outside:
        return []
    return [
        f"{name}: search excerpts start with {outside[:60]!r}, text outside "
        "the article (leave it out in _static/search_excerpts.js's HIDDEN)"
    ]


def _source_listing_problems(root: pathlib.Path) -> list[str]:
    """Source listings titled by a private module path."""
    problems = []
    for path in sorted((root / "_modules").rglob("*.html")):
        source = path.read_text(encoding="utf-8")
        heads = re.findall(r"<(title|h1)>(.*?)</\1>", source, re.S)
        links = re.findall(
            r'<a href="[^"]*">(optaxaccum\._src[\w.]*)</a>', source
        )
        for text in [t for _, t in heads] + links:
            if "optaxaccum._src" in text:
                problems.append(
                    f"{path.relative_to(root)}: titled by the private path "
                    f"{' '.join(text.split())[:60]!r}"
                )
    return problems


BUILT = pathlib.Path(__file__).resolve().parents[2] / "docs/_build/html"


if __name__ == "__main__":
    found = site_problems(sys.argv[1] if len(sys.argv) > 1 else BUILT)
    print("\n".join(found) or "docs site check: no problems")
    sys.exit(1 if found else 0)
