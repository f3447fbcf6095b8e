"""Setups shared by the flax test modules: a linen model with an
``AccumBatchNorm`` and the ``TrainState`` steps that train it.

``test_flax.py`` tests their behaviour; ``test_every_weight.py`` and
``tests/repo/test_docs_site.py`` reuse them.
"""

import flax.linen as nn
import jax
import optax

import optaxaccum as oa
from optaxaccum.flax import AccumBatchNorm, TrainState


class BNHead(nn.Module):
    """AccumBatchNorm on the input, then a linear head."""

    accum_steps: int = 1

    @nn.compact
    def __call__(self, x, train):
        x = AccumBatchNorm(
            not train, momentum=0.8, accum_steps=self.accum_steps
        )(x)
        return nn.Dense(1)(x)[:, 0]


def bn_trainstate_steps(accum_steps, k, calls, jit):
    """``calls`` micro-steps of a TrainState (window ``k``) holding an
    AccumBatchNorm(accum_steps); returns the state."""
    model = BNHead(accum_steps=accum_steps)
    x0 = jax.random.normal(jax.random.key(0), (6, 4))
    variables = model.init(jax.random.key(0), x0, False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=oa.chain(oa.accumulate(k), optax.sgd(0.1)),
        batch_stats=variables["batch_stats"],
    )

    def step(state, x, y):
        def loss(params):
            out, upd = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                True,
                mutable=["batch_stats"],
            )
            return ((out - y) ** 2).mean(), upd["batch_stats"]

        grads, bs = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=bs)

    step = jax.jit(step) if jit else step
    for i in range(calls):
        x = 3.0 + 2.0 * jax.random.normal(jax.random.key(i), (6, 4))
        state = step(state, x, jax.random.normal(jax.random.key(50 + i), (6,)))
    return jax.block_until_ready(state)
