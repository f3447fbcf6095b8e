"""Pipelined timing of gated steps: device throughput, not launch latency.

A per-call timing (one call, ``block_until_ready``, a pause) measures the
launch latency of an accelerator, which is the same for every variant of a
step (about 1.85x the floor for all of them on an H200). Here each variant
runs ``n`` calls back to back, each fed the previous call's (donated)
outputs, with one sync at the end: seconds per call is then the device's
work per call. Every accumulate of a "non-closing" variant has ``every_k =
2**30`` (no call closes its window); a "closing" one has ``every_k = 1``.

Used by ``bench_gpu.py`` (at >= 512 MiB per tree) and by B1
(``bench_step.py``) for its pipelined figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optaxaccum as oa

NEVER = 2**30  # an every_k no run reaches: every call is non-closing
LEARNING_RATE = 1e-3


def device_info() -> dict[str, str]:
    """The backend and the kind of its first device (e.g. ``NVIDIA H200``)."""
    return {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
    }


def tree(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, Any]:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {
        name: 0.01 * jax.random.normal(key, shape, jnp.float32)
        for key, (name, shape) in zip(keys, sorted(shapes.items()), strict=True)
    }


# The donated arguments come first, in the order of the outputs: JAX pairs
# each donated input buffer with the first not yet paired output of the same
# shape and dtype, so ``step(grads, opt_state, params) -> (params, opt_state)``
# would pair the accumulator's buffers with the new params, Adam's moments
# with the accumulator, ... and XLA would copy every tree on every call.
def fused_step(tx):
    """``step(params, opt_state, grads)`` through ``oa.apply_gradients``."""

    def step(params, opt_state, grads):
        return oa.apply_gradients(tx, grads, opt_state, params)

    return step


def plain_step(tx):
    """``step(params, opt_state, grads)``: ``tx.update`` then
    ``optax.apply_updates``."""

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def steps() -> dict[str, tuple[Callable, Any, bool]]:
    """``name -> (step(params, state, grads), tx, gated)``."""
    adam = optax.adam(LEARNING_RATE)

    def acc(k, **kw):
        return oa.chain(oa.accumulate(k, **kw), adam)

    readme = oa.chain(
        oa.dynamic_loss_scale(), oa.agc(0.01), oa.accumulate(NEVER), adam
    )
    table = {
        "Adam step alone": (fused_step(adam), adam, False),
        "fused non-closing": (fused_step(acc(NEVER)), acc(NEVER), True),
        "fused closing": (fused_step(acc(1)), acc(1), True),
        "fused+noise_scale non-closing": (
            fused_step(acc(NEVER, noise_scale_decay=0.9)),
            acc(NEVER, noise_scale_decay=0.9),
            True,
        ),
        "README chain fused non-closing": (fused_step(readme), readme, True),
        "plain non-closing": (plain_step(acc(NEVER)), acc(NEVER), True),
        "oa.MultiSteps fused non-closing": (
            fused_step(oa.MultiSteps(adam, NEVER)),
            oa.MultiSteps(adam, NEVER),
            True,
        ),
        "optax.MultiSteps non-closing": (
            plain_step(optax.MultiSteps(adam, NEVER)),
            optax.MultiSteps(adam, NEVER),
            False,
        ),
    }
    return table


def pipelined(compiled, args, feed, *, calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the seconds per call of ``calls`` calls of
    ``compiled`` back to back, each given ``feed(out, args)`` of the one
    before, one sync at the end. Returns the seconds and leaves ``args``
    usable (the last outputs are fed on)."""
    args = jax.block_until_ready(feed(compiled(*args), args))  # warm up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            args = feed(compiled(*args), args)
        jax.block_until_ready(args)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def conditionals(compiled) -> int:
    """How many branches the optimized HLO holds: ``conditional``
    instructions and the fused step's loop of 0 or 1 trips."""
    text = compiled.as_text()
    loops = [ln for ln in text.splitlines() if " while(" in ln]
    gate_loops = sum("optaxaccum_gate/while" in ln for ln in loops)
    return text.count(" conditional(") + gate_loops


def _feed_step(out, args):
    return out[0], out[1], args[2]


def _feed_floor(out, args):
    return out, args[1]


def measure(
    shapes: dict[str, tuple[int, ...]],
    *,
    calls: int = 30,
    rounds: int = 3,
    only: tuple[str, ...] | None = None,
) -> dict[str, dict[str, float]]:
    """Per step: seconds per call (pipelined), conditionals in the compiled
    HLO, temporary bytes, whether it is gated; with ``floor`` first."""
    grads = tree(shapes, 1)
    add = jax.jit(lambda a, g: jax.tree.map(jnp.add, a, g), donate_argnums=0)
    floor = add.lower(tree(shapes, 0), grads).compile()
    out = {
        "floor": {
            "seconds": pipelined(
                floor,
                (tree(shapes, 0), grads),
                _feed_floor,
                calls=calls,
                rounds=rounds,
            ),
            "conditionals": conditionals(floor),
            "temp": floor.memory_analysis().temp_size_in_bytes,
            "gated": False,
        }
    }
    for name, (step, tx, gated) in steps().items():
        if only is not None and name not in only:
            continue
        params = tree(shapes, 0)
        state = tx.init(params)
        jitted = jax.jit(step, donate_argnums=(0, 1))
        compiled = jitted.lower(params, state, grads).compile()
        seconds = pipelined(
            compiled,
            (params, state, grads),
            _feed_step,
            calls=calls,
            rounds=rounds,
        )
        out[name] = {
            "seconds": seconds,
            "conditionals": conditionals(compiled),
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "gated": gated,
        }
        del params, state, compiled
    return out
