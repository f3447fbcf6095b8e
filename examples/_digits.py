"""Shared pieces of the examples: scikit-learn's bundled digits data set
(8x8 images, 10 classes; nothing is downloaded), the command line of the
examples that train on it, the small linen CNN with an ``AccumBatchNorm``
layer, and a plain MLP."""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from optaxaccum.flax import AccumBatchNorm


def training_parser(description, *, lr):
    """The command line of an example training on the digits: ``--epochs``,
    ``--accum``, ``--lr`` (default ``lr``) and ``--tiny`` (2 epochs on a
    subset: :func:`tiny_data`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="2 epochs on a subset (a smoke test)",
    )
    return parser


def tiny_data(args):
    """``(epochs, (x_train, y_train, x_test, y_test))`` of the command line
    ``args`` of :func:`training_parser`: 2 epochs on 160 training images
    with ``--tiny``."""
    if args.tiny:
        return 2, load_data(n_train=160)
    return args.epochs, load_data()


def load_data(*, images=True, n_train=None, n_test=None):
    """Standardized digits, a fixed stratified 70/30 split.

    Args:
      images: ``(N, 8, 8, 1)`` images if true, else ``(N, 64)`` vectors.
      n_train, n_test: keep only the first examples (small smoke runs).

    Returns:
      ``x_train, y_train, x_test, y_test`` (float32 inputs, int32 labels).
    """
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data,
        digits.target,
        test_size=0.3,
        random_state=0,
        stratify=digits.target,
    )
    x_train, y_train = x_train[:n_train], y_train[:n_train]
    x_test, y_test = x_test[:n_test], y_test[:n_test]
    scaler = StandardScaler().fit(x_train)
    shape = (-1, 8, 8, 1) if images else (-1, 64)

    def prepare(x):
        return scaler.transform(x).astype(np.float32).reshape(shape)

    return (
        prepare(x_train),
        y_train.astype(np.int32),
        prepare(x_test),
        y_test.astype(np.int32),
    )


class CNN(nn.Module):
    """Conv -> AccumBatchNorm -> ReLU -> strided conv -> ReLU -> dense."""

    accum_steps: int = 1
    momentum: float = 0.9

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(16, (3, 3), use_bias=False, name="conv1")(x)
        # An explicit name keeps the variables where nn.BatchNorm has them.
        x = AccumBatchNorm(
            use_running_average=not train,
            momentum=self.momentum,
            accum_steps=self.accum_steps,
            name="bn",
        )(x)
        x = nn.relu(x)
        x = nn.relu(nn.Conv(32, (3, 3), strides=2, name="conv2")(x))
        return nn.Dense(10, name="head")(x.reshape(x.shape[0], -1))


@jax.jit
def accuracy(state, x, y):
    """Accuracy of a linen ``TrainState`` whose ``batch_stats`` hold the BN
    running statistics (evaluation mode)."""
    logits = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats},
        x,
        train=False,
    )
    return jnp.mean(jnp.argmax(logits, -1) == y)


def init_mlp(key, sizes):
    """Dense layers ``sizes[0] -> ... -> sizes[-1]``: a list of w/b dicts."""
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]
