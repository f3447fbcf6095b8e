"""Writes the vendored Sphinx inventories of optax, JAX and Flax.

The site is built offline, so ``docs/conf.py``'s intersphinx reads these
files instead of downloading each project's ``objects.inv``. They are made
from each project's documentation sources (the API pages' ``autosummary``
lists, ``autoclass``/``autofunction`` and ``flax_module`` directives, which
fix the page and anchor of every object) and from the installed packages
(which say whether a name is a class, a function or a module):

    python docs/_inventories/make_inventories.py OPTAX_SRC JAX_SRC FLAX_SRC

with the three source checkouts (a clone of each project's repository at
the release the docs link to). The files hold the objects of each project's
API reference only: its guides are not linked.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))

# name: (documentation sources under the checkout, the site they build).
PROJECTS = {
    "optax": ("docs", "https://optax.readthedocs.io/en/latest/"),
    "jax": ("docs", "https://docs.jax.dev/en/latest/"),
    "flax": ("docs_nnx", "https://flax.readthedocs.io/en/latest/"),
}
DIRECTIVE = re.compile(
    r"^\.\. (?:auto(?:class|function|data|exception)|py:function|py:class)"
    r":: ([\w.]+)"
)


def _entries(rst: str, page: str) -> list[tuple[str, str]]:
    """``(full name, uri)`` of the objects one API page documents."""
    module, out, toctree, in_summary = "", [], None, False
    for line in rst.splitlines():
        if m := re.match(r"^\.\. (?:current|auto)?module:: ([\w.]+)", line):
            module = m.group(1)
        if line.startswith(".. autosummary::"):
            in_summary, toctree = True, None
            continue
        if in_summary:
            if m := re.match(r"^\s+:toctree:\s*(\S+)", line):
                toctree = m.group(1).rstrip("/")
            elif m := re.match(r"^\s+([A-Za-z_][\w.]*)\s*$", line):
                if toctree is not None:
                    full = f"{module}.{m.group(1)}" if module else m.group(1)
                    base = os.path.dirname(page)
                    path = os.path.join(base, toctree, f"{full}.html")
                    out.append((full, f"{path}#{full}"))
            elif line.strip() and not line.startswith((" ", "\t")):
                in_summary = False
        if m := DIRECTIVE.match(line):
            name = m.group(1)
            full = name if name.startswith(module) else f"{module}.{name}"
            out.append((full, f"{page}.html#{full}"))
        if m := re.match(r"^\s+:class: (\w+)", line):
            full = f"{module}.{m.group(1)}"
            out.append((full, f"{page}.html#{full}"))
    return out


_MISSING = object()


def _object(name: str):
    """The installed object ``name``, or ``_MISSING``."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 (any import failure: try shorter)
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return _MISSING
        return obj
    return _MISSING


def _role(name: str) -> str | None:
    """The Python domain role of ``name`` as installed, or None."""
    obj = _object(name)
    if obj is _MISSING:
        return None
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "class"
    return "function" if callable(obj) else "data"


def _aliases(name: str) -> list[str]:
    """Shorter public names of the same object (``optax.inject_hyperparams``
    for ``optax.schedules.inject_hyperparams``, ``flax.nnx.Optimizer`` for
    ``flax.nnx.optimizer.Optimizer``)."""
    parts = name.split(".")
    heads = [parts[0]] + (["flax.nnx"] if name.startswith("flax.nnx.") else [])
    obj = _object(name)
    out = []
    for head in heads:
        short = f"{head}.{parts[-1]}"
        if short != name and _object(short) is obj is not _MISSING:
            out.append(short)
    return out


def write(project: str, src: str) -> int:
    """Writes ``<project>.inv`` from the checkout ``src``; the object count."""
    docs, _ = PROJECTS[project]
    root = os.path.join(src, docs)
    seen: dict[str, tuple[str, str]] = {}
    for dirpath, _, files in os.walk(root):
        for file in sorted(files):
            if not file.endswith(".rst"):
                continue
            path = os.path.join(dirpath, file)
            page = os.path.relpath(path, root)[: -len(".rst")]
            with open(path) as f:
                for name, uri in _entries(f.read(), page):
                    role = _role(name)
                    if role and name not in seen:
                        seen[name] = (role, uri)
                        for short in _aliases(name):
                            seen.setdefault(short, (role, uri))
    version = importlib.import_module(project).__version__
    lines = [
        f"{name} py:{role} 1 {uri.replace('#' + name, '#$')} -"
        for name, (role, uri) in sorted(seen.items())
    ]
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n# Version: {version}\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    with open(os.path.join(HERE, f"{project}.inv"), "wb") as f:
        f.write(header.encode())
        f.write(zlib.compress(("\n".join(lines) + "\n").encode()))
    return len(lines)


if __name__ == "__main__":
    for project, src in zip(PROJECTS, sys.argv[1:4], strict=True):
        print(project, write(project, src), "objects")
