"""Property-based tests of ``oa.accumulate`` against a plain NumPy reference:
random nested pytrees of mixed dtypes, random window lengths and weights."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

import optaxaccum as oa

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Relative tolerance of the emitted window result, by gradient dtype: the
# result is computed in float32 and rounded once to the gradient's dtype.
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}

shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
leaves = st.tuples(shapes, st.sampled_from(DTYPES))
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.dictionaries(
            st.sampled_from("abcd"), children, min_size=1, max_size=3
        ),
        st.lists(children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=2).map(tuple),
    ),
    max_leaves=5,
)


def _is_spec(x):
    return (
        isinstance(x, tuple)
        and len(x) == 2
        and isinstance(x[0], tuple)
        and not isinstance(x[1], (tuple, list, dict))
    )


def _make(spec, rng):
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s[0]), s[1]),
        spec,
        is_leaf=_is_spec,
    )


@settings(max_examples=30, deadline=None)
@given(
    spec=trees,
    k=st.integers(1, 4),
    weights=st.lists(
        st.one_of(st.just(0.0), st.floats(0.25, 4.0)), min_size=1, max_size=9
    ),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_accumulate_matches_numpy_reference(spec, k, weights, reduction, seed):
    rng = np.random.default_rng(seed)
    params = _make(spec, rng)
    tx = oa.chain(oa.accumulate(k, reduction=reduction), optax.identity())
    state = tx.init(params)
    update = jax.jit(tx.update)
    window = []  # (weight, grads as float64 numpy) of the open window
    for w in weights:
        g = _make(spec, rng)
        u, state = update(g, state, params, accum_weight=w)
        window.append((w, jax.tree.map(lambda x: np.asarray(x, np.float64), g)))
        closes = len(window) == k
        total = sum(wi for wi, _ in window)
        if closes and total != 0:
            want = jax.tree.map(
                lambda *gs: sum(wi * gi for (wi, _), gi in zip(window, gs)),
                *[gi for _, gi in window],
            )
            if reduction == "mean":
                want = jax.tree.map(lambda x: x / total, want)
        else:
            want = jax.tree.map(np.zeros_like, window[0][1])
        jax.tree.map(
            lambda got, ref: np.testing.assert_allclose(
                np.asarray(got, np.float64),
                ref,
                rtol=RTOL[got.dtype.type],
                atol=RTOL[got.dtype.type] * (1 + np.abs(ref).max(initial=0)),
            ),
            u,
            want,
        )
        jax.tree.map(
            lambda got, p: np.testing.assert_equal(got.dtype, p.dtype),
            u,
            params,
        )
        assert bool(oa.has_updated(state)) == (closes and total != 0)
        if closes:
            window = []
    assert int(state[0].mini_step) == len(window)
    assert int(state[0].gradient_step) == len(weights) // k
