"""BatchNorm statistics pooled over the optimizer's window, with Equinox.

Gradient accumulation makes an optimizer step see a window of micro-batches,
but a BatchNorm layer still updates its running statistics once per
micro-batch, from that micro-batch alone. This script builds, in Equinox, a
BatchNorm whose running ``mean``/``var`` are updated once per window with the
pooled statistics of the whole window (as ``optaxaccum.flax.AccumBatchNorm``
does for Flax), from optaxaccum's framework-neutral helpers
(``optaxaccum.batchnorm``: plain JAX, no flax), and keeps its window
aligned with the optimizer's: a micro-batch that the chain does not count
stays out, and the BatchNorm window closes on exactly the calls where the
optimizer's window closes -- here windows whose length changes, sized from
the gradient noise scale by ``oa.critical_batch_every_k``.

It checks the running statistics against BatchNorm run once per window on
the concatenated micro-batches.

Run: ``python examples/equinox_batchnorm.py [--micro-batches 40] [--tiny]``.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxaccum as oa
from optaxaccum import batchnorm

FEATURES = 4
MICRO = 8  # examples per micro-batch
MOMENTUM = 0.8
MIN_K, MAX_K = 2, 6  # window lengths chosen by critical_batch_every_k


class BatchNorm(eqx.Module):
    """Normalizes each micro-batch with its own statistics; the running ones
    see whole windows (closed by :func:`follow_window`, or after
    ``accum_steps`` micro-batches when used without an optimizer)."""

    scale: jax.Array
    bias: jax.Array
    accum_steps: int = eqx.field(static=True)

    def __init__(self, features: int, accum_steps: int):
        self.scale = jnp.ones(features)
        self.bias = jnp.zeros(features)
        self.accum_steps = accum_steps

    def init_state(self) -> batchnorm.RunningStats:
        n = self.scale.shape[0]
        window = batchnorm.empty_window(n)
        return batchnorm.RunningStats(jnp.zeros(n), jnp.ones(n), window)

    def __call__(self, x, state: batchnorm.RunningStats, *, train: bool):
        if not train:
            mean, var = state.running_mean, state.running_var
            y = (x - mean) * jax.lax.rsqrt(var + 1e-5)
            return y * self.scale + self.bias, state
        stats = batchnorm.micro_batch_stats(x, reduction_axes=0)
        _, mean, var = stats
        y = (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale + self.bias
        new = batchnorm.step(
            *state,
            jax.tree.map(jax.lax.stop_gradient, stats),
            momentum=MOMENTUM,
            every_k=self.accum_steps,
        )
        return y, new


class Net(eqx.Module):
    bn: BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        self.bn = BatchNorm(FEATURES, accum_steps=MAX_K)
        self.head = eqx.nn.Linear(FEATURES, 1, key=key)

    def __call__(self, x, state, *, train):
        h, state = self.bn(x, state, train=train)
        return jax.vmap(self.head)(h)[:, 0], state


def follow_window(old_opt, new_opt, *, old, new) -> batchnorm.RunningStats:
    """The BatchNorm state after the optimizer's call that turned
    ``old_opt`` into ``new_opt``: ``old`` where the chain did not count the
    micro-batch, ``new`` otherwise, its window closed where the optimizer's
    window closed (both answers come from the optimizer's states)."""
    kept = batchnorm.keep_counted(old_opt, new_opt, old=old, new=new)
    closed = batchnorm.closed(old_opt, new_opt)
    return batchnorm.close(*kept, momentum=MOMENTUM, where=closed)


def make_step(tx):
    @eqx.filter_jit
    def step(model, bn_state, opt_state, x, y):
        def loss(model):
            out, new_bn = model(x, bn_state, train=True)
            return jnp.mean((out - y) ** 2), new_bn

        grads, new_bn = eqx.filter_grad(loss, has_aux=True)(model)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        params, new_opt = oa.apply_gradients(tx, grads, opt_state, params)
        bn_state = follow_window(opt_state, new_opt, old=bn_state, new=new_bn)
        return eqx.combine(params, static), bn_state, new_opt

    return step


def reference(batches, windows):
    """Running statistics of BatchNorm run once per window on the
    concatenated micro-batches (biased variance, as BatchNorm)."""
    mean, var = np.zeros(FEATURES), np.ones(FEATURES)
    for w in windows:
        x = np.concatenate([np.asarray(batches[i]) for i in w]).astype(
            np.float64
        )
        mean = MOMENTUM * mean + (1 - MOMENTUM) * x.mean(0)
        var = MOMENTUM * var + (1 - MOMENTUM) * x.var(0)
    return mean, var


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=40)
    parser.add_argument("--tiny", action="store_true", help="20 micro-batches")
    args = parser.parse_args(argv)
    n = 20 if args.tiny else args.micro_batches

    every_k = oa.critical_batch_every_k(MIN_K, MAX_K, micro_batch_weight=1)
    tx = oa.chain(
        oa.accumulate(every_k, noise_scale_decay=0.0), optax.adam(1e-2)
    )
    model = Net(jax.random.key(0))
    bn_state = model.bn.init_state()
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_step(tx)

    keys = jax.random.split(jax.random.key(1), n)
    batches = [
        3.0 + 2.0 * jax.random.normal(k, (MICRO, FEATURES)) for k in keys
    ]
    closed, aligned = [], True
    for i, x in enumerate(batches):
        # Noisy labels: a large noise scale, so the windows grow.
        y = 0.3 * jnp.sin(x.sum(1)) + jax.random.normal(keys[i], (MICRO,))
        model, bn_state, opt_state = step(model, bn_state, opt_state, x, y)
        closed.append(bool(oa.has_updated(opt_state)))
        aligned &= closed[-1] == (int(bn_state.window.micro_batches) == 0)

    ends = [i for i, c in enumerate(closed) if c]
    windows = [range(a + 1, b + 1) for a, b in zip([-1, *ends], ends)]
    mean, var = reference(batches, windows)
    error = max(
        float(np.abs(np.asarray(bn_state.running_mean) - mean).max()),
        float(np.abs(np.asarray(bn_state.running_var) - var).max()),
    )
    print(f"window lengths: {[len(w) for w in windows]}")
    print(f"BatchNorm windows closed with the optimizer's: {aligned}")
    print(f"running statistics vs BatchNorm on the windows: error {error:.2e}")


if __name__ == "__main__":
    main()
