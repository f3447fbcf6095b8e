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
    ["B5 (" + "issue" + " 12)", "this session", "other agents' jobs", "on branch i25"],
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
