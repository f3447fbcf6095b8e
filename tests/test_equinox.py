"""The Equinox recipe of docs/getting_started.md.

An ``eqx.filter``-ed model with ``oa.chain`` and the fused
``oa.apply_gradients`` inside ``eqx.filter_jit`` with donation; the reference
is ``optax.adam`` stepped once on the big batch (the concatenated window).
"""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxaccum as oa

SIZES = (3, 7, 2, 4)  # micro-batch sizes of one window: ragged


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _data(n, seed):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, 3)), jax.random.normal(ky, (n, 2))


# The recipe, as in the docs. The batch comes first: "all-except-first"
# donates the model and the optimizer state, not the batch.
def make_step(tx):
    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, opt_state):
        x, y = batch
        grads = eqx.filter_grad(_loss)(model, x, y)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        params, opt_state = oa.apply_gradients(
            tx, grads, opt_state, params, accum_weight=x.shape[0]
        )
        return eqx.combine(params, static), opt_state

    return step


def _model():
    return eqx.nn.MLP(
        3,
        2,
        width_size=8,
        depth=2,
        activation=jax.nn.tanh,
        key=jax.random.key(0),
    )


def test_equinox_recipe_equals_big_batch_adam():
    tx = oa.chain(oa.accumulate(len(SIZES)), optax.adam(1e-2))
    ref_tx = optax.adam(1e-2)
    model, ref = _model(), _model()
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    ref_state = ref_tx.init(eqx.filter(ref, eqx.is_inexact_array))
    step = make_step(tx)
    for window in range(2):
        batches = [_data(n, 10 * window + i) for i, n in enumerate(SIZES)]
        for batch in batches:
            model, opt_state = step(batch, model, opt_state)
        x = jnp.concatenate([b[0] for b in batches])
        y = jnp.concatenate([b[1] for b in batches])
        grads = eqx.filter_grad(_loss)(ref, x, y)
        updates, ref_state = ref_tx.update(grads, ref_state, ref)
        ref = eqx.apply_updates(ref, updates)
        chex.assert_trees_all_close(
            eqx.filter(model, eqx.is_inexact_array),
            eqx.filter(ref, eqx.is_inexact_array),
            rtol=1e-5,
            atol=1e-6,
        )
    assert int(opt_state[0].gradient_step) == 2
    # And not vacuous: the model moved away from its initialization.
    assert not np.allclose(model.layers[0].weight, _model().layers[0].weight)


def test_equinox_non_closing_step_keeps_params_and_donates():
    tx = oa.chain(oa.accumulate(4), optax.adam(1e-2))
    model = _model()
    model = eqx.tree_at(lambda m: m.layers[0].bias, model, jnp.full((8,), -0.0))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_step(tx)
    before = jax.tree.map(np.array, eqx.filter(model, eqx.is_inexact_array))
    old_weight = model.layers[0].weight
    for i in range(3):  # the window stays open
        model, opt_state = step(_data(5, i), model, opt_state)
    assert old_weight.is_deleted()  # donated
    chex.assert_trees_all_equal(eqx.filter(model, eqx.is_inexact_array), before)
    assert np.signbit(model.layers[0].bias).all()  # not even -0.0 + 0.0
    assert int(opt_state[0].mini_step) == 3
    model, opt_state = step(_data(5, 3), model, opt_state)  # closes
    assert not np.array_equal(model.layers[0].weight, before.layers[0].weight)
