"""Trees of 1 000 leaves of mixed dtypes and shapes.

Real models are trees of hundreds to thousands of leaves. These tests run the
fused and the plain steps on such a tree against outside references (the
big-batch update, ``optax.MultiSteps``, ``optax.adaptive_grad_clip``), check
that one non-finite element anywhere in the tree is seen (the per-leaf
finiteness flags are combined in chunks), and that no compiled operation
grows with the number of leaves (a fusion with one operand per leaf made XLA's
compile time quadratic in the leaf count). The leaves are tiny and the
optimizers cheap to compile, so that each test takes a few seconds.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxaccum as oa
from optaxaccum._src import numerics
from tests import helpers
from tests import hlo_queries as hlo

N = 1000
K = 2
SHAPES = ((2, 3), (4,), (3, 2, 2), (), (5, 4), (1,), (3, 1))
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Where a non-finite element is put: both ends, both sides of the first
# boundary between two chunks of flags, and the middle.
NONFINITE_AT = (0, numerics.FAN_IN - 1, numerics.FAN_IN, N // 2, N - 1)
TOL = {jnp.float32: 1e-6, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


def _names():
    return [f"p{i:04d}" for i in range(N)]


def _poison(tree, index, value):
    """``tree`` with the first element of leaf ``index`` set to ``value``."""
    name = _names()[index]
    leaf = tree[name]
    return {**tree, name: leaf.reshape(-1).at[0].set(value).reshape(leaf.shape)}


def _assert_close(got, want):
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0],
        jax.tree.leaves(want),
        strict=True,
    ):
        assert g.dtype == w.dtype, path
        tol = TOL[g.dtype.type]
        np.testing.assert_allclose(
            np.asarray(g, np.float32),
            np.asarray(w, np.float32),
            rtol=tol,
            atol=tol,
            err_msg=jax.tree_util.keystr(path),
        )


def _fused(tx):
    return jax.jit(
        lambda p, s, g: oa.apply_gradients(tx, g, s, p), donate_argnums=(0, 1)
    )


def _plain(tx):
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(step, donate_argnums=(0, 1))


def test_fused_and_plain_match_the_big_batch_update():
    """Two windows of K micro-batches: the fused and the plain step agree
    with SGD with momentum on each window's mean gradient (and so the
    follower's momentum steps once per window, on every leaf)."""
    sgd = optax.sgd(0.1, momentum=0.9)
    grads = [
        helpers.cycled_tree(s, _names(), SHAPES, DTYPES)
        for s in range(1, 2 * K + 1)
    ]
    tx = oa.chain(oa.accumulate(K), sgd)
    results = {}
    for name, make in (("fused", _fused), ("plain", _plain)):
        step, p = make(tx), helpers.cycled_tree(0, _names(), SHAPES, DTYPES)
        s = tx.init(p)
        for g in grads:
            p, s = step(p, s, g)
        results[name] = p
    # Big-batch reference, in float64 numpy: one step of SGD with momentum
    # (optax.trace: t <- g + 0.9 t; p <- p - 0.1 t) per window, on the
    # window's mean gradient.
    p = {
        n: np.asarray(x, np.float64)
        for n, x in helpers.cycled_tree(0, _names(), SHAPES, DTYPES).items()
    }
    t = {n: np.zeros_like(x) for n, x in p.items()}
    for w in range(2):
        for n in p:
            mean = (
                sum(
                    np.asarray(g[n], np.float64)
                    for g in grads[w * K : (w + 1) * K]
                )
                / K
            )
            t[n] = mean + 0.9 * t[n]
            p[n] = p[n] - 0.1 * t[n]
    p = {n: jnp.asarray(x, results["fused"][n].dtype) for n, x in p.items()}
    for name, got in results.items():
        assert jax.tree.structure(got) == jax.tree.structure(p), name
        _assert_close(got, p)


@pytest.fixture(scope="module")
def loss_scaled():
    """A jitted fused step of a loss-scaled accumulation on the tree."""
    tx = oa.chain(oa.dynamic_loss_scale(16.0), oa.accumulate(K), optax.sgd(1.0))
    # Not donated: the checks feed the same params and state many times.
    step = jax.jit(lambda p, s, g: oa.apply_gradients(tx, g, s, p))
    return tx, step


@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_loss_scale_sees_one_nonfinite_element_anywhere(loss_scaled, value):
    """An Inf or NaN in any one leaf (either side of a chunk boundary of the
    combined flags) skips the micro-batch: accumulator and params untouched,
    scale halved. The clean micro-batch counts."""
    tx, step = loss_scaled
    clean, params = (
        helpers.cycled_tree(1, _names(), SHAPES, DTYPES, scale=16.0),
        helpers.cycled_tree(0, _names(), SHAPES, DTYPES),
    )
    state = tx.init(params)
    for index in NONFINITE_AT:
        p, s = step(params, state, _poison(clean, index, value))
        assert all(
            bool(jnp.all(a == b))
            for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params))
        ), index
        assert int(s[1].mini_step) == 0, index
        assert float(oa.loss_scale(s)) == 8.0, index
    p, s = step(params, state, clean)
    assert int(s[1].mini_step) == 1
    assert float(oa.loss_scale(s)) == 16.0
    _assert_close(
        s[1].acc,
        jax.tree.map(
            lambda g, a: (g.astype(jnp.float32) / 16).astype(a.dtype),
            clean,
            s[1].acc,
        ),
    )


def test_skip_nonfinite_sees_one_nonfinite_element_anywhere():
    tx = oa.accumulate(K, skip_nonfinite=True)
    update = tx.update  # eagerly: a compile of 1 000 leaves costs more
    state = tx.init(helpers.cycled_tree(0, _names(), SHAPES, DTYPES))
    for index in NONFINITE_AT:
        _, s = update(
            _poison(
                helpers.cycled_tree(1, _names(), SHAPES, DTYPES), index, np.nan
            ),
            state,
        )
        assert int(s.mini_step) == 0, index
    _, s = update(helpers.cycled_tree(1, _names(), SHAPES, DTYPES), state)
    assert int(s.mini_step) == 1


def _max_fusion_operands(text):
    """The largest number of operands of a fusion in optimized HLO text."""
    comps, _ = hlo.parse_hlo(text)
    most = 0
    for lines in comps.values():
        for line in lines:
            parsed = hlo.split_instruction(line)
            if parsed is None or parsed[1] != "fusion":
                continue
            args = line.split(" fusion(", 1)[1].split("), kind=", 1)[0]
            most = max(most, len(re.findall(r"%[\w.\-]+", args)))
    return most


def test_no_fusion_grows_with_the_number_of_leaves(loss_scaled):
    """Regression (compile time): the loss scale's per-leaf finiteness flags
    were stacked into one fusion with an operand per leaf, which XLA compiled
    in time quadratic in the leaf count (20 s at 1 000 leaves on CPU)."""
    tx, step = loss_scaled
    params = helpers.cycled_tree(0, _names(), SHAPES, DTYPES)
    compiled = step.lower(params, tx.init(params), params).compile()
    assert _max_fusion_operands(compiled.as_text()) <= 2 * numerics.FAN_IN


def test_agc_matches_optax_on_many_leaves():
    """oa.agc agrees with optax.adaptive_grad_clip leaf by leaf on the
    float32 2-D leaves without size-1 axes (where both choose the same
    units: one per output feature) and on the 1-D ones."""
    keep = [
        n
        for i, n in enumerate(_names())
        if DTYPES[i % len(DTYPES)] == jnp.float32
        and SHAPES[i % len(SHAPES)] in ((2, 3), (5, 4), (4,))
    ]
    params, grads = (
        helpers.cycled_tree(0, _names(), SHAPES, DTYPES),
        helpers.cycled_tree(1, _names(), SHAPES, DTYPES),
    )
    params, grads = ({n: t[n] for n in keep} for t in (params, grads))
    mine, ref = oa.agc(0.05), optax.adaptive_grad_clip(0.05)
    got = jax.jit(lambda g, p: mine.update(g, mine.init(p), p)[0])(
        grads, params
    )
    want = ref.update(grads, ref.init(params), params)[0]
    clipped = sum(bool(jnp.any(got[n] != grads[n])) for n in keep)
    assert clipped > len(keep) // 2  # the bound binds on most leaves
    _assert_close(got, want)
