"""A character-level transformer LM: per-token accumulation done right.

A small decoder-only transformer (``flax.nnx``) learns to continue Python
code. The text is the Python standard library's own ``.py`` sources (found
with ``sysconfig``; nothing is downloaded), cut at blank lines into
documents whose lengths are then drawn at random (as in chat or code data,
padding is 30 to 50% of every batch), each padded to the context length. The
loss is the mean cross-entropy over the real (unpadded) tokens of the batch.

Three runs see the same documents in the same order, from the same
initialization, with ``optax.adam``:

(a) ``batch B``: B sequences per optimizer step (stock ``nnx.Optimizer``);
(b) ``B/k x accumulate(k), weighted``: k micro-batches of B/k sequences
    through ``optaxaccum.flax.nnx.Optimizer`` and
    ``oa.chain(oa.accumulate(k), optax.adam)``, each micro-batch passing
    ``accum_weight=<its number of real tokens>``: the window's gradient is
    the per-token mean over the whole batch, so the updates are those of (a)
    to float tolerance;
(c) ``B/k x accumulate(k), naive``: the same without weights: the mean of
    the per-micro-batch means, which over-weights the tokens of micro-batches
    of short documents (the bug of Hugging Face transformers #34191).

(b) also estimates the gradient noise scale from its windows
(``oa.accumulate(k, noise_scale_decay=0.9)``): ``B_simple``, in tokens, the
batch beyond which more tokens per step buy little (docs/noise_scale.md).

The window count k is the one ``oa.plan_microbatches`` picks for a stated
memory budget (by default 40% of what the whole-batch step needs, from
XLA's memory analysis; ``--budget-kib`` to state another). An epoch is not a
whole number of windows: (b) and (c) close their last, partial window with
``Optimizer.flush`` and (a) takes the matching smaller batch (padded with
empty rows, which carry no tokens).

The script prints the gradient error of (b) and (c) against (a) at the
initialization, a table of losses and of the distance of the trained
parameters from those of (a), (b)'s ``B_simple`` per window, and saves
``transformer_lm.png`` (per optimizer step: the train loss, its gap to (a)
and the parameters' distance to (a)) and ``transformer_lm_noise_scale.png``
(the train loss and ``B_simple`` against the tokens per window).

``--mesh`` compiles the model's training step instead, on a ``data=2 x
fsdp=4`` mesh of 8 devices (8 host CPU devices unless ``XLA_FLAGS`` says
otherwise): every kernel sharded over ``fsdp`` and gathered with
``oa.fsdp_gather``, one jitted step of k micro-batches
(``oa.microbatched_value_and_grad``), with and without
``gather_once=oa.GatherOnce(("data", "fsdp"))``, and prints the kernels'
all-gathers and reduce-scatters per step (those inside the scan's loop run
once per micro-batch) and the step's per-device memory. Nothing is trained.

Run: ``python examples/transformer_lm.py [--epochs 2] [--out DIR] [--quick]
[--mesh]``.
"""

import os
import sys

from _mesh import ask_for_host_devices, census_line

if "--mesh" in sys.argv:
    ask_for_host_devices()  # before JAX starts its CPU backend

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

import optaxaccum as oa  # noqa: E402
from optaxaccum.flax import nnx as oa_nnx  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PAD = 0  # never in the text: characters are mapped to 1..127


@dataclasses.dataclass(frozen=True)
class Config:
    context: int = 96  # characters per sequence
    dim: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 32  # B, sequences per optimizer step
    n_train: int = 1040  # documents per epoch: 32.5 batches
    n_eval: int = 256
    epochs: int = 2
    lr: float = 3e-3


QUICK = Config(
    context=32,
    dim=32,
    heads=2,
    layers=1,
    batch=8,
    n_train=60,
    n_eval=32,
    epochs=2,
)


# ------------------------------------------------------------------- data --


def load_documents(context, max_rows, seed=0):
    """The stdlib's .py files cut at blank lines into documents, and each
    document into rows of ``context + 1`` characters (its last row shorter),
    each row then cut to a length drawn uniformly from ``context // 5 + 2``
    to ``context + 1``: about 40% of the tokens are padding.

    Reads files (in sorted order) until it has ``max_rows`` rows. Returns
    ``(tokens, lengths)``: tokens ``(n, context + 1)`` int32, padded with
    ``PAD``, in a shuffled order; lengths, the real characters per row.
    """
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for path in sorted(stdlib.glob("*.py")):
        if len(rows) >= max_rows:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        for doc in re.split(r"\n\s*\n", text):
            codes = np.frombuffer(doc.encode("ascii", "replace"), np.uint8)
            rows += [
                codes[i : i + context + 1]
                for i in range(0, len(codes) - 2, context + 1)
            ]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(rows))
    cut = rng.integers(context // 5 + 2, context + 2, size=len(rows))
    tokens = np.full((len(rows), context + 1), PAD, np.int32)
    lengths = np.zeros(len(rows), np.int32)
    for row, i in enumerate(order):
        text = rows[i][: cut[row]]
        tokens[row, : len(text)] = np.clip(text, 1, 127)
        lengths[row] = len(text)
    return tokens, lengths


def split_batch(tokens):
    """Inputs, next-character targets and the mask of real targets."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    return x, y, (y != PAD).astype(np.float32)


# ------------------------------------------------------------------ model --


class Block(nnx.Module):
    """Pre-LayerNorm attention and MLP. The attention has no biases: a key
    bias has a zero gradient (softmax ignores a shift shared by all keys),
    whose rounding noise Adam would turn into steps of size lr."""

    def __init__(self, cfg, rngs):
        self.ln1 = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            cfg.heads, cfg.dim, use_bias=False, decode=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.up = nnx.Linear(cfg.dim, 4 * cfg.dim, rngs=rngs)
        self.down = nnx.Linear(4 * cfg.dim, cfg.dim, rngs=rngs)

    def __call__(self, h, mask):
        h = h + self.attn(self.ln1(h), mask=mask)
        return h + self.down(nnx.gelu(self.up(self.ln2(h))))


def embed_tokens(embed, x):
    """``embed(x)``; on an explicit mesh (``--mesh``) the lookup names its
    output sharding (the rows of ``x``'s), which JAX cannot infer for
    a gather of a replicated table by sharded indices."""
    spec = jax.typeof(x).sharding.spec
    if not any(spec.partitions):
        return embed(x)
    return (
        embed.embedding[...]
        .at[x]
        .get(out_sharding=jax.P(*spec.partitions, None))
    )


class CharLM(nnx.Module):
    """Decoder-only transformer over 128 characters."""

    def __init__(self, cfg, rngs):
        self.embed = nnx.Embed(128, cfg.dim, rngs=rngs)
        self.pos = nnx.Embed(cfg.context, cfg.dim, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln = nnx.LayerNorm(cfg.dim, rngs=rngs)
        self.head = nnx.Linear(cfg.dim, 128, rngs=rngs)

    def __call__(self, x):
        # Padding is trailing, so the causal mask alone keeps every real
        # position from seeing a pad; pad positions are masked in the loss.
        mask = nnx.make_causal_mask(x)
        h = embed_tokens(self.embed, x) + self.pos(jnp.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.ln(h))


def token_loss(model, x, y, mask):
    """Mean cross-entropy over the real tokens (0 for an empty batch)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@nnx.jit(donate_argnums=(0, 1))
def big_step(model, opt, x, y, mask):
    loss, grads = nnx.value_and_grad(token_loss)(model, x, y, mask)
    opt.update(model, grads)
    return loss


@nnx.jit(donate_argnums=(0, 1))
def micro_step(model, opt, x, y, mask, weight):
    loss, grads = nnx.value_and_grad(token_loss)(model, x, y, mask)
    opt.update(model, grads, accum_weight=weight)
    return loss


flush = nnx.jit(lambda model, opt: opt.flush(model), donate_argnums=(0, 1))
eval_loss = nnx.jit(token_loss)
grad_of = nnx.jit(lambda m, x, y, mask: nnx.grad(token_loss)(m, x, y, mask))


def plan_window(cfg, model, tokens, budget_kib):
    """``oa.plan_microbatches`` for the whole-batch step; k >= 2."""
    graphdef, params = nnx.split(model)

    def loss_fn(params, batch):
        return token_loss(nnx.merge(graphdef, params), *batch)

    batch = split_batch(tokens[: cfg.batch])
    weight = {"weight_fn": lambda b: jnp.sum(b[2])}  # per-token mean
    whole = oa.microbatched_step_memory(
        loss_fn, params, batch, num_microbatches=1, **weight
    )
    budget = 0.4 * whole if budget_kib is None else budget_kib * 1024
    if budget >= whole:
        raise SystemExit(
            f"a budget of {budget / 1024:.0f} KiB fits the "
            "whole batch: there is nothing to accumulate"
        )
    # The whole batch (k = 1) does not fit: try from k = 2 on.
    divisors = [d for d in range(2, cfg.batch + 1) if cfg.batch % d == 0]
    k = oa.plan_microbatches(
        loss_fn,
        params,
        batch,
        memory_budget=budget,
        candidates=divisors,
        **weight,
    )
    return k, whole, budget


# -------------------------------------------------------------- training --


def windows(tokens, cfg, k, epoch):
    """The epoch's batches of B rows, the last one partial (a multiple of
    B/k rows). Same order in every run."""
    micro = cfg.batch // k
    n = (cfg.n_train // micro) * micro  # whole micro-batches only
    perm = np.random.default_rng([1, epoch]).permutation(cfg.n_train)[:n]
    return [tokens[perm[i : i + cfg.batch]] for i in range(0, n, cfg.batch)]


def pad_rows(batch, rows):
    """Appends empty (all-pad) rows: no tokens, so no change to the loss."""
    return np.concatenate(
        [batch, np.full((rows - len(batch), batch.shape[1]), PAD, np.int32)]
    )


def flat_params(model):
    """The parameters as one host vector (a copy: the steps donate them)."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return np.concatenate([np.asarray(x).ravel() for x in leaves])


def train(name, mode, cfg, tx, k, data, progress, reference=None):
    """mode: "batch" (a), "weighted" (b) or "naive" (c). (b) and (c) share
    ``tx``, so that they share the compiled steps. With ``reference`` (the
    per-step parameters of (a)) records the distance to them."""
    train_tokens, eval_tokens = data
    model = CharLM(cfg, nnx.Rngs(0))
    if mode == "batch":
        opt = nnx.Optimizer(model, optax.adam(cfg.lr), wrt=nnx.Param)
    else:
        opt = oa_nnx.Optimizer(model, tx)
    micro = cfg.batch // k
    hist = {"loss": [], "params": [], "dist": [], "eval": [], "b_simple": []}
    hist["tokens"] = []  # real tokens per window
    start = time.perf_counter()
    n_batches = sum(
        len(windows(train_tokens, cfg, k, e)) for e in range(cfg.epochs)
    )
    bar = tqdm(
        total=n_batches, desc=f"{name:>34}", unit="step", disable=not progress
    )
    for epoch in range(cfg.epochs):
        for batch in windows(train_tokens, cfg, k, epoch):
            full = len(batch) == cfg.batch
            if mode == "batch":
                loss = big_step(
                    model, opt, *split_batch(pad_rows(batch, cfg.batch))
                )
            else:
                losses, counts = [], []
                for i in range(0, len(batch), micro):
                    x, y, mask = split_batch(batch[i : i + micro])
                    weight = mask.sum() if mode == "weighted" else np.float32(1)
                    losses.append(micro_step(model, opt, x, y, mask, weight))
                    counts.append(mask.sum())
                if not full:
                    flush(model, opt)  # the epoch's last, partial window
                loss = np.dot(losses, counts) / np.sum(counts)  # per token
                if mode == "weighted":  # tokens: accum_weight counts them
                    ns = oa.noise_scale(opt.opt_state)
                    hist["b_simple"].append(float(ns.b_simple))
            hist["tokens"].append(float(split_batch(batch)[2].sum()))
            hist["loss"].append(float(loss))
            params = flat_params(model)
            if reference is None:
                hist["params"].append(params)
            else:
                ref = reference[len(hist["dist"])]
                hist["dist"].append(float(np.max(np.abs(params - ref))))
            bar.update()
        hist["eval"].append(float(eval_loss(model, *split_batch(eval_tokens))))
    bar.close()
    hist["wall"] = time.perf_counter() - start
    hist["steps"] = len(hist["loss"])
    return hist


def gradient_errors(cfg, k, tokens):
    """Window gradient of (b) and (c), from ``oa.accumulate``, against (a)'s,
    at the initialization: relative L2 error."""
    model = CharLM(cfg, nnx.Rngs(0))
    batch = tokens[: cfg.batch]
    reference = nnx.as_pure(grad_of(model, *split_batch(batch)))
    acc = oa.accumulate(k)
    update = jax.jit(lambda g, s, w: acc.update(g, s, accum_weight=w))
    errors = {}
    for mode in ("weighted", "naive"):
        state = acc.init(reference)
        micro = cfg.batch // k
        for i in range(0, cfg.batch, micro):
            x, y, mask = split_batch(batch[i : i + micro])
            grads = nnx.as_pure(grad_of(model, x, y, mask))
            weight = mask.sum() if mode == "weighted" else np.float32(1)
            window, state = update(grads, state, weight)
        diff = optax.tree.norm(optax.tree.sub(window, reference))
        errors[mode] = float(diff / optax.tree.norm(reference))
    return errors


# ----------------------------------------------------------------- report --


def plot(histories, path, title):
    fig, (ax_loss, ax_gap, ax_dist) = plt.subplots(1, 3, figsize=(14, 4.2))
    styles = {"(a)": ("-", "C0"), "(b)": ("--", "C1"), "(c)": (":", "C2")}
    loss_a = np.asarray(next(iter(histories.values()))["loss"])
    for name, hist in histories.items():
        style, color = styles[name[:3]]
        steps = np.arange(1, hist["steps"] + 1)
        kw = dict(linestyle=style, color=color, label=name)
        ax_loss.plot(steps, hist["loss"], **kw)
        if hist["dist"]:
            gap = np.abs(np.asarray(hist["loss"]) - loss_a)
            ax_gap.plot(steps, np.maximum(gap, 1e-9), **kw)
            ax_dist.plot(steps, np.maximum(hist["dist"], 1e-12), **kw)
    ax_loss.set(
        xlabel="optimizer step",
        ylabel="train loss per real token",
        title="Train loss (the three overlap)",
    )
    ax_gap.set(
        xlabel="optimizer step",
        ylabel="|loss - loss of (a)|",
        yscale="log",
        title="Loss gap to (a), batch of B",
    )
    ax_dist.set(
        xlabel="optimizer step",
        ylabel="max |params - params of (a)|",
        yscale="log",
        title="Parameter distance to (a)",
    )
    for ax in (ax_loss, ax_gap, ax_dist):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def print_noise_scale(hist, per_line=8):
    """(b)'s B_simple after each window, in tokens, next to the window's
    real tokens."""
    values = hist["b_simple"]
    print(
        f"B_simple of (b) per window, in tokens (decay 0.9; a window holds "
        f"{np.mean(hist['tokens']):.0f} real tokens on average):"
    )
    for i in range(0, len(values), per_line):
        cells = [
            f"{i + j + 1:>3}: {v:>7.0f}"
            for j, v in enumerate(values[i : i + per_line])
        ]
        print("  " + "  ".join(cells))


def plot_noise_scale(hist, path, title):
    fig, (ax_loss, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = np.arange(1, hist["steps"] + 1)
    ax_loss.plot(steps, hist["loss"], color="C1")
    ax_loss.set(
        xlabel="optimizer step (window)",
        ylabel="train loss per real token",
        title="Train loss",
    )
    b = np.asarray(hist["b_simple"])
    ok = np.isfinite(b) & (b > 0)
    ax_b.plot(steps[ok], b[ok], color="C1", label="B_simple (EMA, decay 0.9)")
    ax_b.plot(
        steps,
        hist["tokens"],
        color="0.5",
        linestyle=":",
        label="real tokens per window",
    )
    ax_b.set(
        xlabel="optimizer step (window)",
        ylabel="tokens",
        yscale="log",
        title="Gradient noise scale B_simple",
    )
    for ax in (ax_loss, ax_b):
        ax.grid(alpha=0.3)
    ax_b.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def mesh_report(cfg, tokens, k=4):
    """Compiles one step of k micro-batches on a data=2 x fsdp=4 mesh, with
    and without ``oa.GatherOnce``, and prints the kernels' collectives per
    step and the per-device memory (nothing is run)."""
    from jax.sharding import AxisType, NamedSharding

    axes = ("data", "fsdp")
    mesh = jax.make_mesh(
        (2, 4), axes, (AxisType.Explicit,) * 2, devices=jax.devices()[:8]
    )
    graphdef, params = nnx.split(CharLM(cfg, nnx.Rngs(0)))

    def sharded(p):
        return any(jax.typeof(p).sharding.spec.partitions)

    def loss_fn(params, batch):  # the sharded kernels gathered
        params = jax.tree.map(
            lambda p: oa.fsdp_gather(p, axes) if sharded(p) else p, params
        )
        return token_loss(nnx.merge(graphdef, params), *batch)

    def put(path, a):  # kernels over fsdp (their first axis), others whole
        kernel = "kernel" in jax.tree_util.keystr(path) and a.shape[0] % 4 == 0
        spec = jax.P("fsdp") if kernel else jax.P()
        return jax.device_put(a, NamedSharding(mesh, spec))

    print(f"--mesh: data=2 x fsdp=4, one step of {k} micro-batches")
    with jax.set_mesh(mesh):
        params = jax.tree_util.tree_map_with_path(put, params)
        rows = NamedSharding(mesh, jax.P(axes))
        batch = split_batch(tokens[: 2 * 8 * k])
        batch = tuple(jax.device_put(a, rows) for a in batch)
        for name, hold in (("default", None), ("gather_once", axes)):
            step = oa.microbatched_value_and_grad(
                loss_fn,
                k,
                interleave=True,
                weight_fn=lambda b: jnp.sum(b[2]),  # per-token mean
                gather_once=hold and oa.GatherOnce(hold),
            )
            compiled = jax.jit(step).lower(params, batch).compile()
            print(f"  {name:12s} {census_line(compiled, mesh, k)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument(
        "--budget-kib",
        type=float,
        default=None,
        help="memory budget of one step, KiB (default: 40%% "
        "of the whole-batch step)",
    )
    parser.add_argument(
        "--out", default=".", help="directory for transformer_lm.png"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model and data set (a smoke test)",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--mesh",
        action="store_true",
        help="compile the step on 8 devices with and without gather_once",
    )
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    if args.epochs is not None:
        cfg = dataclasses.replace(cfg, epochs=args.epochs)

    tokens, lengths = load_documents(
        cfg.context, max_rows=4 * (cfg.n_train + cfg.n_eval)
    )
    if args.mesh:
        return mesh_report(cfg, tokens)
    train_tokens = tokens[: cfg.n_train]
    eval_tokens = tokens[cfg.n_train : cfg.n_train + cfg.n_eval]
    real = lengths[: cfg.n_train] - 1
    print(
        f"{len(tokens)} sequences of the documents in "
        f"{sysconfig.get_paths()['stdlib']}/*.py; {cfg.n_train} for "
        f"training (real tokens per sequence {real.min()}..{real.max()}, "
        f"mean {real.mean():.1f} of {cfg.context}), {cfg.n_eval} held out"
    )
    model = CharLM(cfg, nnx.Rngs(0))
    n_params = sum(p.size for p in jax.tree.leaves(nnx.state(model)))
    k, whole, budget = plan_window(cfg, model, train_tokens, args.budget_kib)
    micro = cfg.batch // k
    print(
        f"model: {cfg.layers} layer(s), dim {cfg.dim}, {n_params} params; "
        f"B = {cfg.batch} sequences per optimizer step"
    )
    print(
        f"memory budget {budget / 1024:.0f} KiB (the whole-batch step "
        f"needs {whole / 1024:.0f} KiB): oa.plan_microbatches picks "
        f"k = {k} micro-batches of {micro} sequences"
    )

    errors = gradient_errors(cfg, k, train_tokens)
    print(
        f"gradient error vs (a) at init: weighted {errors['weighted']:.2e},"
        f" naive {errors['naive']:.2e}  (relative L2)"
    )

    names = {
        "batch": f"(a) batch {cfg.batch}",
        "weighted": f"(b) {micro} x accumulate({k}), weighted",
        "naive": f"(c) {micro} x accumulate({k}), naive",
    }
    data = (train_tokens, eval_tokens)
    # (b) also estimates the gradient noise scale (no effect on the updates).
    tx = oa.chain(oa.accumulate(k, noise_scale_decay=0.9), optax.adam(cfg.lr))
    hists, reference = {}, None
    for mode, name in names.items():
        hists[name] = train(
            name, mode, cfg, tx, k, data, not args.no_progress, reference
        )
        reference = hists[names["batch"]]["params"]

    header = (
        f"{'run':<34}  {'opt steps':>9}  {'train loss':>10}  "
        f"{'eval loss':>9}  {'max |dparams| vs (a)':>20}  "
        f"{'grad err':>8}  {'wall s':>6}"
    )
    print(header)
    print("-" * len(header))
    err = {
        names["batch"]: 0.0,
        names["weighted"]: errors["weighted"],
        names["naive"]: errors["naive"],
    }
    for name, h in hists.items():
        d = h["dist"][-1] if h["dist"] else 0.0
        print(
            f"{name:<34}  {h['steps']:>9}  {h['loss'][-1]:>10.4f}  "
            f"{h['eval'][-1]:>9.4f}  {d:>20.2e}  {err[name]:>8.1e}  "
            f"{h['wall']:>6.1f}"
        )

    weighted = hists[names["weighted"]]
    print_noise_scale(weighted)

    os.makedirs(args.out, exist_ok=True)
    plot_noise_scale(
        weighted,
        os.path.join(args.out, "transformer_lm_noise_scale.png"),
        f"{names['weighted']}: gradient noise scale from the windows",
    )
    path = os.path.join(args.out, "transformer_lm.png")
    plot(
        hists,
        path,
        f"Char-level LM on the stdlib sources: B = {cfg.batch} vs "
        f"{k} x {micro} accumulated",
    )
    print(f"saved {path}")
    return hists, errors


if __name__ == "__main__":
    main()
