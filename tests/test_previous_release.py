"""States saved by the previous release resume with this version.

The fixtures (tests/fixtures/previous_release/, written by its make.py with
the previous release's code, commit 94736f9) hold that release's states at
a window's end and mid-window, for an ``oa.chain``, nested chains and
``oa.MultiSteps``, pickled and as one orbax checkpoint, and that release's
own continuation of each: the updates and params of an uninterrupted run.
Here this version resumes them (a pickle as it loads; the checkpoint
restored with the recipe of docs/migration.md, "Upgrading mid-training")
under ``jax.jit``, and must reach the same updates and params up to float
rounding.
"""

from __future__ import annotations

import doctest
import functools
import importlib.util
import pathlib
import pickle
import re

import jax
import numpy as np
import optax
import pytest

import optaxaccum as oa

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "previous_release"
TOL = dict(rtol=1e-6, atol=1e-7)  # float rounding (references: float32)


def _load_cases():
    spec = importlib.util.spec_from_file_location(
        "previous_release_cases", FIXTURES / "cases.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cases = _load_cases()
with open(FIXTURES / "states.pkl", "rb") as _f:
    SAVED = pickle.load(_f)  # loads into this version's state classes
KEYS = sorted(SAVED)
MID = [k for k in KEYS if k.endswith("/mid")]


@functools.cache
def _tx(key):
    return cases.CASES[key.split("/")[0]][0]()


@functools.cache
def _jitted(key, fused):
    """The case's jitted step, shared by the tests (compiled once)."""
    tx = _tx(key)
    if fused:
        return jax.jit(lambda p, s, g: oa.apply_gradients(tx, g, s, p))
    return jax.jit(tx.update)


def _recipe():
    """``previous_layout`` as docs/migration.md defines it (its doctest)."""
    text = (ROOT / "docs" / "migration.md").read_text()
    section = text.split("## Upgrading mid-training", 1)[1]
    for example in doctest.DocTestParser().get_examples(section):
        if example.source.startswith("def previous_layout("):
            namespace = {"jax": jax, "oa": oa}
            exec(example.source, namespace)
            return namespace["previous_layout"]
    raise AssertionError("docs/migration.md defines no previous_layout")


previous_layout = _recipe()


def _resume(key, state, params, grads, fused):
    """The fixture's micro-steps, jitted, from ``state``; the updates of
    each (the plain protocol) and the params after them."""
    if fused:
        step = _jitted(key, True)
        for g in grads:
            params, state = step(params, state, g)
        return None, params, state
    update = _jitted(key, False)
    updates = []
    for g in grads:
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
        updates.append(u)
    return updates, params, state


def _check_resumes(key, state, fused=False):
    saved, tx = SAVED[key], _tx(key)
    updates, params, state = _resume(
        key, state, saved["params"], saved["grads"], fused
    )
    if updates is not None:
        for i, (got, want) in enumerate(zip(updates, saved["updates"])):
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(g, w, **TOL, err_msg=f"step {i}")
    for g, w in zip(
        jax.tree.leaves(params), jax.tree.leaves(saved["final_params"])
    ):
        np.testing.assert_allclose(g, w, **TOL)
    # Converted: the state now has this version's layout (and saves so).
    assert jax.tree.structure(state) == jax.tree.structure(
        tx.init(saved["params"])
    )


def test_the_fixtures_are_the_previous_layout():
    # Unpickled into this version's classes, the new fields are absent.
    old = SAVED["nested/mid"]["state"]
    assert old[0].weight_low is None and old[1].weight_low is None
    assert SAVED["multisteps/end"]["state"].acc_weight_low is None
    # At a window's end the previous release kept the last window's sums.
    # (mid: the inner window has just closed, the outer one is half full).
    assert (int(old[0].mini_step), int(old[1].mini_step)) == (0, 1)
    assert np.all(np.asarray(old[0].acc["w"]) != 0)


@pytest.mark.parametrize("key", KEYS)
def test_pickled_state_resumes_under_jit(key):
    _check_resumes(key, SAVED[key]["state"])


@pytest.mark.parametrize("key", ["chain/end", "nested/mid", "multisteps/mid"])
def test_pickled_state_resumes_with_the_fused_step(key):
    _check_resumes(key, SAVED[key]["state"], fused=True)


@pytest.mark.parametrize("key", MID)
@pytest.mark.parametrize("jit", [False, True])
def test_pickled_state_flushes(key, jit):
    saved, tx = SAVED[key], _tx(key)

    def flush(state, params):
        return oa.flush(tx, state, params)

    fn = jax.jit(flush) if jit else flush
    updates, state = fn(saved["state"], saved["params"])
    for g, w in zip(jax.tree.leaves(updates), jax.tree.leaves(saved["flush"])):
        np.testing.assert_allclose(g, w, **TOL)
    assert jax.tree.structure(state) == jax.tree.structure(
        tx.init(saved["params"])
    )


def test_previous_layout_is_the_previous_tree_structure():
    for key in KEYS:
        saved = SAVED[key]
        target = previous_layout(_tx(key).init(saved["params"]))
        assert jax.tree.structure(target) == jax.tree.structure(
            saved["state"]
        ), key


@pytest.fixture(scope="module")
def restored():
    """The orbax checkpoint, restored as docs/migration.md says."""
    ocp = pytest.importorskip("orbax.checkpoint")
    target = {
        key: previous_layout(_tx(key).init(SAVED[key]["params"]))
        for key in KEYS
    }
    return ocp.PyTreeCheckpointer().restore(
        FIXTURES / "orbax",
        args=ocp.args.PyTreeRestore(item=target, partial_restore=True),
    )


@pytest.mark.parametrize("key", KEYS)
def test_orbax_checkpoint_restores_and_resumes_under_jit(restored, key):
    state = restored[key]
    want = SAVED[key]["state"]
    assert jax.tree.structure(state) == jax.tree.structure(want)
    for got, w in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        np.testing.assert_array_equal(got, w)
    _check_resumes(key, state)


def test_orbax_restore_into_the_new_layout_goes_wrong():
    # What docs/migration.md warns of: restored into tx.init's target with
    # orbax's partial_restore, the state passes for this version's and the
    # previous release's leftover sums enter the next window.
    ocp = pytest.importorskip("orbax.checkpoint")
    key = "chain/end"
    saved = SAVED[key]
    target = {k: _tx(k).init(SAVED[k]["params"]) for k in KEYS}
    state = ocp.PyTreeCheckpointer().restore(
        FIXTURES / "orbax",
        args=ocp.args.PyTreeRestore(item=target, partial_restore=True),
    )[key]
    _, params, _ = _resume(key, state, saved["params"], saved["grads"], False)
    gap = max(
        float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
        for g, w in zip(
            jax.tree.leaves(params), jax.tree.leaves(saved["final_params"])
        )
    )
    assert gap > 1e-3


def test_make_script_names_the_previous_release():
    # The fixtures are regenerated from that commit (see make.py's top).
    text = (FIXTURES / "make.py").read_text()
    assert re.search(r"git worktree add \S+ 94736f9", text)
