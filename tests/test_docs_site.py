"""The checks of the built docs site (``tests/docs_site_check.py``), on
small pages written here, and on the built site when there is one (``make
docs`` runs the same checks on its build)."""

from __future__ import annotations

import pytest

from tests.docs_site_check import (
    BUILT,
    CODE_WIDTH,
    MAX_TABLE_COLUMNS,
    page_problems,
    site_problems,
)


def _page(body: str, head: str = "") -> str:
    return f"<html><head>{head}</head><body>{body}</body></html>"


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
    """docs/comm_model_table.md is what benchmarks/comm_model.py writes: the
    tables split by quantity, each narrow enough for the page."""
    root = BUILT.parent.parent.parent
    page = root / "docs" / "comm_model_table.md"
    if not page.exists():
        pytest.skip("docs/comm_model_table.md is not in this checkout")
    import sys

    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import comm_model
    finally:
        sys.path.remove(str(root / "benchmarks"))
    assert page.read_text() == comm_model.markdown()
    widths = {line.count("|") - 1 for line in page.read_text().splitlines()}
    assert max(widths) <= MAX_TABLE_COLUMNS
    exposed = root / "docs" / "comm_exposed_table.md"
    assert exposed.read_text() == comm_model.exposed_markdown()
    widths = {line.count("|") - 1 for line in exposed.read_text().splitlines()}
    assert max(widths) <= MAX_TABLE_COLUMNS


def _params(signature: str) -> list[tuple[str, bool]]:
    """``(name, keyword_only)`` of each parameter of a signature written
    as in docs/api.rst (defaults dropped, ``*`` and ``**kwargs`` kept)."""
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
    # A signature written into docs/api.rst (where autodoc's own would be
    # unreadable) must name the parameters the object takes, positional or
    # keyword-only as it takes them; MultiSteps's said accumulator_dtype was
    # keyword-only when it is not.
    import importlib
    import inspect
    import pathlib
    import re

    api = pathlib.Path(BUILT).parent.parent / "api.rst"
    module, checked = "optaxaccum", 0
    for line in api.read_text().splitlines():
        if m := re.match(r"\.\. (?:current)?module:: (\S+)", line):
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
        written = _params(m.group(2))
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

    api = (pathlib.Path(BUILT).parent.parent / "api.rst").read_text()
    assert ".. autoclass:: MultiSteps\n" in api
