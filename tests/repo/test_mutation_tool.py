"""The mutation tool (``tools/mutation.py``) works on a copy of the
repository: a mutant it applies is caught by the tests run in the copy, and
the checkout's own files are never written, not even written and restored."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "mutation.py"
# Needs the source tree (tools/ and the package's sources), as the
# benchmarks' own runs do: left out of the installed legs.
pytestmark = pytest.mark.bench_smoke


def _tool():
    spec = importlib.util.spec_from_file_location("_mutation_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _snapshot(folder):
    """Each source file under ``folder``: its bytes and its modification
    time (a file written and restored keeps its bytes, not its time)."""
    return {
        path: (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_a_mutant_is_killed_in_a_copy_and_the_source_tree_is_untouched():
    before = _snapshot(ROOT / "optaxaccum")
    proc = subprocess.run(
        [sys.executable, str(TOOL), "zero_not_nan_safe"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| zero_not_nan_safe | accumulate.py | killed |" in proc.stdout
    assert _snapshot(ROOT / "optaxaccum") == before


def test_an_unknown_mutant_is_refused():
    proc = subprocess.run(
        [sys.executable, str(TOOL), "no_such_mutant"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown mutants: no_such_mutant" in proc.stderr


def _fake_repository(root):
    src = root / "optaxaccum" / "_src"
    src.mkdir(parents=True)
    (src / "core.py").write_text("def f(x):\n    return x + 1\n")
    for skipped in (".venv", "build", "docs/_build", "optaxaccum/__pycache__"):
        (root / skipped).mkdir(parents=True, exist_ok=True)
        (root / skipped / "junk.txt").write_text("not copied")
    return root


def test_copy_leaves_out_environments_and_builds(tmp_path):
    tool = _tool()
    root = _fake_repository(tmp_path / "repo")
    copy = tool.copy_repository(root, tmp_path / "copy")
    copied = {p.relative_to(copy).as_posix() for p in copy.rglob("*.*")}
    assert copied == {"optaxaccum/_src/core.py"}


def test_copy_of_a_git_checkout_holds_its_unignored_files(tmp_path):
    tool = _tool()
    root = _fake_repository(tmp_path / "repo")
    (root / ".gitignore").write_text(".venv/\nbuild/\n_build/\n__pycache__/\n")
    (root / "notes.txt").write_text("untracked, not ignored")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=root, check=True)
    subprocess.run(
        [*git, "add", "optaxaccum", ".gitignore"], cwd=root, check=True
    )
    subprocess.run([*git, "commit", "-qm", "c"], cwd=root, check=True)
    copy = tool.copy_repository(root, tmp_path / "copy")
    copied = {
        p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()
    }
    assert copied == {".gitignore", "notes.txt", "optaxaccum/_src/core.py"}


def test_apply_writes_the_copy_only_and_refuses_stale_text(tmp_path):
    tool = _tool()
    root = _fake_repository(tmp_path / "repo")
    copy = tool.copy_repository(root, tmp_path / "copy")
    assert not tool.apply(copy, "core.py", "return x + 2", "return x")
    assert not tool.apply(copy, "missing.py", "return x + 1", "return x")
    assert tool.apply(copy, "core.py", "return x + 1", "return x")
    assert (copy / "optaxaccum/_src/core.py").read_text().endswith("return x\n")
    assert (root / "optaxaccum/_src/core.py").read_text().endswith("x + 1\n")
