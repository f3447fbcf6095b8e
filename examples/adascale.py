"""Growing the batch without retuning: AdaScale with ``oa.scale_by_window``.

An MLP on scikit-learn's digits, trained with SGD on micro-batches of 16
examples (the base batch, for which the learning rate is set), four ways,
on the same examples:

  (a) base batch      every micro-batch is a step (windows of 1);
  (b) ramp, no scale  windows grow 2 -> 4 -> 8 micro-batches, same lr;
  (c) ramp, sqrt      the same windows, lr times sqrt(W / 16);
  (d) ramp, gain      the same windows, lr times AdaScale's gain ratio
                      from the window's noise estimates.

It prints each run's optimizer steps, final training loss and progress
``tau`` (``oa.window_progress``), and plots the training loss against the
examples seen, against the optimizer steps and against ``tau`` into
``adascale.png`` (``--out DIR``, default the current directory): (d)
follows (a) per example with far fewer steps; (b) lags; (c) sits between.
Reproduce the figure with ``python examples/adascale.py`` (about a minute
on two CPU cores).
"""

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import init_mlp, load_data
from jax import lax

import optaxaccum as oa

MICRO = 16  # examples per micro-batch: the base batch
LR = 0.05


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    logits = mlp(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def ramp(gradient_step):
    """Windows of 2, then 4, then 8 micro-batches."""
    return jnp.where(gradient_step < 30, 2, jnp.where(gradient_step < 60, 4, 8))


def runs():
    """The four optimizers, by name."""
    sgd = optax.sgd(LR)

    def grown(rule):
        acc = oa.accumulate(ramp, noise_scale_decay=0.9)
        if rule is None:
            return oa.chain(acc, sgd)
        return oa.chain(acc, sgd, oa.scale_by_window(MICRO, rule=rule))

    return {
        "(a) base batch": oa.chain(oa.accumulate(1), sgd),
        "(b) ramp, no scale": grown(None),
        "(c) ramp, sqrt": grown("sqrt"),
        "(d) ramp, gain": grown("gain"),
    }


def train(tx, x, y, micro_steps, seed=0):
    """``micro_steps`` micro-batches of ``MICRO`` examples (reshuffled each
    epoch), one fused step each; the training loss, optimizer steps and
    tau after every micro-batch."""
    params = init_mlp(jax.random.key(seed), [64, 64, 10])
    n = len(x) // MICRO * MICRO
    epochs = -(-micro_steps * MICRO // n)
    keys = jax.random.split(jax.random.key(seed + 1), epochs)
    order = jnp.concatenate(
        [jax.random.permutation(k, len(x))[:n] for k in keys]
    )
    order = order[: micro_steps * MICRO].reshape(micro_steps, MICRO)
    x, y = jnp.asarray(x), jnp.asarray(y)

    def step(carry, idx):
        params, state = carry
        grads = jax.grad(loss_fn)(params, x[idx], y[idx])
        params, state = oa.apply_gradients(
            tx, grads, state, params, accum_weight=float(MICRO)
        )
        try:
            tau = oa.window_progress(state)
        except ValueError:  # no scale_by_window: tau is the step count
            tau = state[0].gradient_step.astype(jnp.float32)
        logs = (loss_fn(params, x, y), state[0].gradient_step, tau)
        return (params, state), logs

    carry = (params, tx.init(params))
    _, logs = jax.jit(lambda c: lax.scan(step, c, order))(carry)
    return [np.asarray(a) for a in logs]


def plot(results, path):
    import matplotlib.pyplot as plt

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, (loss, steps, tau) in results.items():
        seen = MICRO * np.arange(1, len(loss) + 1)
        left.plot(seen, loss, label=name)
        mid.plot(steps, loss, label=name)
        right.plot(tau, loss, label=name)
    left.set(xlabel="examples seen", ylabel="training loss", yscale="log")
    mid.set(xlabel="optimizer steps", yscale="log", xscale="log")
    right.set(xlabel="tau (oa.window_progress)", yscale="log", xscale="log")
    left.legend()
    fig.suptitle("SGD on digits: growing windows, with and without scaling")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    print(f"saved {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro-steps", type=int, default=1200)
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("."),
        help="directory for adascale.png",
    )
    args = parser.parse_args(argv)
    x, y, _, _ = load_data(images=False)
    results = {
        name: train(tx, x, y, args.micro_steps) for name, tx in runs().items()
    }
    print(f"{'run':<20} {'opt steps':>9} {'train loss':>10} {'tau':>8}")
    for name, (loss, steps, tau) in results.items():
        print(f"{name:<20} {steps[-1]:>9d} {loss[-1]:>10.4f} {tau[-1]:>8.1f}")
    plot(results, args.out / "adascale.png")


if __name__ == "__main__":
    main()
