"""B2: in-step microbatching of a gradient computation.

An MLP of ~2.1M float32 parameters (512-1024-1024-512-10, GELU, softmax
cross-entropy, mean over the batch), a global batch of 1024 examples, and
five ways of computing the loss and its gradient, each jitted:

* ``full batch``: ``jax.value_and_grad(loss)`` on the whole batch;
* ``optax microbatch``: ``optax.microbatching.microbatch`` of
  ``jax.value_and_grad(loss)`` over the batch argument, micro-batches of
  1024 / 8 examples, ``MEAN`` accumulator: optax's own in-step
  microbatching of a gradient, the reference for ``oa.microbatched``;
* ``optax micro_grad``: ``optax.microbatching.micro_grad``, which computes
  *per-example* gradients (for per-example clipping) and means them: a
  different algorithm, shown for its cost only;
* ``oa.microbatched``: ``oa.microbatched_value_and_grad(loss, 8)``;
* ``lax.scan by hand``: the least a scan over 8 micro-batches can do (sum
  the losses and gradients, divide at the end), as a reference for the cost
  of microbatching itself.

Times are medians over interleaved rounds, reported as ratios to the full
batch; memory is the compiled step's temporary bytes
(``memory_analysis().temp_size_in_bytes``; argument and output bytes are the
same for all three). The temporary bytes of ``oa.microbatched_value_and_grad``
are also shown for 2, 4, 8 and 16 micro-batches.

Run: ``python benchmarks/bench_microbatch.py [--tiny]``.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

import optaxaccum as oa  # noqa: E402

FULL = dict(widths=(512, 1024, 1024, 512, 10), batch=1024, rounds=21)
TINY = dict(widths=(8, 16, 4), batch=32, rounds=3)
NUM_MICROBATCHES = 8
SWEEP = (2, 4, 8, 16)


def loss_fn(params, batch):
    """Mean softmax cross-entropy of the MLP over the batch."""
    x, labels = batch
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"][None])
    logits = x @ params[-1]["w"] + params[-1]["b"][None]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels
    ).mean()


def optax_micro_grad(num_microbatches, batch_size):
    """``(params, batch) -> (loss, grads)`` with optax's ``micro_grad``."""
    per_example = optax.microbatching.micro_grad(
        loss_fn,
        argnums=0,
        batch_argnums=1,
        microbatch_size=batch_size // num_microbatches,
        accumulator=optax.microbatching.AccumulationType.MEAN,
    )

    def value_and_grad(params, batch):
        grads, aux = per_example(params, batch)
        return aux.values.mean(), grads

    return value_and_grad


def optax_microbatch(num_microbatches, batch_size):
    """``(params, batch) -> (loss, grads)`` with optax's ``microbatch``."""
    return optax.microbatching.microbatch(
        jax.value_and_grad(loss_fn),
        argnums=1,
        microbatch_size=batch_size // num_microbatches,
        accumulator=optax.microbatching.AccumulationType.MEAN,
    )


def scan_by_hand(num_microbatches):
    """``(params, batch) -> (loss, grads)``: a minimal ``lax.scan``."""

    def value_and_grad(params, batch):
        micro = jax.tree.map(
            lambda x: x.reshape(num_microbatches, -1, *x.shape[1:]), batch
        )

        def body(carry, microbatch):
            loss, grads = jax.value_and_grad(loss_fn)(params, microbatch)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros([]), params))
        total, _ = jax.lax.scan(body, zeros, micro)
        return jax.tree.map(lambda x: x / num_microbatches, total)

    return value_and_grad


def main(tiny: bool = False, rounds: int | None = None) -> dict:
    """Runs B2; returns the results (see ``run_all.py`` for the format)."""
    cfg = TINY if tiny else FULL
    rounds = cfg["rounds"] if rounds is None else rounds
    widths, batch_size = cfg["widths"], cfg["batch"]
    params = _common.init_mlp(widths)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    kx, ky = jax.random.split(jax.random.key(1))
    batch = (
        jax.random.normal(kx, (batch_size, widths[0]), jnp.float32),
        jax.random.randint(ky, (batch_size,), 0, widths[-1]),
    )

    def compile_fn(fn):
        return jax.jit(fn).lower(params, batch).compile()

    fns = {
        "full batch": jax.value_and_grad(loss_fn),
        "optax microbatch": optax_microbatch(NUM_MICROBATCHES, batch_size),
        "optax micro_grad": optax_micro_grad(NUM_MICROBATCHES, batch_size),
        "oa.microbatched": oa.microbatched_value_and_grad(
            loss_fn, NUM_MICROBATCHES
        ),
        "lax.scan by hand": scan_by_hand(NUM_MICROBATCHES),
    }
    compiled = {name: compile_fn(fn) for name, fn in fns.items()}

    # Sanity: all of them compute the same loss and gradients.
    ref_loss, ref_grads = compiled["full batch"](params, batch)
    for name in list(compiled)[1:]:
        loss, grads = compiled[name](params, batch)
        close = all(
            bool(jnp.allclose(a, b, rtol=1e-4, atol=1e-6))
            for a, b in zip(
                jax.tree.leaves((ref_loss, ref_grads)),
                jax.tree.leaves((loss, grads)),
                strict=True,
            )
        )
        if not close:
            raise RuntimeError(f"{name} disagrees with the full-batch result")

    variants = {
        name: _common.Timed(c, lambda: (params, batch))
        for name, c in compiled.items()
    }
    seconds = _common.time_interleaved(variants, rounds=rounds, warmup=2)
    mem = {name: _common.memory_stats(c) for name, c in compiled.items()}
    sweep = {
        n: _common.memory_stats(
            compiled["oa.microbatched"]
            if n == NUM_MICROBATCHES
            else compile_fn(oa.microbatched_value_and_grad(loss_fn, n))
        )["temp"]
        for n in SWEEP
    }

    t_full, temp_full = seconds["full batch"], mem["full batch"]["temp"]
    rows = [
        [
            f"{name} (n={NUM_MICROBATCHES})" if name != "full batch" else name,
            f"{1e3 * t:.2f}",
            f"{t / t_full:.2f}x",
            _common.format_bytes(mem[name]["temp"]),
            f"{mem[name]['temp'] / temp_full:.2f}x",
        ]
        for name, t in seconds.items()
    ]
    rows += [
        [
            f"oa.microbatched (n={n}), memory only",
            "",
            "",
            _common.format_bytes(temp),
            f"{temp / temp_full:.2f}x",
        ]
        for n, temp in sweep.items()
    ]
    headers = ["variant", "ms/step", "time vs full", "temp", "temp vs full"]

    t_ours, t_optax = seconds["oa.microbatched"], seconds["optax microbatch"]
    t_scan = seconds["lax.scan by hand"]
    temps = [sweep[n] for n in SWEEP]
    targets = [
        _common.target(
            "oa.microbatched <= 1.1x optax microbatch time",
            t_ours / t_optax,
            t_ours <= 1.1 * t_optax,
        ),
        _common.target(
            "oa.microbatched temp <= optax microbatch temp",
            mem["oa.microbatched"]["temp"] / mem["optax microbatch"]["temp"],
            mem["oa.microbatched"]["temp"] <= mem["optax microbatch"]["temp"],
        ),
        _common.target(
            "oa.microbatched <= 1.2x full-batch time",
            t_ours / t_full,
            t_ours <= 1.2 * t_full,
        ),
        _common.target(
            "oa.microbatched temp <= 1/2 of full-batch temp",
            mem["oa.microbatched"]["temp"] / temp_full,
            mem["oa.microbatched"]["temp"] <= temp_full / 2,
        ),
        _common.target(
            f"temp shrinks with more micro-batches {SWEEP}",
            " > ".join(_common.format_bytes(t) for t in temps),
            temps == sorted(set(temps), reverse=True),
        ),
    ]
    ratios = {
        f"B2 {n} time": t / t_full
        for n, t in seconds.items()
        if n != "full batch"
    }
    ratios.update(
        {
            f"B2 {n} temp": mem[n]["temp"] / temp_full
            for n in seconds
            if n != "full batch"
        }
    )
    return {
        "name": "B2",
        "title": (
            f"B2: microbatching, MLP {'-'.join(map(str, widths))} "
            f"({n_params:,} float32 params), batch {batch_size} in "
            f"{NUM_MICROBATCHES} micro-batches; median of {rounds} "
            "interleaved rounds"
        ),
        "headers": headers,
        "rows": rows,
        "ratios": ratios,
        "ratio_label": "time or temp bytes / full batch",
        "targets": targets,
        "seconds": seconds,
        "memory": mem,
        "temp_by_num_microbatches": sweep,
        "notes": [
            f"oa.microbatched takes {t_ours / t_scan:.2f}x the time of the "
            f"minimal lax.scan by hand ({t_scan / t_full:.2f}x the full "
            f"batch), and {t_ours / t_optax:.2f}x the time of optax's "
            "microbatch of jax.value_and_grad; optax's micro_grad computes "
            "per-example gradients (for per-example clipping), a different "
            "algorithm, shown for its cost only.",
        ],
    }


if __name__ == "__main__":
    _common.print_result(main(tiny="--tiny" in sys.argv[1:]))
