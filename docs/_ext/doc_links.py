"""Turns the ``docs/<page>.md`` pointers in docstrings into links.

The library's docstrings point to the guides as ``docs/scaling.md`` (or
````docs/scaling.md````), which reads well in ``help()`` and in an editor.
On the site the same text becomes a ``:doc:`` link to the page, titled by
the page. The docstrings themselves are left as they are.

It also names ``jax.Array`` by its public name in the attribute types that
napoleon reads from a class's annotations (the runtime class is private,
``jaxlib._jax.Array``), so it runs after napoleon; and it writes an alias of
``autodoc_type_aliases`` inside a generic (``tuple[optax.Params, ...]``) by
its name, where Sphinx shows the repr of its forward reference, and the
aliases that a class built at import time (flax's ``TrainState`` fields)
carries expanded into their unions by their names again. A public class
defined under ``optaxaccum._src`` (an attribute typed
``optaxaccum._src.batch_stats.Window``) is named as users import it
(``optaxaccum.batchnorm.Window``), from the ``__all__`` of the modules the
API reference documents (``coverage_check_modules``).
"""

from __future__ import annotations

import importlib
import pathlib
import re

from docutils import nodes
from sphinx import addnodes

# An optional ``literal`` around docs/<name>.md, at a word boundary.
POINTER = re.compile(r"(?<![\w/])(``)?docs/([a-z_]+)\.md(``)?")
PRIVATE_ARRAY = re.compile(r"\b(jax\.)?jaxlib\._jax\.Array\b")


PRIVATE_NAME = re.compile(r"~?\boptaxaccum\._src(?:\.\w+)+")
# Filled when the builder starts: "optaxaccum._src.base.Emitted" ->
# "optaxaccum.Emitted", for every public name defined under _src.
PUBLIC_NAMES: dict[str, str] = {}


def public_names(modules: list[str]) -> dict[str, str]:
    """The public name of each object the ``modules`` export (``__all__``)
    by the private path it is defined at (``__module__.__qualname__``)."""
    names = {}
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            where = getattr(obj, "__module__", None)
            qualname = getattr(obj, "__qualname__", None)
            if where and qualname and where != module_name:
                names.setdefault(f"{where}.{qualname}", f"{module_name}.{name}")
    return names


def public(text: str, names: dict[str, str] | None = None) -> str:
    """``text`` with each ``optaxaccum._src...`` name that is public under
    another name written by that name."""
    names = PUBLIC_NAMES if names is None else names
    return PRIVATE_NAME.sub(
        lambda m: names.get(m.group().lstrip("~"), m.group()), text
    )


def link_pointers(line: str) -> str:
    """``line`` with every ``docs/<name>.md`` replaced by ``:doc:`/<name>```
    and the private array class by ``jax.Array``."""
    line = public(PRIVATE_ARRAY.sub("jax.Array", line))
    return POINTER.sub(lambda m: f":doc:`/{m.group(2)}`", line)


FORWARD_REF = re.compile(r"TypeAliasForwardRef\('([\w.]+)'\)")
# The unions that optax.OptState (chex.ArrayTree) and jax.typing.ArrayLike
# expand to, the longer first; a name may come qualified (``~numpy.bool``).
_Q = r"(?:~?[\w.]*\.)?"
_ARRAY_LIKE = (
    " \\| ".join(
        _Q + name
        for name in (
            "Array",
            "ndarray",
            "bool",
            "number",
            "bool",
            "int",
            "float",
        )
    )
    + r" \| complex"
)
EXPANDED = (
    (
        re.compile(
            _ARRAY_LIKE + rf" \| {_Q}Iterable\[ArrayTree\]"
            rf" \| {_Q}Mapping\[{_Q}Any, ArrayTree\]"
        ),
        "optax.OptState",
    ),
    (re.compile(_ARRAY_LIKE), "jax.typing.ArrayLike"),
    (re.compile(r"~?(jax\.)?jaxlib\._jax\.Array\b"), "jax.Array"),
)


def _process_signature(app, what, name, obj, options, signature, ret):
    del app, what, name, obj, options

    def named(text):
        if not text:
            return text
        for union, alias in EXPANDED:
            text = union.sub(alias, text)
        return public(FORWARD_REF.sub(r"\1", text))

    return named(signature), named(ret)


def _process_docstring(app, what, name, obj, options, lines) -> None:
    del app, what, name, obj, options
    lines[:] = [link_pointers(line) for line in lines]


def _builder_inited(app) -> None:
    PUBLIC_NAMES.clear()
    PUBLIC_NAMES.update(public_names(list(app.config.coverage_check_modules)))


def setup(app):
    app.connect("builder-inited", _builder_inited)
    app.connect("doctree-resolved", _link_files)
    # After napoleon (priority 500), which writes the attribute types.
    app.connect("autodoc-process-docstring", _process_docstring, priority=600)
    app.connect("autodoc-process-signature", _process_signature)
    return {"version": "1.0", "parallel_read_safe": True}


# -- repository files named on the pages -------------------------------------
# A file or folder of the repository named on a page (``examples/fsdp.py``,
# ``benchmarks/``, ``README.md``), in inline code or in prose, becomes a link:
# to its page where it is one of these docs' sources (``docs/scaling.md``),
# else to the file in the repository (``repository_url`` in conf.py, from
# pyproject.toml's [project.urls]). Names that are no file of the
# repository (``examples/<name>.py``) and code blocks are left as they are;
# inline code holding a command (``python examples/fsdp.py --tiny``) links
# to the file it names.
ROOT = pathlib.Path(__file__).resolve().parents[2]
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:examples|benchmarks|tests|tools|docs|optaxaccum|\.ci)/"
    r"(?:[\w.-]+/)*(?:[\w.-]*[\w/])?|README\.md|CHANGELOG\.md|Makefile"
    r"|pyproject\.toml|LICENSE)"
)


def repository_path(text: str) -> str | None:
    """``text`` if it names a file or folder of the repository."""
    text = text.strip()
    if not REPO_PATH.fullmatch(text) or ".." in text:
        return None
    return text if (ROOT / text).exists() else None


def _target(app, docname: str, path: str) -> str | None:
    """Where a link to the repository's ``path`` goes from ``docname``."""
    stem = path.removeprefix("docs/").removesuffix(".md")
    if path.startswith("docs/") and stem in app.env.found_docs:
        return app.builder.get_relative_uri(docname, stem)
    url = app.config.html_theme_options.get("repository_url", "")
    if not url:
        return None
    kind = "tree" if (ROOT / path).is_dir() else "blob"
    branch = app.config.html_theme_options.get("repository_branch", "main")
    return f"{url.rstrip('/')}/{kind}/{branch}/{path.rstrip('/')}"


def _skipped(node) -> bool:
    """Inside a link, a code block or raw markup: left alone."""
    parent = node.parent
    while parent is not None:
        if isinstance(
            parent,
            nodes.reference
            | nodes.literal_block
            | nodes.raw
            | nodes.title
            | addnodes.desc_signature
            | nodes.FixedTextElement,
        ):
            return True
        parent = parent.parent
    return False


def _link_files(app, doctree, docname) -> None:
    if app.builder.format != "html":
        return
    for node in list(doctree.findall(nodes.literal)):
        # The file itself, or a command that runs it (python examples/x.py).
        found = [
            repository_path(m.group(1))
            for m in REPO_PATH.finditer(node.astext())
        ]
        path = next((p for p in found if p), None)
        if path is None or _skipped(node):
            continue
        uri = _target(app, docname, path)
        if uri is not None:
            ref = nodes.reference("", "", internal=False, refuri=uri)
            node.replace_self(ref)
            ref += node
    for node in list(doctree.findall(nodes.Text)):
        parent = node.parent
        if isinstance(parent, nodes.literal) or _skipped(node):
            continue
        text = str(node)
        pieces, last = [], 0
        for m in REPO_PATH.finditer(text):
            path = repository_path(m.group(1).rstrip("."))
            uri = path and _target(app, docname, path)
            if not uri:
                continue
            pieces += [nodes.Text(text[last : m.start()])]
            pieces += [nodes.reference(path, path, refuri=uri)]
            last = m.start() + len(path)
        if pieces:
            pieces.append(nodes.Text(text[last:]))
            parent.replace(node, pieces)
