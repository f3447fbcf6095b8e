"""The end-to-end micro-step: the gradient and its accumulation in one jit.

An MLP of ``layers`` tanh layers ``width`` wide (float32, no biases), a
mean-square loss, one micro-batch of ``rows`` rows. Each variant is timed
pipelined (``_pipeline.pipelined``: calls back to back, one sync):

* ``gradient alone``: ``jax.grad`` of the loss (the backward pass's own
  work, the gradient written to fresh buffers);
* ``gradient + donated add``: ``acc + g`` by hand, the accumulator
  donated (the least an accumulating step can cost);
* ``oa fused non-closing``: ``oa.apply_gradients`` of
  ``oa.chain(oa.accumulate(NEVER), adam)`` (every call non-closing);
* ``oa fused non-closing, weighted``: the same with a traced
  ``accum_weight`` (a token count);
* ``optax.MultiSteps non-closing``: for reference.

Per variant it also reads the compiled program: conditionals, weight-sized
copies, and whether each weight's accumulation sits in its gradient's GEMM
(the accumulator is an operand of the GEMM's fusion or cuBLAS call) or in
a separate fusion after it.
"""

from __future__ import annotations

import re
from typing import Any

import _pipeline
import jax
import jax.numpy as jnp
import optax

import optaxaccum as oa


def _loss(params, x):
    h = x
    for i in range(len(params)):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean(h**2)


def _grad(params, x):
    return jax.grad(_loss)(params, x)


def census(compiled, width: int) -> dict[str, int]:
    """Counts in the compiled program of a step: conditionals, copies of a
    weight-sized array, GEMMs that take an accumulator as an operand
    (folded), and other fusions that read one (a pass of their own)."""
    text = compiled.as_text()
    acc = r"[^)]*acc__"
    return {
        "conditionals": text.count(" conditional("),
        "weight copies": len(
            re.findall(rf"f32\[{width},{width}\]\{{1,0\}} copy\(", text)
        ),
        "accumulations in the GEMM": len(
            re.findall(
                rf"= .*(?:gemm_fusion|cublas|custom-call)\S*\({acc}", text
            )
        ),
        "other fusions reading the accumulator": len(
            re.findall(rf"%(?:loop|input)\S* = .*fusion\({acc}", text)
        ),
    }


def _variants(rows: int) -> dict[str, tuple[Any, Any]]:
    """``name -> (step, tx)``; ``step(params, state, x, w)``."""
    adam = optax.adam(_pipeline.LEARNING_RATE)
    tx = oa.chain(oa.accumulate(_pipeline.NEVER), adam)
    ms = optax.MultiSteps(adam, _pipeline.NEVER)

    def fused(p, s, x, w):
        return oa.apply_gradients(tx, _grad(p, x), s, p)

    def weighted(p, s, x, w):
        return oa.apply_gradients(tx, _grad(p, x), s, p, accum_weight=w)

    def multisteps(p, s, x, w):
        updates, s = ms.update(_grad(p, x), s, p)
        return optax.apply_updates(p, updates), s

    def add(p, s, x, w):
        return p, jax.tree.map(jnp.add, s, _grad(p, x))

    return {
        "gradient + donated add": (add, None),
        "oa fused non-closing": (fused, tx),
        "oa fused non-closing, weighted": (weighted, tx),
        "optax.MultiSteps non-closing": (multisteps, ms),
    }


def measure(
    width: int, layers: int, rows: int, *, calls: int, rounds: int = 3
) -> dict[str, dict[str, Any]]:
    """Seconds per call (pipelined) and the census of each variant, with
    ``gradient alone`` first."""
    shapes = {f"w{i}": (width, width) for i in range(layers)}
    x = jax.random.normal(jax.random.key(2), (rows, width), jnp.float32)
    grad = jax.jit(_grad).lower(_pipeline.tree(shapes, 0), x).compile()
    out = {
        "gradient alone": {
            "seconds": _pipeline.pipelined(
                grad,
                (_pipeline.tree(shapes, 0), x),
                lambda o, a: (o, a[1]),  # the gradient as the next weights
                calls=calls,
                rounds=rounds,
            )
        }
    }
    weight = jnp.float32(rows)
    for name, (step, tx) in _variants(rows).items():
        params = _pipeline.tree(shapes, 0)
        state = tx.init(params) if tx else jax.tree.map(jnp.zeros_like, params)
        jitted = jax.jit(step, donate_argnums=(0, 1))
        compiled = jitted.lower(params, state, x, weight).compile()
        out[name] = {
            "seconds": _pipeline.pipelined(
                compiled,
                (params, state, x, weight),
                lambda o, a: (o[0], o[1], a[2], a[3]),
                calls=calls,
                rounds=rounds,
            ),
            **census(compiled, width),
        }
        del params, state, compiled
    return out
