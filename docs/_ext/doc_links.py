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
carries expanded into their unions by their names again.
"""

from __future__ import annotations

import re

# An optional ``literal`` around docs/<name>.md, at a word boundary.
POINTER = re.compile(r"(?<![\w/])(``)?docs/([a-z_]+)\.md(``)?")
PRIVATE_ARRAY = re.compile(r"\b(jax\.)?jaxlib\._jax\.Array\b")


def link_pointers(line: str) -> str:
    """``line`` with every ``docs/<name>.md`` replaced by ``:doc:`/<name>```
    and the private array class by ``jax.Array``."""
    line = PRIVATE_ARRAY.sub("jax.Array", line)
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
        return FORWARD_REF.sub(r"\1", text)

    return named(signature), named(ret)


def _process_docstring(app, what, name, obj, options, lines) -> None:
    del app, what, name, obj, options
    lines[:] = [link_pointers(line) for line in lines]


def setup(app):
    # After napoleon (priority 500), which writes the attribute types.
    app.connect("autodoc-process-docstring", _process_docstring, priority=600)
    app.connect("autodoc-process-signature", _process_signature)
    return {"version": "1.0", "parallel_read_safe": True}
