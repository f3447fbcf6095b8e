"""The public surface, frozen: every name of ``optaxaccum.__all__``,
``optaxaccum.batchnorm.__all__``, ``optaxaccum.flax.__all__`` and
``optaxaccum.flax.nnx.__all__`` with its
signature (for a class: its constructor and the public methods it defines),
checked against ``tests/repo/api_snapshot.txt``.

A change of the surface fails here until the snapshot is regenerated, in the
same commit as its line in CHANGELOG.md's Unreleased section::

    python tests/repo/test_api_snapshot.py --update
    # or: OPTAXACCUM_UPDATE_SNAPSHOT=1 python -m pytest tests/repo/test_api_snapshot.py
"""

import difflib
import importlib
import inspect
import os
import pathlib
import re
import sys

import jax
import pytest

SNAPSHOT = pathlib.Path(__file__).with_name("api_snapshot.txt")
CORE = ("optaxaccum", "optaxaccum.batchnorm")
FLAX = ("optaxaccum.flax", "optaxaccum.flax.nnx")
# Under make test-floors, flax is at its floor, whose nn.BatchNorm and
# TrainState have other (inherited) fields, and under make test-newest at
# whatever pip resolves: only the core is compared against the installed
# wheel.
INSTALLED = os.environ.get("OPTAXACCUM_TEST_INSTALLED") in ("floors", "newest")
pytestmark = pytest.mark.installed
# How inspect prints jax.Array: jax.jaxlib._jax.Array on jax 0.10,
# jax.Array from jax 0.12 (its __qualname__ changed).
ARRAY_SPELLED = f"{jax.Array.__module__}.{jax.Array.__qualname__}"
HOW_TO_UPDATE = (
    "The public API changed. If that is intended, regenerate the snapshot "
    "with `python tests/repo/test_api_snapshot.py --update` and record the "
    "change under Unreleased in CHANGELOG.md, both in the same commit."
)


def _signature(obj) -> str:
    """``inspect.signature``'s text, without what varies from run to run
    (addresses), between Python versions (``ForwardRef``) or between jax
    versions (the module that ``jax.Array`` names itself by)."""
    if inspect.isclass(obj) and "__init__" in vars(obj):
        obj = obj.__init__  # e.g. nnx modules, whose metaclass hides it
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):  # builtins without one
        return "(...)"
    text = re.sub(r" at 0x[0-9a-f]+", "", text)
    text = re.sub(r"ForwardRef\(('[^']*')\)", r"\1", text)
    return text.replace(ARRAY_SPELLED, "jax.Array")


def _describe(name: str, obj) -> list[str]:
    """One line per name; a class also lists the public methods and
    properties it defines itself (and ``__call__`` of a protocol)."""
    if not inspect.isclass(obj):
        return [f"def {name}{_signature(obj)}"]
    lines = [f"class {name}{_signature(obj)}"]
    for attr, value in sorted(vars(obj).items()):
        if attr.startswith("_") and attr != "__call__":
            continue
        if isinstance(value, property):
            lines.append(f"    property {name}.{attr}")
        elif inspect.isfunction(getattr(value, "__func__", value)):
            fn = getattr(value, "__func__", value)
            lines.append(f"    def {name}.{attr}{_signature(fn)}")
    return lines


def surface(modules) -> str:
    """The snapshot text of ``modules``' public names."""
    lines = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        lines.append(f"## {module_name}")
        for name in sorted(module.__all__):
            lines.extend(_describe(name, getattr(module, name)))
    return "\n".join(lines) + "\n"


def _sections(text: str) -> dict[str, str]:
    out, name = {}, None
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            name = line[3:].strip()
            out[name] = ""
        if name is not None:
            out[name] += line
    return out


def _update() -> None:
    SNAPSHOT.write_text(surface(CORE + FLAX))
    print(f"wrote {SNAPSHOT}; now record the change in CHANGELOG.md")


def test_public_api_matches_the_snapshot():
    if os.environ.get("OPTAXACCUM_UPDATE_SNAPSHOT") == "1":
        _update()
    modules = CORE if INSTALLED else CORE + FLAX
    if not INSTALLED:
        pytest.importorskip("flax")
    want = _sections(SNAPSHOT.read_text())
    got = _sections(surface(modules))
    for module_name in modules:
        expected, actual = want.get(module_name, ""), got[module_name]
        if expected != actual:
            diff = "".join(
                difflib.unified_diff(
                    expected.splitlines(keepends=True),
                    actual.splitlines(keepends=True),
                    "tests/repo/api_snapshot.txt",
                    "the code",
                )
            )
            pytest.fail(f"{HOW_TO_UPDATE}\n{diff}", pytrace=False)


def test_snapshot_covers_every_public_name():
    """Every name of every ``__all__`` has a line in the snapshot."""
    text = SNAPSHOT.read_text()
    for module_name in CORE:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            assert f"def {name}(" in text or f"class {name}(" in text, (
                f"{module_name}.{name} is not in the snapshot. {HOW_TO_UPDATE}"
            )


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        _update()
    else:
        sys.exit("usage: python tests/repo/test_api_snapshot.py --update")
