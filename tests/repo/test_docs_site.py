"""The checks of the built docs site (``tests/repo/docs_site_check.py``), on
small pages written here, and on the built site when there is one (``make
docs`` runs the same checks on its build)."""

from __future__ import annotations

import re

import pytest

from tests.repo.docs_site_check import (
    BUILT,
    CODE_WIDTH,
    MAX_TABLE_COLUMNS,
    page_problems,
    site_problems,
)

HEADER = '<a class="btn btn-source-repository-button" href="https://x">r</a>'


def _page(body: str, head: str = "", header: str = HEADER) -> str:
    return f"<html><head>{head}</head><body>{header}{body}</body></html>"


def test_a_clean_page_passes():
    code = "x = 1  # " + "a" * 70
    table = "<table><tr><th>name</th><th>meaning</th></tr>" + (
        "<tr><td>k</td><td>" + "word " * 60 + "</td></tr></table>"
    )
    head = '<script src="_static/mathjax/tex-chtml.js"></script>'
    assert page_problems(_page(f"<pre>{code}</pre>{table}", head), "p") == []


def test_a_long_code_line_fails():
    line = "y" * (CODE_WIDTH + 1)
    problems = page_problems(_page(f"<pre><span>{line}</span>\nz</pre>"), "p")
    assert len(problems) == 1 and "code line of 89" in problems[0]


def test_a_table_of_many_columns_fails():
    row = "<tr>" + "<td>1.0</td>" * (MAX_TABLE_COLUMNS + 1) + "</tr>"
    problems = page_problems(_page(f"<table>{row}</table>"), "p")
    assert len(problems) == 1 and "9 columns" in problems[0]


def test_a_table_of_long_unbreakable_words_fails():
    row = "<tr>" + f"<td>{'w' * 30}</td>" * 4 + "</tr>"
    problems = page_problems(_page(f"<table>{row}</table>"), "p")
    assert len(problems) == 1 and "4 columns" in problems[0]


@pytest.mark.parametrize(
    "tag",
    [
        '<script src="https://cdn.jsdelivr.net/npm/mathjax@4/tex-mml-chtml.js">'
        "</script>",
        '<link rel="stylesheet" href="https://fonts.example/x.css">',
        '<script src="//cdn.example/x.js"></script>',
    ],
)
def test_a_remote_asset_fails(tag):
    problems = page_problems(_page("<p>text</p>", tag), "p")
    assert len(problems) == 1 and "from the network" in problems[0]


def test_a_link_to_another_site_is_fine():
    body = '<a href="https://arxiv.org/abs/1812.06162">the paper</a>'
    assert page_problems(_page(body), "p") == []


@pytest.mark.parametrize(
    "text",
    [
        "B5 (" + "issue" + " 12)",
        "this session",
        "other agents' jobs",
        "on branch i25",
    ],
)
def test_work_log_words_fail(text):
    problems = page_problems(_page(f"<h2>{text}</h2>"), "p")
    assert len(problems) == 1 and "work-log word" in problems[0]


@pytest.mark.parametrize(
    "text",
    [
        "jax.jaxlib._jax.Array",
        "tuple[TypeAliasForwardRef('optax.Params'), ...]",
        "x: Array | ndarray | bool | number | bool | int | float | complex",
    ],
)
def test_a_private_or_expanded_type_fails(text):
    body = f"<dt>Type:</dt><dd><p>{text}</p></dd>"
    problems = page_problems(_page(body), "p")
    assert len(problems) == 1 and "public type name" in problems[0]


@pytest.mark.parametrize(
    "text",
    [
        "B1 measured 21.2x (two runs)",
        "a 2-core machine (load average 12)",
        "(tests/test_mesh.py keeps this as evidence)",
        "and another run measured 3.90x",
    ],
)
def test_run_notes_fail(text):
    problems = page_problems(_page(f"<p>{text}</p>"), "p")
    assert len(problems) == 1 and "run note" in problems[0]


def test_a_backslash_escape_in_text_mode_math_fails():
    # MathJax renders \texttt{trace\_cov} as "trace\_cov", backslash shown.
    bad = r'<div class="math notranslate">\[\texttt{trace\_cov} = x\]</div>'
    problems = page_problems(_page(bad), "p")
    assert len(problems) == 1 and "literal backslash" in problems[0]
    good = r'<div class="math">\[\texttt{trace_cov} = x_{i}\]</div>'
    assert page_problems(_page(good), "p") == []


def test_unbalanced_math_fails():
    bad = r'<span class="math">\(\frac{a}{b\)</span>'
    problems = page_problems(_page(bad), "p")
    assert len(problems) == 1 and "unbalanced" in problems[0]


@pytest.mark.parametrize(
    "text", [r"$$ x = \frac{a}{b} $$", r"so \operatorname{tr}(\Sigma) is"]
)
def test_tex_outside_math_fails(text):
    problems = page_problems(_page(f"<p>{text}</p>"), "p")
    assert problems and "TeX outside math" in problems[0]


def test_tex_in_code_is_fine():
    body = r"<pre>x = r'\frac{a}{b}'</pre><p><code>$$</code></p>"
    assert page_problems(_page(body), "p") == []


def test_an_unreplaced_substitution_fails():
    body = '<p>takes {{ fig("B1", "x", "y") }} the floor</p>'
    problems = page_problems(_page(body), "p")
    assert len(problems) == 1 and "substitution" in problems[0]


def test_two_search_fields_fail():
    field = '<button class="btn search-button-field">Search</button>'
    problems = page_problems(_page(field * 2), "p")
    assert len(problems) == 1 and "2 search fields" in problems[0]
    assert page_problems(_page(field), "p") == []


def test_an_api_summary_without_a_nowrap_rule_fails(tmp_path):
    page = _page('<table class="autosummary"><tr><td>chain</td></tr></table>')
    (tmp_path / "api.html").write_text(page)
    (tmp_path / "_static").mkdir()
    css = tmp_path / "_static" / "custom.css"
    css.write_text("p { color: red; }")
    problems = site_problems(tmp_path)
    assert len(problems) == 1 and "nowrap" in problems[0]
    css.write_text("table.autosummary td:first-child { white-space: nowrap; }")
    assert site_problems(tmp_path) == []


def test_script_text_is_not_read_as_page_text():
    body = '<script>var session = "agent";</script><p>fine</p>'
    assert page_problems(_page(body), "p") == []


@pytest.mark.skipif(
    not (BUILT / "index.html").exists(),
    reason="docs not built; make docs runs this check on the build",
)
def test_the_built_site():
    assert site_problems(BUILT) == []


EXT = BUILT.parent.parent / "_ext" / "doc_links.py"


@pytest.fixture
def doc_links():
    if not EXT.exists():
        pytest.skip("docs/_ext is not in this checkout")
    # The extension runs in Sphinx: the docs extra (make test) has it.
    pytest.importorskip("docutils", reason="needs the docs extra")
    import importlib.util

    spec = importlib.util.spec_from_file_location("doc_links", EXT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_page_pointers_in_docstrings_become_links(doc_links):
    line = 'see ``docs/scaling.md`` and docs/concepts.md, "Where wrappers go"'
    assert doc_links.link_pointers(line) == (
        'see :doc:`/scaling` and :doc:`/concepts`, "Where wrappers go"'
    )
    assert doc_links.link_pointers("Type: jax.jaxlib._jax.Array") == (
        "Type: jax.Array"
    )


def test_signatures_name_the_public_types(doc_links):
    union = (
        "~jax.jaxlib._jax.Array | ~numpy.ndarray | ~numpy.bool | ~numpy.number"
        " | bool | int | float | complex"
    )
    sig, ret = doc_links._process_signature(
        None,
        "class",
        "TrainState",
        None,
        None,
        f"(x: {union}, state: {union} | ~typing.Iterable[ArrayTree] | "
        "~typing.Mapping[~typing.Any, ArrayTree])",
        "tuple[TypeAliasForwardRef('optax.Params'), ~jax.jaxlib._jax.Array]",
    )
    assert sig == "(x: jax.typing.ArrayLike, state: optax.OptState)"
    assert ret == "tuple[optax.Params, jax.Array]"


def test_comm_model_tables_are_current():
    """docs/comm_model_table.md is what tools/comm_model.py writes: the
    tables split by quantity, each narrow enough for the page."""
    root = BUILT.parent.parent.parent
    page = root / "docs" / "comm_model_table.md"
    if not page.exists():
        pytest.skip("docs/comm_model_table.md is not in this checkout")
    from tools import comm_model

    assert page.read_text() == comm_model.markdown()
    widths = {line.count("|") - 1 for line in page.read_text().splitlines()}
    assert max(widths) <= MAX_TABLE_COLUMNS
    exposed = root / "docs" / "comm_exposed_table.md"
    assert exposed.read_text() == comm_model.exposed_markdown()
    widths = {line.count("|") - 1 for line in exposed.read_text().splitlines()}
    assert max(widths) <= MAX_TABLE_COLUMNS


def _signature_params(signature: str) -> list[tuple[str, bool]]:
    """``(name, keyword_only)`` of each parameter of a signature written
    as in docs/api/*.rst (defaults dropped, ``*`` and ``**kwargs`` kept)."""
    out, keyword_only = [], False
    depth, part, parts = 0, "", []
    for ch in signature:  # split on the top-level commas
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    parts.append(part)
    for p in (x.strip() for x in parts if x.strip()):
        name = p.split("=")[0].split(":")[0].strip()
        if name == "*":
            keyword_only = True
            continue
        if name.startswith("**"):
            continue
        out.append((name.lstrip("*"), keyword_only))
    return out


def test_hand_written_signatures_in_the_api_page_are_true():
    # A signature written into the API pages (where autodoc's own would be
    # unreadable) must name the parameters the object takes, positional or
    # keyword-only as it takes them; MultiSteps's said accumulator_dtype was
    # keyword-only when it is not.
    import importlib
    import inspect
    import pathlib
    import re

    docs = pathlib.Path(BUILT).parent.parent
    lines = [
        line
        for page in [docs / "api.rst", *sorted((docs / "api").glob("*.rst"))]
        for line in page.read_text().splitlines()
    ]
    module, checked = "optaxaccum", 0
    for line in lines:
        if m := re.match(r"\.\. (?:current|auto)?module:: (\S+)", line):
            module = m.group(1)
        m = re.match(r"\.\. auto(?:class|function):: (\w+)\((.*)\)$", line)
        if not m:
            continue
        obj = getattr(importlib.import_module(module), m.group(1))
        sig = inspect.signature(obj)
        if all(
            p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            for p in sig.parameters.values()
        ):
            sig = inspect.signature(obj.__init__)  # nnx's metaclass hides it
        params = [p for p in sig.parameters.values() if p.name != "self"]
        actual = [
            (p.name, p.kind is p.KEYWORD_ONLY)
            for p in params
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ]
        written = _signature_params(m.group(2))
        where = f"{module}.{m.group(1)}"
        assert [w for w in written if w[0] in dict(actual)] == actual, (
            f"{where}: {written} vs {actual}"
        )
        extra = [name for name, kw in written if name not in dict(actual)]
        if extra:  # passed on through **kwargs: keyword-only, to a base
            assert any(p.kind is p.VAR_KEYWORD for p in params), where
            assert all(kw for name, kw in written if name in extra), where
            taken = {
                name
                for base in inspect.getmro(obj)[1:]
                if "__init__" in vars(base)
                for name in inspect.signature(base.__init__).parameters
            }
            assert set(extra) <= taken, f"{where}: {set(extra) - taken}"
        checked += 1
    assert checked >= 2


def test_multisteps_signature_is_generated():
    import pathlib

    api = pathlib.Path(BUILT).parent.parent / "api" / "accumulation.rst"
    assert ".. autoclass:: MultiSteps\n" in api.read_text()


ROOT = BUILT.parent.parent.parent


def test_a_page_without_a_repository_link_fails():
    problems = page_problems(_page("<p>text</p>", header=""), "p")
    assert problems == ["p: no link to the repository in the header"]
    assert page_problems(_page("<p>text</p>"), "p") == []


def test_the_landing_page_without_an_install_line_fails():
    problems = page_problems(_page("<p>hi</p>"), "index.html")
    assert len(problems) == 1 and "one-line install" in problems[0]
    # Inline code has no copy button and wraps mid-address on a phone.
    body = "<p><code>pip install optaxaccum</code></p>"
    problems = page_problems(_page(body), "index.html")
    assert len(problems) == 1 and "in a code block" in problems[0]
    body = '<div class="highlight"><pre>pip install optaxaccum</pre></div>'
    assert page_problems(_page(body), "index.html") == []


def test_a_repository_file_named_without_a_link_fails(tmp_path):
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "fsdp.py").write_text("")
    for body in (
        "<p>see <code>examples/fsdp.py</code>.</p>",
        "<p>see examples/fsdp.py.</p>",
    ):
        problems = page_problems(_page(body), "p", tmp_path)
        assert len(problems) == 1 and "'examples/fsdp.py'" in problems[0]
    linked = '<p><a href="u"><code>examples/fsdp.py</code></a></p>'
    missing = "<p><code>examples/other.py</code> <code>tests/</code></p>"
    code = "<pre>python examples/fsdp.py</pre>"
    for body in (linked, missing, code):
        assert page_problems(_page(body), "p", tmp_path) == []


def test_a_machine_path_fails():
    body = "<pre>saved /work/main/docs/figures/adascale.png</pre>"
    problems = page_problems(_page(body), "p")
    assert len(problems) == 1 and "absolute path" in problems[0]
    body = "<pre>saved ./adascale.png</pre><p>a/work/b/c</p>"
    assert page_problems(_page(body), "p") == []


def test_a_private_class_name_fails():
    body = "<dt>Type:</dt><dd>optaxaccum._src.batch_stats.Window</dd>"
    problems = page_problems(_page(body), "p")
    assert len(problems) == 1 and "public type name" in problems[0]
    body = "<p>nothing under <code>optaxaccum._src</code> is</p>"
    assert page_problems(_page(body), "p") == []


def test_a_long_api_page_fails():
    entry = '<dl class="py function"><dt>f</dt></dl>'
    member = '<dl class="py method"><dt>m</dt></dl>'
    problems = page_problems(_page(entry * 13), "api.html")
    assert len(problems) == 1 and "13 API entries" in problems[0]
    body = entry * 12 + member * 20
    assert page_problems(_page(body), "api.html") == []


@pytest.mark.parametrize(
    "code", ["W = sum_i w_i", "tr(Sigma)", "|G|^2", "(tr Σ / B0 + |G|²)"]
)
def test_a_formula_as_code_fails(code):
    math = r'<span class="math">\(x\)</span>'
    body = f"{math}<p><code>{code}</code></p>"
    problems = page_problems(_page(body), "p")
    assert len(problems) == 1 and "formula written as code" in problems[0]
    # On a page without other math too, and in a docstring on an API page
    # (``:math:`` renders there and reads as text in help()).
    for page, name in ((f"<code>{code}</code>", "p"), (body, "api/x.html")):
        problems = page_problems(_page(page), name)
        assert len(problems) == 1 and "formula written as code" in problems[0]
    assert (
        page_problems(_page("<code>oa.agc(0.01, eps=1e-3)</code>"), "p") == []
    )


def test_a_wide_display_equation_fails():
    wide = (
        r"\begin{aligned} \mathbb{E}[A] &= \frac{1}{W} \sum_i w_i "
        r"\Big(|G|^2 + \frac{\operatorname{tr}(\Sigma)}{w_i}\Big) "
        r"= |G|^2 + \frac{k \operatorname{tr}(\Sigma)}{W} \end{aligned}"
    )
    broken = wide.replace(r"\Big) =", r"\Big) \\ &=")
    for tex, n in ((wide, 1), (broken, 0)):
        body = f'<div class="math">\\[{tex}\\]</div>'
        problems = page_problems(_page(body), "p")
        assert len(problems) == n, problems
    inline = f'<span class="math">\\({wide}\\)</span>'
    assert page_problems(_page(inline), "p") == []


def _png(path, width):
    head = b"\x89PNG\r\n\x1a\n" + b"\0\0\0\rIHDR" + width.to_bytes(4, "big")
    path.write_bytes(head + (100).to_bytes(4, "big"))


def test_a_wide_figure_outside_a_wide_figure_container_fails(tmp_path):
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "custom.css").write_text("")
    _png(tmp_path / "chart.png", 990)
    _png(tmp_path / "thumb.png", 360)
    page = tmp_path / "p.html"
    page.write_text(_page('<img src="chart.png"><img src="thumb.png">'))
    problems = site_problems(tmp_path, None)
    assert len(problems) == 1 and "chart.png is 990 px" in problems[0]
    body = '<div class="wide-figure"><p><img src="chart.png"></p></div>'
    page.write_text(_page(body))
    problems = site_problems(tmp_path, None)
    assert len(problems) == 1 and "not a link to its full-size" in problems[0]
    body = (
        '<div class="wide-figure"><p><a href="_images/chart.png">'
        '<img src="chart.png"></a></p></div>'
    )
    page.write_text(_page(body))
    assert site_problems(tmp_path, None) == []


def test_a_fixed_width_for_wide_figures_fails(tmp_path):
    # A phone scrolled a 720 px figure in a 358 px box, its title cut.
    (tmp_path / "_static").mkdir()
    css = tmp_path / "_static" / "custom.css"
    css.write_text(
        "@media (max-width: 960px) {\n  .wide-figure img {\n"
        "    max-width: none;\n    width: 720px;\n  }\n}\n"
    )
    (tmp_path / "p.html").write_text(_page("<p>text</p>"))
    problems = site_problems(tmp_path, None)
    assert len(problems) == 1 and "fixed width" in problems[0]
    css.write_text(".wide-figure img {\n  max-width: 100%;\n}\n")
    assert site_problems(tmp_path, None) == []


def test_search_excerpts_without_the_theme_buttons(tmp_path):
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "custom.css").write_text("")
    buttons = '<div class="theme-switch-container">System Settings</div>'
    (tmp_path / "p.html").write_text(_page(buttons))
    (tmp_path / "search.html").write_text(_page("<p>search</p>"))
    problems = site_problems(tmp_path, None)
    assert len(problems) == 1 and "search_excerpts.js" in problems[0]
    (tmp_path / "_static" / "search_excerpts.js").write_text("")
    script = '<script defer src="_static/search_excerpts.js"></script>'
    (tmp_path / "search.html").write_text(_page("", script))
    assert site_problems(tmp_path, None) == []


def _main(article: str, around: str = "") -> str:
    return (
        f'<main role="main"><div class="bd-header-article">Light Dark</div>'
        f"{around}<article>{article}</article></main>"
    )


def test_search_excerpts_that_start_outside_the_article_fail(tmp_path):
    # The print-only title and contents, and the "on this page" sidebar,
    # sit in the main element: excerpts started with "Contents".
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "custom.css").write_text("")
    script = tmp_path / "_static" / "search_excerpts.js"
    script.write_text('const HIDDEN = ".bd-header-article, footer";')
    toc = '<div class="onlyprint"><h1>T</h1><h2>Contents</h2></div>'
    (tmp_path / "p.html").write_text(_page(_main("<h1>T</h1><p>x</p>", toc)))
    problems = site_problems(tmp_path, None)
    assert len(problems) == 1 and "'T Contents'" in problems[0]
    script.write_text('const HIDDEN = ".bd-header-article, .onlyprint";')
    assert site_problems(tmp_path, None) == []


def test_a_source_listing_titled_by_a_private_path_fails(tmp_path):
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "custom.css").write_text("")
    listing = tmp_path / "_modules" / "optaxaccum" / "_src" / "accumulate.html"
    listing.parent.mkdir(parents=True)
    (tmp_path / "p.html").write_text(_page("<p>x</p>"))
    listing.write_text(
        "<title>optaxaccum._src.accumulate</title>"
        "<h1>Source code for optaxaccum._src.accumulate</h1>"
    )
    problems = site_problems(tmp_path, None)
    assert len(problems) == 2 and "private path" in problems[0]
    listing.write_text(
        "<title>optaxaccum (accumulate.py)</title>"
        "<h1>Source code for optaxaccum (accumulate.py)</h1>"
    )
    assert site_problems(tmp_path, None) == []


def test_source_listings_are_named_by_public_modules():
    pytest.importorskip("sphinx", reason="needs the docs extra")
    site_layout = _load_ext("site_layout")
    publics = site_layout.private_modules(
        ["optaxaccum", "optaxaccum.batchnorm", "optaxaccum.flax"]
    )
    assert publics["optaxaccum._src.accumulate"] == "optaxaccum"
    title = site_layout.source_title("optaxaccum._src.batch_stats", publics)
    assert title == "optaxaccum.batchnorm (batch_stats.py)"
    title = site_layout.source_title("optaxaccum._src.nothing", publics)
    assert "_src" not in title and "nothing.py" in title


def test_a_table_hiding_its_columns_on_a_phone_fails():
    # "What folds where" showed its first two columns of five on a phone:
    # a first column of long calls, the floor cells past the screen's edge.
    wide = "<td>" + "w" * 30 + "</td>"
    row = f"<tr>{wide}<td>{'x' * 15}</td>" + "<td>floor</td>" * 3 + "</tr>"
    problems = page_problems(_page(f"<table>{row}</table>"), "p")
    assert len(problems) == 1 and "3 of the 5 columns" in problems[0]
    row = f"<tr><td>{'w' * 14}</td>" + "<td>floor</td>" * 4 + "</tr>"
    assert page_problems(_page(f"<table>{row}</table>"), "p") == []
    # Two columns scroll, but a phone shows the start of the second.
    row = f"<tr>{wide}<td>{'y' * 30}</td></tr>"
    assert page_problems(_page(f"<table>{row}</table>"), "p") == []


def test_a_formula_in_a_table_counts_as_rendered():
    tex = r"\frac{\operatorname{tr}(\Sigma)}{|G|^2}"
    cell = f'<td><span class="math">\\({tex}\\)</span></td>'
    row = f"<tr><td>rule</td>{cell}<td>assumes</td></tr>"
    assert page_problems(_page(f"<table>{row}</table>"), "p") == []


def test_contents_listing_a_title_twice_fails():
    # The landing page listed the API topics twice under "API reference":
    # the pages of its toctree, then the overview's sections of the same
    # names.
    def toc(*titles):
        items = "".join(f'<li><a href="#">{t}</a></li>' for t in titles)
        return (
            '<div class="toctree-wrapper compound"><ul><li><a href="api">API'
            f"</a><ul>{items}</ul></li></ul></div>"
        )

    problems = page_problems(
        _page(toc("Sharded meshes", "Gates", "Sharded meshes")), "p"
    )
    assert problems == [
        "p: its table of contents lists 'Sharded meshes' twice under one entry"
    ]
    assert page_problems(_page(toc("Sharded meshes", "Gates")), "p") == []


def test_the_api_overview_lists_every_public_name():
    # fold_compiler_options and collective_exposure were documented on
    # their pages and missing from the overview's summary tables.
    import importlib

    docs = ROOT / "docs"
    overview = _summaries(docs / "api.rst")
    pages = {}
    for page in sorted((docs / "api").glob("*.rst")):
        pages.update(_summaries(page))
    conf = (docs / "conf.py").read_text()
    modules = re.search(r"coverage_check_modules = \[(.*?)\]", conf, re.S)
    assert modules
    for module in re.findall(r'"([\w.]+)"', modules.group(1)):
        exported = importlib.import_module(module).__all__
        listed = [
            n
            for (m, _), names in overview.items()
            if m == module
            for n in names
        ]
        missing = sorted(set(exported) - set(listed))
        assert not missing, f"docs/api.rst: {module} leaves out {missing}"
    # Each section lists what its page lists, in the same order.
    by_title = {title: names for (_, title), names in pages.items()}
    for (_, title), names in overview.items():
        assert by_title.get(title) == names, f"docs/api.rst, {title!r}"


def _summaries(path) -> dict[tuple[str, str], list[str]]:
    """``(module, section title) -> names`` of each autosummary in an rst
    page (a page without sections: its title)."""
    lines = path.read_text().splitlines()
    module, title, out = "optaxaccum", "", {}
    for i, line in enumerate(lines):
        if m := re.match(r"\.\. (?:current)?module:: (\S+)", line):
            module = m.group(1)
        if i + 1 < len(lines) and re.fullmatch(r"[-=]{3,}", lines[i + 1]):
            title = line.strip("`")
        if line.startswith(".. autosummary::"):
            names = []
            for entry in lines[i + 1 :]:
                if entry and not entry.startswith(" "):
                    break
                if re.fullmatch(r"   \w+", entry):
                    names.append(entry.strip())
            out[(module, title)] = names
    return out


def _load_ext(name):
    import importlib.util

    path = ROOT / "docs" / "_ext" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_shows_the_readme_peer_comparison():
    # The comparison with optax.MultiSteps, the TF package and Tunix was in
    # the README only; the site shows the same table, read from it.
    pytest.importorskip("sphinx", reason="needs the docs extra")
    site_layout = _load_ext("site_layout")
    readme = (ROOT / "README.md").read_text()
    header, rows = site_layout.peer_table(readme)
    tools = " ".join(header)
    for tool in (
        "optaxaccum",
        "optax.MultiSteps",
        "gradient-accumulator",
        "Tunix",
    ):
        assert tool in tools, tool
    date = re.search(r"Tunix.*\((\d{4}-\d{2})\)", header[-1])
    assert date, header[-1]
    text = site_layout.peer_markdown(header, rows)
    for feature, *answers in rows:
        assert feature in text
        assert all(a in text for a in answers if a != "—"), feature
    migration = (ROOT / "docs" / "migration.md").read_text()
    assert "```{peer-comparison}" in migration
    assert f"as of {date.group(1)}" in " ".join(migration.split())


def test_hand_recorded_figures_are_dated_on_their_pages():
    # The benchmarks page's GPU timings, recorded by hand before the
    # micro-step changed, carried no date and no link to the GPU page.
    import json

    record = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    hand = {entry["name"] for entry in record.get("hand", [])}
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        used = set(re.findall(r'\b(?:table|fig)\("([^"]+)"', text)) & hand
        for name in sorted(used):
            assert f'note("{name}", "date")' in text, (page.name, name)
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    gpu_section = bench.split("## On a GPU", 1)[1]
    assert "{doc}`gpu`" in gpu_section


def test_the_changelog_says_what_gpu_fold_concludes():
    # GPU_FOLD.md ends with the design the library uses; the changelog
    # said it records "why none is used".
    fold = (ROOT / "benchmarks" / "GPU_FOLD.md").read_text()
    assert "optaxaccum now uses that design" in fold
    changelog = " ".join((ROOT / "CHANGELOG.md").read_text().split())
    for entry in re.split(r" - ", changelog):
        if "GPU_FOLD.md" in entry:
            assert "none is used" not in entry, entry[:120]
            assert not re.search(r"\bnone avoids\b", entry), entry[:120]


def test_private_classes_get_their_public_names(doc_links):
    names = doc_links.public_names(["optaxaccum", "optaxaccum.batchnorm"])
    assert names["optaxaccum._src.base.Emitted"] == "optaxaccum.Emitted"
    window = names["optaxaccum._src.batch_stats.Window"]
    assert window == "optaxaccum.batchnorm.Window"
    line = (
        ":type: collections.abc.Callable[[], optaxaccum._src.base.Emitted]"
        " | ~optaxaccum._src.base.Emitted"
    )
    assert doc_links.public(line, names) == (
        ":type: collections.abc.Callable[[], optaxaccum.Emitted]"
        " | optaxaccum.Emitted"
    )


def test_repository_files_on_the_pages_are_found(doc_links):
    assert doc_links.repository_path("examples/fsdp.py") == "examples/fsdp.py"
    assert doc_links.repository_path("benchmarks/") == "benchmarks/"
    assert doc_links.repository_path("examples/<name>.py") is None
    assert doc_links.repository_path("examples/nothing.py") is None
    assert doc_links.repository_path("../etc/passwd") is None


def test_the_scaling_headline_is_a_row_of_its_tables():
    # "The headline, 8B parameters on 16 slices ... with `k = 8`" quoted a
    # k the tables do not have (1, 4 and 16).
    page = " ".join((ROOT / "docs" / "scaling.md").read_text().split())
    table = (ROOT / "docs" / "comm_model_table.md").read_text()
    m = re.search(
        r"The headline, (\w+) parameters on (\d+) slices .*?`k = (\d+)`: "
        r"(\d+)x fewer DCN bytes",
        page,
    )
    assert m, "scaling.md: the communication model's headline"
    params, slices, k, ratio = m.groups()
    row = rf"^\| {params} +\| {slices} +\| {k} +\|.*\| {ratio}\.0x +\|$"
    assert re.search(row, table, re.M), m.group()


def test_the_pages_say_what_a_too_short_batchnorm_window_raises():
    # Eagerly the check raises ValueError; under jit it runs in a callback
    # and arrives as JaxRuntimeError, which `except ValueError` misses.
    pytest.importorskip("flax")
    import jax

    from tests.flax_helpers import bn_trainstate_steps

    raised = {}
    for jit in (False, True):
        with pytest.raises(Exception, match="accum_steps") as info:
            bn_trainstate_steps(4, 6, 5, jit)
        raised[jit] = info.value
    assert type(raised[False]) is ValueError
    assert isinstance(raised[True], jax.errors.JaxRuntimeError)
    assert not isinstance(raised[True], ValueError)
    for page in ("concepts.md", "sharp_bits.md"):
        text = " ".join((ROOT / "docs" / page).read_text().split())
        assert "`jax.errors.JaxRuntimeError`" in text, page
