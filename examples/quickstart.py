"""Quickstart: accumulating 4 micro-batches of 16 trains like a batch of 64.

This is what ``make demo`` runs. A small convolutional network with a
BatchNorm layer learns scikit-learn's bundled digits (8x8 images, 10 classes;
nothing is downloaded) three ways, each seeing the same examples in the same
order for the same number of epochs:

(a) ``batch 64``: batches of 64, plain ``optax.adam``, and
    ``AccumBatchNorm(accum_steps=1)``, which is exactly ``nn.BatchNorm``;
(b) ``16 x accumulate(4)``: micro-batches of 16 through
    ``oa.chain(oa.accumulate(4), optax.adam(lr))`` with
    ``AccumBatchNorm(accum_steps=4)`` and ``optaxaccum.flax.TrainState``:
    Adam steps once per 4 micro-batches with their mean gradient and the
    BatchNorm running statistics are those of the 64 examples, so it takes
    the same optimizer steps as (a) while holding the activations of 16;
(c) ``batch 16``: micro-batches of 16 without accumulation, i.e. four
    times as many, noisier optimizer steps.

The epoch length is not a multiple of the window, so (b) closes the last,
partial window of each epoch with ``TrainState.flush``, exactly as (a) takes
a last, smaller batch.

The script prints a table (final test accuracy, final train loss, optimizer
steps, wall time and the compiled memory of one training step, from XLA's
memory analysis) and saves ``quickstart.png``: test accuracy and train loss
per epoch of the three runs.

Run: ``python examples/quickstart.py [--epochs 20] [--out DIR] [--tiny]``.
"""

import argparse
import os
import time

import jax
import matplotlib
import numpy as np
import optax
from _digits import CNN, accuracy, load_data
from tqdm import tqdm

import optaxaccum as oa
from optaxaccum.flax import TrainState

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

MICRO = 16  # examples per micro-batch
K = 4  # micro-batches per window: a window holds 64 examples
MOMENTUM = 0.9  # of the BatchNorm running averages


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels
    ).mean()


def make_train_step(model):
    """One (micro-)batch: forward in training mode, backward, optimizer."""

    def train_step(state, x, y):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                train=True,
                mutable=["batch_stats"],
            )
            return cross_entropy(logits, y), updates["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params
        )
        # The fused path: on the 3 micro-steps out of 4 that do not close the
        # window, the params are handed back untouched.
        state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
        return state, loss

    # The state goes in first and comes back first: XLA reuses its buffers.
    return jax.jit(train_step, donate_argnums=0)


def memory_bytes(compiled):
    """``(footprint, temp)`` bytes of a compiled step: arguments + outputs
    - aliased (donated) + temporaries, as XLA's memory analysis counts them."""
    m = compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    return total, m.temp_size_in_bytes


def batches(x, y, size):
    """Consecutive batches of ``size`` (the last one may be smaller)."""
    for i in range(0, len(x), size):
        yield x[i : i + size], y[i : i + size]


def setup(accum, x, lr, seed):
    """The model, its initial ``TrainState`` and its jitted train step."""
    model = CNN(accum_steps=accum, momentum=MOMENTUM)
    variables = model.init(jax.random.key(seed), x[:MICRO], train=False)
    tx = (
        optax.adam(lr)
        if accum == 1
        else oa.chain(oa.accumulate(accum), optax.adam(lr))
    )
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )
    return model, state, make_train_step(model)


def step_memory(batch, accum, data, lr=2e-3, seed=0):
    """``(footprint, temp)`` bytes of the compiled train step of a run with
    batches of ``batch`` and windows of ``accum``, compiled, not run."""
    x_train, y_train = data[0], data[1]
    _, state, train_step = setup(accum, x_train, lr, seed)
    xb, yb = x_train[:batch], y_train[:batch]
    return memory_bytes(train_step.lower(state, xb, yb).compile())


def train(name, batch, accum, data, epochs, lr, seed, progress):
    """Trains one configuration; returns its per-epoch history and summary."""
    x_train, y_train, x_test, y_test = data
    _, state, train_step = setup(accum, x_train, lr, seed)
    # Closes Adam's window and BatchNorm's, with the layer's own momentum.
    flush = jax.jit(TrainState.flush, donate_argnums=0)

    # Compiled ahead of time (once per batch shape), so that the memory
    # analysis describes the very executable that trains.
    compiled = {}

    def step(state, xb, yb):
        if len(xb) not in compiled:
            compiled[len(xb)] = train_step.lower(state, xb, yb).compile()
        return compiled[len(xb)](state, xb, yb)

    # Every run uses the same micro-batches, in the same order: each epoch
    # shuffles the training set (same seed for all runs) and keeps a whole
    # number of micro-batches.
    n_micro = len(x_train) // MICRO
    history = {"test_acc": [], "train_loss": []}
    start = time.perf_counter()
    for epoch in tqdm(
        range(epochs), desc=f"{name:>20}", unit="epoch", disable=not progress
    ):
        perm = np.random.default_rng([seed, epoch]).permutation(len(x_train))
        perm = perm[: n_micro * MICRO]
        losses, sizes = [], []
        for xb, yb in batches(x_train[perm], y_train[perm], batch):
            state, loss = step(state, xb, yb)
            losses.append(loss)
            sizes.append(len(xb))
        if accum > 1 and n_micro % accum:
            # The epoch's last window is partial: close it with the true
            # count, for the optimizer and for the BatchNorm statistics.
            state = flush(state)
        history["train_loss"].append(
            float(np.average(jax.device_get(losses), weights=sizes))
        )
        history["test_acc"].append(float(accuracy(state, x_test, y_test)))
    jax.block_until_ready(state)
    wall = time.perf_counter() - start
    memory = memory_bytes(compiled[batch])
    steps = (
        int(state.step) if accum == 1 else int(state.opt_state[0].gradient_step)
    )
    return history, {
        "run": name,
        "test acc": history["test_acc"][-1],
        "train loss": history["train_loss"][-1],
        "opt steps": steps,
        "wall s": wall,
        "step memory": memory[0],
        "step temp": memory[1],
    }


def print_table(rows):
    headers = [
        "run",
        "test acc",
        "train loss",
        "opt steps",
        "wall s",
        "step mem KiB",
        "temp KiB",
    ]
    cells = [
        [
            r["run"],
            f"{r['test acc']:.4f}",
            f"{r['train loss']:.4f}",
            str(r["opt steps"]),
            f"{r['wall s']:.1f}",
            f"{r['step memory'] / 1024:.1f}",
            f"{r['step temp'] / 1024:.1f}",
        ]
        for r in rows
    ]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)
    ]

    def line(values):
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print(line(c))


def plot(histories, path, title):
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = ["-", "--", ":"]
    for (name, hist), style in zip(histories.items(), styles, strict=True):
        epochs = np.arange(1, len(hist["test_acc"]) + 1)
        ax_acc.plot(epochs, hist["test_acc"], style, marker=".", label=name)
        ax_loss.plot(epochs, hist["train_loss"], style, marker=".", label=name)
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="Test accuracy")
    ax_loss.set(
        xlabel="epoch",
        ylabel="train loss (cross-entropy)",
        title="Train loss",
        yscale="log",
    )
    for ax in (ax_acc, ax_loss):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=".", help="directory for quickstart.png"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="2 epochs on a subset (a smoke test, seconds)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars"
    )
    args = parser.parse_args(argv)
    epochs = 2 if args.tiny else args.epochs

    data = load_data(n_train=288, n_test=128) if args.tiny else load_data()
    n_train, n_test = len(data[0]), len(data[2])
    n_micro = n_train // MICRO
    print(
        f"digits: {n_train} training / {n_test} test images (8x8); "
        f"{n_micro} micro-batches of {MICRO} per epoch = "
        f"{n_micro // K} windows of {K} + {n_micro % K}; {epochs} epochs; "
        f"{jax.devices()[0].platform}"
    )
    runs = [  # (name, batch size, accumulation window)
        (f"(a) batch {MICRO * K}", MICRO * K, 1),
        (f"(b) {MICRO} x accumulate({K})", MICRO, K),
        (f"(c) batch {MICRO}", MICRO, 1),
    ]
    histories, rows = {}, []
    for name, batch, accum in runs:
        histories[name], row = train(
            name,
            batch,
            accum,
            data,
            epochs,
            args.lr,
            args.seed,
            progress=not args.no_progress,
        )
        rows.append(row)

    print()
    print_table(rows)
    print(
        "\n(a) and (b) take the same Adam steps on the same examples; (b) "
        "holds the\nactivations of 16 examples, not 64 (temp). (c) takes "
        "4x the steps, each on 16.\nWall time includes compilation."
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "quickstart.png")
    plot(
        histories,
        path,
        f"CNN on digits, {epochs} epochs: batch {MICRO * K} vs "
        f"{K} accumulated micro-batches of {MICRO} vs batch {MICRO}",
    )
    print(f"saved {path}")
    return rows


if __name__ == "__main__":
    main()
