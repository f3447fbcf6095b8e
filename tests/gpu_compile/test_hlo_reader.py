"""The compiled-program reader (``optaxaccum._src.hlo``) and its queries
(``tools/compiled/hlo.py``) on XLA:CPU programs: it runs in
the default suite, where the GPU and TPU compilers are not installed."""

import jax
import jax.numpy as jnp
import optax

import optaxaccum as oa
from tools.compiled import hlo


def _module(fn, *args):
    return hlo.Module.parse(jax.jit(fn).lower(*args).compile().as_text())


def test_placement_of_adam_in_the_gate():
    tx = oa.chain(oa.accumulate(4), optax.adam(1e-3))
    p = {"w": jnp.ones((16, 32))}
    module = _module(
        lambda p, s, g: oa.apply_gradients(tx, g, s, p), p, tx.init(p), p
    )
    where = hlo.placement(module, ("sqrt", "rsqrt"), min_count=16 * 32)
    assert where == {"outside": 0, "inside": 1, "conditionals": 1}, where


def test_placement_outside_without_a_branch():
    module = _module(lambda x: jnp.sqrt(x) + 1.0, jnp.ones((8, 8)))
    where = hlo.placement(module, ("sqrt",), min_count=64)
    assert where == {"outside": 1, "inside": 0, "conditionals": 0}, where


def test_fold_finds_every_kernel_accumulator():
    tx = oa.chain(oa.accumulate(4), optax.adam(1e-3))
    p = {"dense": {"kernel": jnp.ones((8, 4)), "bias": jnp.ones(4)}}

    def step(p, s, x):
        g = jax.grad(lambda p: jnp.sum(x @ p["dense"]["kernel"]))(p)
        return oa.apply_gradients(tx, g, s, p)

    module = _module(step, p, tx.init(p), jnp.ones((2, 8)))
    where = hlo.fold(module, hlo.is_kernel_accumulator)
    assert list(where) == ["s[0].acc['dense']['kernel']"], where


def test_instruction_with_a_tuple_shape():
    line = '  %t = (f32[2,3]{1,0}, s32[]) tuple(%a, %b), metadata={op_name="x"}'
    module = hlo.Module.parse(f"ENTRY %main () -> f32[] {{\n{line}\n}}\n")
    (instr,) = module.computations["main"]
    assert (instr.opcode, instr.operands, instr.counts) == (
        "tuple",
        ["a", "b"],
        [6, 1],
    )
    assert hlo.op_name(instr) == "x"
