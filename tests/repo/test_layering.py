"""The package's layering, read from its source.

* The modules of ``optaxaccum/`` import each other without a circle, lazy
  imports inside functions included.
* The combinator (``chain.py``) imports no gate module; the public
  ``collective_census`` calls no private function of ``hlo.py``.
* The size rule of the style guide (``shared/tools/function_sizes.py``): a
  function has at most 60 lines of logic (docstring and nested definitions
  excluded), and a function's or a class's docstring at most 45 lines.
"""

import ast
import pathlib

import pytest

import optaxaccum

PACKAGE = pathlib.Path(optaxaccum.__file__).resolve().parent
MAX_LOGIC_LINES = 60
MAX_DOCSTRING_LINES = 45


def _modules() -> dict[str, pathlib.Path]:
    """``{dotted name: path}`` of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package up
                up = package.split(".")[
                    : len(package.split(".")) - node.level + 1
                ]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {n: _imports(n, p, modules) for n, p in modules.items()}


def test_no_import_circle_inside_the_package():
    graph = _graph()
    state: dict[str, str] = {}  # "open" while on the path, then "done"

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circle = path[path.index(nxt) :] + [nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_combinator_imports_no_gate_module():
    gates = {
        f"optaxaccum._src.{m}"
        for m in (
            "accumulate",
            "loss_scale",
            "multisteps",
            "noise_scale",
            "shard_update",
        )
    }
    imported = _graph()["optaxaccum._src.chain"]
    assert not imported & gates, imported & gates


def test_the_protocol_module_imports_only_the_helper_rooms():
    rooms = {"checks", "flags", "keywords", "numerics"}
    allowed = {f"optaxaccum._src.{r}" for r in rooms}
    assert _graph()["optaxaccum._src.base"] <= allowed


def test_collective_census_calls_no_private_hlo_function():
    tree = ast.parse((PACKAGE / "_src" / "collectives.py").read_text())
    private = [
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "hlo"
        and n.attr.startswith("_")
    ]
    assert not private, private


def _sizes():
    """``(where, logic lines, docstring lines)`` of every function and
    class of the package, counted as ``shared/tools/function_sizes.py``."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                continue
            where = (
                f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
            )
            body = node.body
            doc = 0
            if ast.get_docstring(node, clean=False) is not None:
                doc = body[0].end_lineno - body[0].lineno + 1
            if isinstance(node, ast.ClassDef):
                yield where, 0, doc
                continue
            nested = sum(
                n.end_lineno - n.lineno + 1
                for n in body
                if isinstance(
                    n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
                )
            )
            total = node.end_lineno - node.lineno + 1
            yield where, total - doc - nested, doc


def test_functions_and_docstrings_stay_within_the_size_rule():
    too_long = [
        f"{where}: {logic} lines of logic, docstring {doc} lines"
        for where, logic, doc in _sizes()
        if logic > MAX_LOGIC_LINES or doc > MAX_DOCSTRING_LINES
    ]
    assert not too_long, "\n".join(too_long)


def test_the_size_rule_sees_class_docstrings():
    """The rule measures class docstrings too (the linen AccumBatchNorm's
    once ran to 72 lines)."""
    docs = {where.rsplit(" ", 1)[1]: doc for where, _, doc in _sizes()}
    assert docs["AccumulateState"] > 5


def test_the_gate_protocol_holds_at_most_seven_public_fields():
    """``GateContext``, ``GateResult`` and ``Emitted`` hold what
    docs/gates.md teaches and nothing more (the window bookkeeping between
    accumulate and the chain is private), counted in the API snapshot."""
    snapshot = pathlib.Path(__file__).with_name("api_snapshot.txt")
    fields = {}
    for line in snapshot.read_text().splitlines():
        for name in ("GateContext", "GateResult", "Emitted"):
            if line.startswith(f"class {name}("):
                inside = line[len(f"class {name}(") : line.rindex(")")]
                fields[name] = [
                    part.split(":")[0].strip() for part in _split_params(inside)
                ]
    assert set(fields) == {"GateContext", "GateResult", "Emitted"}, fields
    assert sum(map(len, fields.values())) <= 7, fields
    assert fields["Emitted"] == ["updates", "state"], fields


def _split_params(params: str) -> list[str]:
    """The top-level comma-separated parts of a signature's parameters."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(params):
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(params[start:i])
            start = i + 1
    return parts + [params[start:]]


_WITHOUT_FLAX = """
import importlib.abc, sys

class _NoFlax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "flax" or name.startswith("flax."):
            raise ImportError(f"flax is blocked ({name})")
        return None

sys.meta_path.insert(0, _NoFlax())
import optaxaccum.batchnorm  # the public module, and the private one under it
import optaxaccum._src.windows
assert not any(m == "flax" or m.startswith("flax.") for m in sys.modules)
try:
    import optaxaccum.flax
except ImportError:
    pass
else:
    raise AssertionError("the flax blocker let flax through")
"""


def test_the_batch_stats_module_imports_without_flax():
    """The BatchNorm window helpers are plain JAX: importable with flax
    unavailable, so that any framework can use them (an Equinox layer in
    examples/equinox_batchnorm.py does)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE.parent), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_FLAX],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


def _private_uses_of(module: str, tree: ast.AST) -> list[str]:
    """The private (underscore) names of ``module`` that ``tree`` imports
    or reads through an alias of the module."""
    parent, _, leaf = module.rpartition(".")
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == module)
        elif isinstance(node, ast.ImportFrom) and node.module == parent:
            aliases.update(
                a.asname or leaf for a in node.names if a.name == leaf
            )
        elif isinstance(node, ast.ImportFrom) and node.module == module:
            found += [a.name for a in node.names if a.name.startswith("_")]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_flax_layer_uses_no_private_function_of_the_chain():
    """``optaxaccum.flax`` steps through the public ``oa.apply_gradients``
    (``return_updates=True`` for the nnx Optimizer) and ``oa.flush``: a
    framework layer needs nothing private of the combinator."""
    for path in sorted((PACKAGE / "flax").glob("*.py")):
        tree = ast.parse(path.read_text())
        used = _private_uses_of("optaxaccum._src.chain", tree)
        assert not used, f"{path.name} uses {used}"


def test_the_private_use_finder_sees_an_alias():
    """The check above finds ``chain_lib._fused_step`` (no vacuous pass)."""
    tree = ast.parse(
        "from optaxaccum._src import chain as chain_lib\n"
        "chain_lib._fused_step()\n"
        "from optaxaccum._src.chain import _apply\n"
    )
    used = _private_uses_of("optaxaccum._src.chain", tree)
    assert used == ["_apply", "chain_lib._fused_step"]


def test_the_window_sums_have_one_home_per_mesh_mode():
    """How the window sums are stored between steps and reduced over the
    devices lives in ``reducer.py`` alone (one reducer per mesh mode);
    ``noise_scale.py`` is arithmetic on the sums its reducer hands it: it
    imports neither ``reducer.py`` nor the mesh helpers of ``sharding.py``,
    and ``sharding.py`` keeps the user-facing mesh API."""
    storage = {
        "stack_partials",
        "unstack_partials",
        "window_zeros",
        "reduce_window",
        "reduce_scatter",
        "stacked_axes",
    }
    homes = {
        (path.name, node.name)
        for path in sorted((PACKAGE / "_src").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name in storage
    }
    assert {home for home, _ in homes} == {"reducer.py"}, homes
    imported = _graph()["optaxaccum._src.noise_scale"]
    helpers = {"optaxaccum._src.reducer", "optaxaccum._src.sharding"}
    assert not imported & helpers, imported & helpers


# ------------------------------------------------- the gate's inner workings

GATING = "optaxaccum._src.gating"
RECORDS = {"Decision", "Emission", "Followers"}
# The gates that build decisions with the window bookkeeping.
GATES = {"accumulate", "multisteps", "shard_update"}


def _uses_of(module: str, names: set[str], tree: ast.AST) -> list[str]:
    """The names among ``names`` of ``module`` that ``tree`` imports, or
    reads through an alias of the module."""
    parent, _, leaf = module.rpartition(".")
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(
                a.asname or a.name for a in node.names if a.name == module
            )
        elif isinstance(node, ast.ImportFrom) and node.module == parent:
            aliases.update(
                a.asname or leaf for a in node.names if a.name == leaf
            )
        elif isinstance(node, ast.ImportFrom) and node.module == module:
            found += [a.name for a in node.names if a.name in names]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr in names
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_only_the_gating_module_and_the_gates_use_the_internal_records():
    """A decision, an emission and the follower hook (``gating.py``) are
    built and read by ``gating.py`` and the gates alone; the combinator
    (``chain.py``) composes them through ``gating``'s rules, and no other
    module (the flax layer, the loss scale, the protocol) names them."""
    users = {}
    for name, path in _modules().items():
        used = _uses_of(GATING, RECORDS, ast.parse(path.read_text()))
        if used and name != GATING:
            users[name.rpartition(".")[2]] = used
    assert set(users) <= GATES, users
    assert set(users) == GATES  # the scan sees them (no vacuous pass)


def test_the_record_finder_sees_an_import_and_an_alias():
    """The scan above finds ``from ... import Decision`` and
    ``g.Emission`` (no vacuous pass)."""
    tree = ast.parse(
        "from optaxaccum._src import gating as g\n"
        "g.Emission(1, 2)\n"
        "from optaxaccum._src.gating import Decision, is_gate\n"
    )
    assert _uses_of(GATING, RECORDS, tree) == ["Decision", "g.Emission"]


def test_the_protocol_module_holds_the_public_vocabulary_only():
    """``base.py`` is optax's ``base.py`` in shape: the protocol's public
    types and the follower keyword, nothing private (the records and the
    rules that compose gates live in ``gating.py``)."""
    tree = ast.parse((PACKAGE / "_src" / "base.py").read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(
                t.id for t in node.targets if isinstance(t, ast.Name)
            )
    public = {
        "Emitted",
        "GateContext",
        "GateFlushFn",
        "GateResult",
        "GateUpdateFn",
        "WINDOW_NOISE_ARG",
    }
    assert defined == public, defined ^ public


def test_the_combinator_defines_no_composition_rule():
    """``chain.py`` keeps what optax's ``_combining.py`` holds (``chain``,
    its init and flush, the checks, ``apply_gradients``); the rules that
    compose one gate with what follows it are ``gating.py``'s."""
    tree = ast.parse((PACKAGE / "_src" / "chain.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    rules = {
        n.name
        for n in ast.parse((PACKAGE / "_src" / "gating.py").read_text()).body
        if isinstance(n, ast.FunctionDef)
    }
    assert {"followed_by", "then_plain", "then_gate"} <= rules, rules
    assert not defined & rules, defined & rules
    old = {"_follow", "_passed_on", "_shut", "_emit_into", "_follow_eager"}
    assert not defined & old, defined & old


REPO = pathlib.Path(__file__).resolve().parents[2]


def _repo_imports(folder: str) -> dict[str, set[str]]:
    """``{file: top-level names it imports}`` of the Python files under a
    folder of the repository (absolute imports, lazy ones included), with
    ``sys.path:<folder>`` for each ``sys.path.insert`` of a repository
    folder."""
    out = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.add((node.module or "").split(".")[0])
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "insert"
                and "sys.path" in ast.unparse(node.func.value)
            ):
                text = ast.unparse(node)
                found.update(
                    f"sys.path:{f}"
                    for f in ("benchmarks", "tests")
                    if f"'{f}'" in text or f'"{f}"' in text
                )
        out[str(path.relative_to(REPO))] = found
    return out


def test_the_benchmarks_import_no_test_module():
    """``benchmarks/`` and ``tests/`` share what both need through
    ``tools/``; a benchmark imports nothing from ``tests/``."""
    bad = {
        f: names & {"tests", "sys.path:tests"}
        for f, names in _repo_imports("benchmarks").items()
        if names & {"tests", "sys.path:tests"}
    }
    assert not bad, bad


def test_the_tests_import_no_benchmark_module():
    """A test imports no module of ``benchmarks/`` and puts no folder of it
    on ``sys.path`` (running a benchmark script in a process of its own is
    no import)."""
    names = {p.stem for p in (REPO / "benchmarks").glob("*.py")}
    names |= {"benchmarks", "sys.path:benchmarks"}
    bad = {
        f: found & names
        for f, found in _repo_imports("tests").items()
        if found & names
    }
    assert not bad, bad
