"""Flax NNX: ``optaxaccum.flax.nnx.Optimizer`` with ``oa.accumulate`` and an
accumulated BatchNorm.

A small CNN written with ``flax.nnx`` learns scikit-learn's bundled digits on
micro-batches of 16. Its BatchNorm layer is
``optaxaccum.flax.nnx.AccumBatchNorm(..., accum_steps=4)``: each micro-batch
is normalized with its own statistics, and the running ``mean``/``var`` are
updated once per window, with the statistics of the window's 64 examples.
The optimizer is ``optaxaccum.flax.nnx.Optimizer`` (a subclass of
``nnx.Optimizer``) holding

    oa.chain(oa.accumulate(4), optax.adam(1e-3))

so Adam steps once per 4 micro-batches (``optimizer.step`` still counts
calls), and the micro-steps in between take the fused path: they do not
write the parameters. The epoch length is not a multiple of 4: at the end of
each epoch ``optimizer.flush(model)`` closes the partial window of Adam and
of the BatchNorm statistics together.

Run: ``python examples/nnx_example.py [--epochs 8] [--tiny]``.
"""

import jax.numpy as jnp
import numpy as np
import optax
from _digits import tiny_data, training_parser
from flax import nnx

import optaxaccum as oa
from optaxaccum.flax import nnx as oa_nnx

MICRO = 16


class CNN(nnx.Module):
    def __init__(self, accum_steps: int, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, (3, 3), use_bias=False, rngs=rngs)
        self.bn = oa_nnx.AccumBatchNorm(
            16, accum_steps=accum_steps, momentum=0.9, rngs=rngs
        )
        self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)
        self.head = nnx.Linear(4 * 4 * 32, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv1(x)))
        x = nnx.relu(self.conv2(x))
        return self.head(x.reshape(x.shape[0], -1))


def loss_fn(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit(donate_argnums=(0, 1))
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)  # Adam runs when the window closes
    return loss


@nnx.jit(donate_argnums=(0, 1))
def end_of_epoch(model, optimizer):
    """Closes the partial windows: Adam's and the BatchNorm statistics'."""
    optimizer.flush(model)


@nnx.jit
def accuracy(model, x, y):
    return jnp.mean(jnp.argmax(model(x), -1) == y)


def main(argv=None):
    args = training_parser(__doc__.split("\n")[0], lr=1e-3).parse_args(argv)
    epochs, (x_train, y_train, x_test, y_test) = tiny_data(args)
    model = CNN(args.accum, nnx.Rngs(0))
    optimizer = oa_nnx.Optimizer(
        model, oa.chain(oa.accumulate(args.accum), optax.adam(args.lr))
    )
    n_micro = len(x_train) // MICRO
    print(
        f"{len(x_train)} training images: {n_micro} micro-batches of "
        f"{MICRO} per epoch = {n_micro // args.accum} windows of "
        f"{args.accum} + {n_micro % args.accum} flushed"
    )
    for epoch in range(epochs):
        model.train()
        perm = np.random.default_rng([0, epoch]).permutation(len(x_train))
        losses = []
        for i in range(n_micro):
            idx = perm[i * MICRO : (i + 1) * MICRO]
            losses.append(
                train_step(model, optimizer, x_train[idx], y_train[idx])
            )
        end_of_epoch(model, optimizer)
        acc_state = optimizer.opt_state[0]  # the AccumulateState
        model.eval()
        print(
            f"epoch {epoch + 1}: mean loss {float(np.mean(losses)):.4f}, "
            f"micro-steps {int(optimizer.step[...])}, Adam steps "
            f"{int(acc_state.gradient_step[...])}, open BN window "
            f"{int(model.bn.window_step[...])}, test accuracy "
            f"{float(accuracy(model, x_test, y_test)):.4f}"
        )
    final = float(accuracy(model, x_test, y_test))
    print(f"final test accuracy {final:.4f}")
    return final


if __name__ == "__main__":
    main()
