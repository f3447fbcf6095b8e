"""Flax NNX: ``nnx.Optimizer`` with ``oa.accumulate`` and an accumulated
BatchNorm.

A small CNN written with ``flax.nnx`` learns scikit-learn's bundled digits on
micro-batches of 16. Its BatchNorm layer is
``optaxaccum.flax.nnx.AccumBatchNorm(..., accum_steps=4)``: each micro-batch
is normalized with its own statistics, and the running ``mean``/``var`` are
updated once per window, with the statistics of the window's 64 examples.
The optimizer is a stock ``nnx.Optimizer`` holding

    oa.chain(oa.accumulate(4), optax.adam(1e-3))

so Adam steps once per 4 micro-batches (``nnx.Optimizer.step`` still counts
calls). The epoch length is not a multiple of 4: at the end of each epoch the
partial window is closed for the BatchNorm statistics with
``optaxaccum.flax.nnx.flush_batch_stats(model)`` and for Adam with
``oa.flush``, applied to the optimizer's state inside an ``nnx.jit``.

Run: ``python examples/nnx_example.py [--epochs 8] [--tiny]``.
"""

import argparse

import jax.numpy as jnp
import numpy as np
import optax
from _digits import load_data
from flax import nnx

import optaxaccum as oa
from optaxaccum.flax import nnx as oa_nnx

MICRO = 16


class CNN(nnx.Module):
    def __init__(self, accum_steps: int, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, (3, 3), use_bias=False, rngs=rngs)
        self.bn = oa_nnx.AccumBatchNorm(16, accum_steps=accum_steps,
                                        momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 32, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv1(x)))
        x = nnx.relu(self.conv2(x))
        return self.head(x.reshape(x.shape[0], -1))



def loss_fn(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)  # Adam runs when the window closes
    return loss


@nnx.jit
def end_of_epoch(model, optimizer):
    """Closes the partial window: BatchNorm statistics, then Adam."""
    oa_nnx.flush_batch_stats(model)
    # What nnx.Optimizer.update does, with oa.flush in place of tx.update.
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    updates, opt_state = oa.flush(
        optimizer.tx, nnx.as_pure(optimizer.opt_state), params)
    nnx.update(model, optax.apply_updates(params, updates))
    nnx.update(optimizer.opt_state, nnx.state(opt_state))


@nnx.jit
def accuracy(model, x, y):
    return jnp.mean(jnp.argmax(model(x), -1) == y)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tiny", action="store_true",
                        help="2 epochs on a subset (a smoke test)")
    args = parser.parse_args(argv)
    epochs = 2 if args.tiny else args.epochs

    x_train, y_train, x_test, y_test = (
        load_data(n_train=160) if args.tiny else load_data())
    model = CNN(args.accum, nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, oa.chain(oa.accumulate(args.accum), optax.adam(args.lr)),
        wrt=nnx.Param,
    )
    n_micro = len(x_train) // MICRO
    print(f"{len(x_train)} training images: {n_micro} micro-batches of "
          f"{MICRO} per epoch = {n_micro // args.accum} windows of "
          f"{args.accum} + {n_micro % args.accum} flushed")
    for epoch in range(epochs):
        model.train()
        perm = np.random.default_rng([0, epoch]).permutation(len(x_train))
        losses = []
        for i in range(n_micro):
            idx = perm[i * MICRO:(i + 1) * MICRO]
            losses.append(train_step(model, optimizer, x_train[idx],
                                     y_train[idx]))
        end_of_epoch(model, optimizer)
        acc_state = optimizer.opt_state[0]  # the AccumulateState
        model.eval()
        print(f"epoch {epoch + 1}: mean loss {float(np.mean(losses)):.4f}, "
              f"micro-steps {int(optimizer.step[...])}, Adam steps "
              f"{int(acc_state.gradient_step[...])}, open BN window "
              f"{int(model.bn.window_step[...])}, test accuracy "
              f"{float(accuracy(model, x_test, y_test)):.4f}")
    final = float(accuracy(model, x_test, y_test))
    print(f"final test accuracy {final:.4f}")
    return final


if __name__ == "__main__":
    main()
