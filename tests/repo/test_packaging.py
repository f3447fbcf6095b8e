"""Packaging: the version, the floors, the wheel and the sdist.

The checks on the built distributions read the ones ``make test``,
``make test-floors`` and ``make test-newest`` build (the folder in
``OPTAXACCUM_DIST``) and build their own otherwise. Under ``make
test-floors`` and ``make test-newest`` the suite runs from a copy of
``tests/`` against the wheel installed (not editable) in a fresh virtual
environment (``OPTAXACCUM_TEST_INSTALLED`` is ``floors`` or ``newest``),
with the floors of ``.ci/floors.txt`` or with the newest releases on the
newest Python the package declares; more checks run there: optaxaccum is
imported from site-packages, the installed versions are the floors, the
Python is the newest declared one. The module is marked ``installed``: the
floors leg runs it even where it runs only what depends on the install.
"""

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import optaxaccum as oa

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
FLOORS = ROOT / ".ci" / "floors.txt"
# Which leg runs the suite against the installed wheel: "floors" (make
# test-floors), "newest" (make test-newest), else none (make test).
LEG = os.environ.get("OPTAXACCUM_TEST_INSTALLED", "")
INSTALLED = LEG in ("floors", "newest")
# The four make test-floors pins: the runtime dependencies JAX users pick
# versions of (numpy follows jax's own floor).
PINNED = ("jax", "jaxlib", "optax", "flax")

# The whole module reads the install: every installed leg runs it.
pytestmark = pytest.mark.installed
only_installed = pytest.mark.skipif(
    not INSTALLED,
    reason="runs under make test-floors and make test-newest",
)
only_floors = pytest.mark.skipif(
    LEG != "floors", reason="runs under make test-floors"
)
only_newest = pytest.mark.skipif(
    LEG != "newest", reason="runs under make test-newest"
)


def _pyproject():
    return tomllib.loads(PYPROJECT.read_text())


def _declared_floors():
    """``{name: lower bound}`` of every requirement of pyproject's runtime
    dependencies and extras that has a ``>=`` bound."""
    project = _pyproject()["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs.extend(extra)
    floors = {}
    for req in map(Requirement, reqs):
        lows = [s.version for s in req.specifier if s.operator == ">="]
        if lows:
            assert len(lows) == 1, req
            assert floors.setdefault(req.name, lows[0]) == lows[0], req
    return floors


def _pinned_floors():
    """``{name: version}`` of the ``name==version`` lines of floors.txt."""
    pins = {}
    for line in FLOORS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name] = spec.version
    return pins


def test_floors_pinned_by_test_floors_are_the_declared_floors():
    """What make test-floors installs is what pyproject promises."""
    declared = _declared_floors()
    pins = _pinned_floors()
    assert sorted(pins) == sorted(PINNED)
    assert pins == {name: declared[name] for name in PINNED}
    assert pins["jax"] == pins["jaxlib"]


def _python_classifiers():
    """The ``(major, minor)`` versions of the Python classifiers, sorted."""
    found = []
    for c in _pyproject()["project"]["classifiers"]:
        m = re.fullmatch(r"Programming Language :: Python :: (\d+)\.(\d+)", c)
        if m:
            found.append((int(m[1]), int(m[2])))
    return sorted(found)


def test_python_classifiers_run_from_requires_python():
    """The Python classifiers name every minor version from the one
    requires-python starts at, one after the other, to the newest CI runs
    (make test-newest)."""
    project = _pyproject()["project"]
    (low,) = SpecifierSet(project["requires-python"])
    assert low.operator == ">=", low
    first = tuple(int(v) for v in low.version.split("."))
    versions = _python_classifiers()
    assert versions[0] == first, versions
    assert versions == [(3, m) for m in range(first[1], versions[-1][1] + 1)]
    assert versions[-1] >= (3, 13), versions


def test_version_has_one_source():
    """pyproject reads the version from ``optaxaccum.__version__``; the
    installed metadata and the changelog agree with it."""
    pyproject = _pyproject()
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "optaxaccum.__version__"}
    assert oa.__version__ == importlib.metadata.version("optaxaccum")
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert f"## [{oa.__version__}] - " in changelog


def _check_warnings_on_import(code):
    """Runs ``code`` in a fresh interpreter where every warning raises,
    except the DeprecationWarnings orbax and absl emit on import (filtered
    by name in pyproject's pytest settings too)."""
    prelude = (
        "import warnings\n"
        "warnings.simplefilter('error')\n"
        "for m in ('orbax', 'absl'):\n"
        "    warnings.filterwarnings('ignore', category=DeprecationWarning,"
        " module=m + '.*')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_emits_no_warning_and_leaves_flax_alone():
    """``import optaxaccum`` warns about nothing and does not import flax."""
    _check_warnings_on_import(
        "import sys, optaxaccum\n"
        "assert 'flax' not in sys.modules, 'optaxaccum imported flax'\n"
    )


def test_flax_integration_imports_without_warnings():
    _check_warnings_on_import("import optaxaccum.flax, optaxaccum.flax.nnx\n")


# ------------------------------------------------------------ distributions


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """``(wheel, sdist)`` paths of this version's built distributions."""
    given = os.environ.get("OPTAXACCUM_DIST")
    if given:
        folder = pathlib.Path(given)
    else:
        pytest.importorskip("build", reason="builds with the dev extra")
        folder = tmp_path_factory.mktemp("dist")
        subprocess.run(
            [sys.executable, "-m", "build", "--outdir", str(folder), ROOT],
            check=True,
            capture_output=True,
            timeout=600,
        )
    wheels = sorted(folder.glob(f"optaxaccum-{oa.__version__}-*.whl"))
    sdists = sorted(folder.glob(f"optaxaccum-{oa.__version__}.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(folder.iterdir())
    return wheels[0], sdists[0]


def _license_ok(text):
    """The full Apache-2.0 text: its 9 sections, the end of the terms and
    the appendix, not a one-line notice."""
    assert text.startswith("\n                                 Apache License")
    assert "Version 2.0, January 2004" in text
    for n, title in enumerate(
        (
            "Definitions",
            "Grant of Copyright License",
            "Grant of Patent License",
            "Redistribution",
            "Submission of Contributions",
            "Trademarks",
            "Disclaimer of Warranty",
            "Limitation of Liability",
            "Accepting Warranty or Additional Liability",
        ),
        start=1,
    ):
        assert f"{n}. {title}." in text, title
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    assert len(text.splitlines()) == 202


def test_license_file_is_the_apache_text():
    _license_ok((ROOT / "LICENSE").read_text())


def test_wheel_holds_the_package_typed_and_licensed_and_nothing_else(dists):
    wheel, _ = dists
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"optaxaccum-{oa.__version__}.dist-info"
        licence = zf.read(f"{info}/licenses/LICENSE").decode()
        metadata = zf.read(f"{info}/METADATA").decode()
    assert {n.split("/")[0] for n in names} == {"optaxaccum", info}, names
    assert "optaxaccum/py.typed" in names
    # Every module of the package the tests import, and no other file.
    package = pathlib.Path(oa.__file__).parent
    modules = {
        "optaxaccum/" + p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
    }
    assert {n for n in names if n.startswith("optaxaccum/")} == modules | {
        "optaxaccum/py.typed"
    }
    assert licence == (ROOT / "LICENSE").read_text()
    _license_ok(licence)
    head, _, description = metadata.partition("\n\n")
    assert f"\nVersion: {oa.__version__}\n" in head
    assert "\nLicense-Expression: Apache-2.0\n" in head
    assert "\nLicense-File: LICENSE\n" in head
    # The long description is README.md then CHANGELOG.md.
    assert description.startswith("# optaxaccum\n")
    assert f"## [{oa.__version__}] - " in description
    requires = [
        Requirement(line.removeprefix("Requires-Dist: "))
        for line in head.splitlines()
        if line.startswith("Requires-Dist: ")
    ]
    floors = _pinned_floors()
    for req in requires:
        if req.name in floors:
            assert f">={floors[req.name]}" in str(req.specifier), req


def test_sdist_holds_license_changelog_and_no_tests(dists):
    _, sdist = dists
    top = f"optaxaccum-{oa.__version__}"
    with tarfile.open(sdist) as tf:
        names = {n.removeprefix(top + "/") for n in tf.getnames()}
        licence = tf.extractfile(f"{top}/LICENSE")
        assert licence is not None
        licence = licence.read().decode()
    for name in (
        "LICENSE",
        "CHANGELOG.md",
        "README.md",
        "pyproject.toml",
        "optaxaccum/py.typed",
        "optaxaccum/__init__.py",
    ):
        assert name in names, name
    assert not [
        n
        for n in names
        if n.split("/")[0] in ("tests", "benchmarks", "docs", "tools")
    ]
    _license_ok(licence)


# ------------------------------------------------- under make test-floors


@only_installed
def test_optaxaccum_comes_from_site_packages():
    """The suite tests the installed wheel, not a source tree."""
    where = pathlib.Path(oa.__file__).resolve()
    site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
    assert where.is_relative_to(site), (where, site)
    assert not where.is_relative_to(ROOT), (where, ROOT)
    dist = importlib.metadata.distribution("optaxaccum")
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    assert not direct.get("dir_info", {}).get("editable"), direct
    assert direct.get("url", "").endswith(".whl"), direct


@only_floors
def test_installed_versions_are_the_floors():
    pins = _pinned_floors()
    got = {name: importlib.metadata.version(name) for name in pins}
    assert got == pins


@only_newest
def test_newest_leg_runs_the_newest_declared_python():
    """make test-newest runs on the newest Python the classifiers name."""
    assert sys.version_info[:2] == _python_classifiers()[-1]
