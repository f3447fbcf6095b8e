"""The contract battery every public transformation of optaxaccum goes through.

A new transformation joins by adding one entry to ``TRANSFORMS``: a factory,
and (for gates) a function turning ordinary gradients into gradients on which
the gate stays closed on the first call. Transformations that need extra
arguments on every call (optax's linesearches: ``value``, ``grad``,
``value_fn``) also have an entry in ``EXTRA_ARGS``.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optaxaccum as oa
from tests import helpers


def _inf(grads):
    return jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), grads)


def _same(grads):
    return grads


# name -> (factory, grads on which the gate stays closed, or None if no gate)
TRANSFORMS = {
    "accumulate": (lambda: oa.accumulate(3), _same),
    "accumulate_sum_skip": (
        lambda: oa.accumulate(2, reduction="sum", skip_nonfinite=True),
        _inf,
    ),
    "chain_accumulate_adam": (
        lambda: oa.chain(oa.accumulate(2), optax.adam(1e-2)),
        _same,
    ),
    "agc": (lambda: oa.agc(0.01), None),
    "dynamic_loss_scale": (
        lambda: oa.dynamic_loss_scale(2.0**4, period=2),
        _inf,
    ),
    "static_loss_scale": (lambda: oa.static_loss_scale(8.0), None),
    "full_chain": (
        lambda: oa.chain(
            oa.dynamic_loss_scale(2.0**4, period=2),
            oa.agc(0.05),
            oa.accumulate(2),
            optax.adamw(1e-2, weight_decay=1e-3),
        ),
        _inf,
    ),
    "accumulate_noise_scale": (
        lambda: oa.chain(
            oa.accumulate(2, skip_nonfinite=True, noise_scale_decay=0.9),
            optax.adam(1e-2),
        ),
        _inf,
    ),
    # Nested chains (API.md 1, 2): they must step as one accumulate(4)
    # would, windows of weight 0 included (PADDED below).
    "nested_chain_accumulates": (
        lambda: oa.chain(
            oa.chain(oa.accumulate(2), optax.identity()),
            oa.accumulate(2),
            optax.adam(1e-2),
        ),
        _same,
    ),
    "chain_of_gated_chains": (
        lambda: oa.chain(
            oa.chain(oa.accumulate(2), optax.identity()),
            oa.chain(oa.accumulate(2), optax.adam(1e-2)),
        ),
        _same,
    ),
    "nested_chain_behind_loss_scale": (
        lambda: oa.chain(
            oa.dynamic_loss_scale(2.0**4, period=2),
            oa.chain(oa.accumulate(2), optax.identity()),
            oa.accumulate(2),
            optax.adam(1e-2),
        ),
        _inf,
    ),
    "multisteps_adam": (lambda: oa.MultiSteps(optax.adam(1e-2), 2), _same),
    "multisteps_skip_not_finite": (
        lambda: oa.MultiSteps(
            optax.sgd(0.1), 2, should_skip_update_fn=optax.skip_not_finite
        ),
        _inf,
    ),
    # optax's linesearches hand unknown keywords to value_fn.
    "chain_accumulate_lbfgs": (
        lambda: oa.chain(oa.accumulate(2), optax.lbfgs()),
        _same,
    ),
    "multisteps_backtracking_linesearch": (
        lambda: oa.MultiSteps(
            optax.chain(
                optax.sgd(1.0), optax.scale_by_backtracking_linesearch(15)
            ),
            2,
        ),
        _same,
    ),
}
NAMES = list(TRANSFORMS)

# name -> the flat chain it must equal, call by call, with padding windows
# (micro-batches of weight 0 with 0/0 gradients; windows of weight 0).
PADDED = {
    "nested_chain_accumulates": lambda: oa.chain(
        oa.accumulate(4), optax.adam(1e-2)
    ),
    "chain_of_gated_chains": lambda: oa.chain(
        oa.accumulate(4), optax.adam(1e-2)
    ),
    "nested_chain_behind_loss_scale": lambda: oa.chain(
        oa.dynamic_loss_scale(2.0**4, period=2),
        oa.accumulate(4),
        optax.adam(1e-2),
    ),
}
PADDED_WEIGHTS = (0, 0, 1, 1, 1, 1, 1, 1, 2, 0, 0, 3, 0, 0, 0, 0, 1, 0, 0, 1)


def _value_fn(params):
    return sum(
        jnp.sum(jnp.square(p.astype(jnp.float32)))
        for p in jax.tree.leaves(params)
    )


def _linesearch_args(params):
    value, grad = jax.value_and_grad(_value_fn)(params)
    grad = jax.tree.map(lambda g, p: g.astype(p.dtype), grad, params)
    return {"value": value, "grad": grad, "value_fn": _value_fn}


# name -> params -> the extra arguments of every call
EXTRA_ARGS = {
    "chain_accumulate_lbfgs": _linesearch_args,
    "multisteps_backtracking_linesearch": _linesearch_args,
}


def _update_fn(name, tx):
    """``tx.update`` with the extra arguments the transformation needs."""
    extra = EXTRA_ARGS.get(name, lambda params: {})

    def update(g, s, p):
        return tx.update(g, s, p, **extra(p))

    return update


# The parameters every contract runs on (helpers.normal_tree, seed 0): a
# dense layer, a convolution's kernel and a scalar.
SHAPES = {
    "dense": {"kernel": (4, 3), "bias": (3,)},
    "conv1d": (3, 2, 5),
    "scalar": (),
}


@pytest.mark.parametrize("name", NAMES)
def test_contract_jit_matches_eager(name):
    tx = TRANSFORMS[name][0]()
    params = helpers.normal_tree(0, SHAPES, jnp.float32)
    s_eager = s_jit = tx.init(params)
    eager = _update_fn(name, tx)
    update = jax.jit(eager)
    for i in range(4):
        g = helpers.normal_like(params, i)
        u_eager, s_eager = eager(g, s_eager, params)
        u_jit, s_jit = update(g, s_jit, params)
        chex.assert_trees_all_close(u_eager, u_jit, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(s_eager, s_jit, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_contract_no_retrace(name):
    chex.clear_trace_counter()  # the counter is shared by parametrized cases
    tx = TRANSFORMS[name][0]()
    params = helpers.normal_tree(0, SHAPES, jnp.float32)
    state = tx.init(params)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def update(g, s, p):
        return _update_fn(name, tx)(g, s, p)

    for i in range(5):  # covers closing and non-closing calls
        _, state = update(helpers.normal_like(params, i), state, params)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_contract_dtypes_and_state_stable(name, dtype):
    """Updates keep the gradients' dtype; the state keeps its structure,
    shapes and dtypes across update."""
    tx = TRANSFORMS[name][0]()
    params = helpers.normal_tree(0, SHAPES, dtype)
    state0 = tx.init(params)
    state = state0
    update = jax.jit(_update_fn(name, tx))
    for i in range(3):
        u, state = update(helpers.normal_like(params, i), state, params)
        chex.assert_trees_all_equal_dtypes(u, params)
        chex.assert_trees_all_equal_shapes(u, params)
        chex.assert_trees_all_equal_structs(state, state0)
        chex.assert_trees_all_equal_shapes_and_dtypes(state, state0)


@pytest.mark.parametrize("name", [n for n in NAMES if TRANSFORMS[n][1]])
def test_contract_closed_gate_leaves_followers_untouched(name):
    factory, closing = TRANSFORMS[name]
    tx = oa.chain(factory(), optax.adam(1e-2))
    params = helpers.normal_tree(0, SHAPES, jnp.float32)
    state = tx.init(params)
    update = jax.jit(_update_fn(name, tx))
    u, new_state = update(
        closing(helpers.normal_like(params, 0)), state, params
    )
    chex.assert_trees_all_equal(new_state[1], state[1])
    chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, params))


@pytest.mark.parametrize("name", NAMES)
def test_contract_fused_step_equals_plain_protocol(name):
    tx = TRANSFORMS[name][0]()
    params = helpers.normal_tree(0, SHAPES, jnp.float32)
    s_plain = s_fused = tx.init(params)
    p_plain = p_fused = params
    extra = EXTRA_ARGS.get(name, lambda params: {})
    fused = jax.jit(lambda p, s, g: oa.apply_gradients(tx, g, s, p, **extra(p)))
    plain = jax.jit(_update_fn(name, tx))
    for i in range(4):
        g = helpers.normal_like(params, i)
        p_fused, s_fused = fused(p_fused, s_fused, g)
        u, s_plain = plain(g, s_plain, p_plain)
        p_plain = optax.apply_updates(p_plain, u)
    chex.assert_trees_all_close(p_fused, p_plain, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(s_fused, s_plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_contract_state_is_a_pytree_of_arrays(name):
    """The state flattens to arrays only and round-trips through
    flatten/unflatten (checkpointing, pmap)."""
    tx = TRANSFORMS[name][0]()
    state = tx.init(helpers.normal_tree(0, SHAPES, jnp.float32))
    leaves, treedef = jax.tree.flatten(state)
    assert all(isinstance(x, jax.Array) for x in leaves)
    chex.assert_trees_all_equal(jax.tree.unflatten(treedef, leaves), state)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.devices(8)
def test_contract_state_shardings_and_device_put(name):
    """oa.state_shardings gives a tree of shardings that jax.device_put
    takes with the state of tx.init: the values unchanged, a params-like
    leaf at its param's sharding."""
    mesh, params = helpers.fsdp_mesh_params(SHAPES)
    tx = TRANSFORMS[name][0]()
    with jax.set_mesh(mesh):
        shardings = oa.state_shardings(tx, params)
        state = tx.init(params)
        placed = jax.device_put(state, shardings)
    chex.assert_trees_all_equal(placed, state)
    for leaf, sharding in zip(
        jax.tree.leaves(placed), jax.tree.leaves(shardings), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
@pytest.mark.parametrize("name", list(PADDED))
def test_contract_nested_chain_with_padding_windows_equals_flat(name, fused):
    """A nested chain steps on the calls where the flat chain does, with
    the same updates and Adam state, when micro-batches and whole inner
    windows have weight 0 (their gradients 0/0, as for fully padded
    micro-batches under a per-token mean loss)."""
    params = helpers.normal_tree(0, SHAPES, jnp.float32)
    got, want = [], []
    for tx, out in ((TRANSFORMS[name][0](), got), (PADDED[name](), want)):
        state, p = tx.init(params), params
        if fused:
            step = jax.jit(
                lambda p, s, g, w, tx=tx: oa.apply_gradients(
                    tx, g, s, p, accum_weight=w
                )
            )
        else:
            step = jax.jit(
                lambda p, s, g, w, tx=tx: (
                    lambda u, s: (optax.apply_updates(p, u), s)
                )(*tx.update(g, s, p, accum_weight=w))
            )
        for i, w in enumerate(PADDED_WEIGHTS):
            g = helpers.normal_like(params, i)
            if w == 0:
                g = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), g)
            p, state = step(p, state, g, jnp.float32(w))
            out.append(p)
        adam = [
            s
            for s in jax.tree.leaves(
                state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState)
            )
            if isinstance(s, optax.ScaleByAdamState)
        ]
        out.append(adam)
    assert int(got[-1][0].count) == int(want[-1][0].count) == 4
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
