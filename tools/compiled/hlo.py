"""Queries of compiled XLA:GPU and XLA:TPU programs, on the library's reader
(``optaxaccum._src.hlo``: :class:`Module`, :class:`Instr`).

* where does an op run: outside every ``conditional`` (on every call) or
  only inside one of its branches (``placement``);
* is each dense weight's accumulation folded into the GEMM fusion that makes
  its gradient, with no loop fusion reading the gradient again (``fold``);
* what else the path a non-closing call takes does with weight-sized arrays:
  copies and passes outside the GEMMs (``non_closing``).
"""

from __future__ import annotations

import re

from optaxaccum._src.hlo import Instr, Module

__all__ = [
    "GEMM_TARGETS",
    "Instr",
    "Module",
    "branch_bodies",
    "conditionals",
    "every_call",
    "fold",
    "is_gemm",
    "is_kernel_accumulator",
    "non_closing",
    "op_name",
    "opcode_counts",
    "placement",
]

_FOLLOW = frozenset({"bitcast", "copy", "get-tuple-element", "reshape"})
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__triton")


def every_call(module: Module) -> set[str]:
    """The computations that run on every call: reachable from the
    entry without entering a conditional's branch."""
    return module.reachable(module.entry, through_branches=False)


def conditionals(module: Module) -> list[Instr]:
    """The conditionals (and the gate's loops) that run on every call."""
    return [
        i
        for name in every_call(module)
        for i in module.computations[name]
        if i.opcode == "conditional" or i.is_gate_loop
    ]


def branch_bodies(module: Module) -> set[str]:
    """Every computation a conditional's branch calls (transitively)."""
    out: set[str] = set()
    for cond in conditionals(module):
        for edge, name in cond.called:
            if edge == "branch":
                out |= module.reachable(name, through_branches=True)
    return out


def placement(
    module: Module, opcodes: tuple[str, ...], min_count: int = 2
) -> dict[str, int]:
    """How many ops of ``opcodes`` with ``min_count`` elements or more run
    on every call
    (``outside``) and how many only in a conditional's branch
    (``inside``)."""

    def count(names):
        return sum(
            1
            for n in names
            for i in module.computations[n]
            if i.opcode in opcodes and max(i.counts, default=0) >= min_count
        )

    every = every_call(module)
    return {
        "outside": count(every),
        "inside": count(branch_bodies(module) - every),
        "conditionals": len(conditionals(module)),
    }


def is_gemm(instr: Instr) -> bool:
    """A matrix product: a GEMM fusion (Triton or cuBLAS) or a cuBLAS
    custom call, as XLA:GPU emits them."""
    if instr.opcode == "custom-call":
        return any(t in instr.attrs for t in GEMM_TARGETS)
    if instr.opcode == "fusion" and instr.kind == "kCustom":
        return "gemm" in instr.attrs
    return False


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def op_name(instr: Instr) -> str:
    m = _OP_NAME.search(instr.attrs)
    return m.group(1).replace("\\'", "'") if m else ""


def fold(module: Module, is_accumulator) -> dict[str, str]:
    """Where each accumulator's update runs, per entry parameter whose
    argument path (``op_name``) ``is_accumulator`` accepts.

    Returns ``{path: where}``, ``where`` being ``"gemm"`` (the GEMM fusion
    that makes the gradient reads the accumulator: the update is its
    epilogue), ``"split-k"`` (the fusion that sums a split-K GEMM's partial
    products adds them to the accumulator: no pass of its own), ``"merged"``
    (a loop fusion slices the gradient out of a GEMM XLA shares between
    several weights), ``"loop"`` (a loop fusion reads the gradient a GEMM
    wrote and the accumulator: a pass over the gradient of its own), or the
    reader's opcode otherwise.
    """
    instrs = module.computations[module.entry]
    by_name = {i.name: i for i in instrs}

    def origin(name):
        while name in by_name and by_name[name].opcode in _FOLLOW:
            if not by_name[name].operands:
                break
            name = by_name[name].operands[0]
        return by_name.get(name)

    out = {}
    for param in instrs:
        if param.opcode != "parameter" or not is_accumulator(op_name(param)):
            continue
        readers = [
            i
            for i in instrs
            if i.opcode not in _FOLLOW
            and any(origin(o) is param for o in i.operands)
        ]
        out[op_name(param)] = _where(readers, param, origin)
    return out


def _where(readers, param, origin) -> str:
    if any(is_gemm(r) for r in readers):
        return "gemm"
    size = param.counts[0]
    for r in readers:
        if r.opcode != "fusion":
            continue
        for src in (origin(o) for o in r.operands):
            if src is None or not is_gemm(src):
                continue
            (count,) = src.counts[:1] or [0]
            lead = _lead_dim(src.shape)
            if count == size:
                return "loop"
            if count % size == 0 and int(lead) == count // size:
                return "split-k"
            if count > size:
                return "merged"
    return ",".join(sorted({r.opcode for r in readers})) or "unread"


def _lead_dim(shape: str) -> str:
    """The first dimension of the first array of an HLO shape."""
    return shape.split("[", 1)[1].split("]", 1)[0].split(",")[0]


def is_kernel_accumulator(path: str) -> bool:
    """An accumulator of a dense layer's weight: ``acc`` (``oa.accumulate``)
    or ``acc_grads`` (``oa.MultiSteps``) of a ``kernel``."""
    return bool(re.search(r"\bacc(_grads)?\b.*\bkernel\b", path))


def opcode_counts(module: Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for instrs in module.computations.values():
        for i in instrs:
            out[i.opcode] = out.get(i.opcode, 0) + 1
    return out


# Control flow and views: no pass over the data of their own.
_NO_PASS = frozenset(
    {
        "bitcast",
        "call",
        "conditional",
        "get-tuple-element",
        "opt-barrier",
        "parameter",
        "reshape",
        "tuple",
        "while",
    }
)


def non_closing(
    module: Module, shapes: set[tuple[int, ...]], closing_ops: tuple[str, ...]
) -> dict[str, int]:
    """What the path of a call that does not close its window does with
    arrays of the weights' ``shapes`` (sorted dimensions), outside the
    GEMMs: the entry's own instructions and those of every conditional
    branch that holds none of ``closing_ops`` (the optimizer's, e.g.
    Adam's ``sqrt``).

    Returns:
      ``{"copies": n, "passes": n}``: weight-sized ``copy`` instructions
      (and fusions that only copy), and other instructions (loop fusions)
      that read or write a weight-sized array.
    """

    def holds_closing(name: str) -> bool:
        return any(
            i.opcode in closing_ops
            for c in module.reachable(name, through_branches=True)
            for i in module.computations.get(c, [])
        )

    paths = [module.entry]
    for cond in conditionals(module):
        paths += [
            n for e, n in cond.called if e == "branch" and not holds_closing(n)
        ]
    paths = [c for name in paths for c in _called_as_code(module, name)]
    by_name = {i.name: i for c in module.computations.values() for i in c}
    out = {"copies": 0, "passes": 0}
    for name in paths:
        for i in module.computations[name]:
            if i.opcode in _NO_PASS or is_gemm(i):
                continue
            reads = [by_name[o] for o in i.operands if o in by_name]
            if not any(d in shapes for x in [i, *reads] for d in x.dims):
                continue
            fused = {
                j.opcode
                for e, c in i.called
                if e == "calls"
                for j in module.computations.get(c, [])
            }
            copy = i.opcode in ("copy", "copy-start") or (
                i.opcode == "fusion" and fused <= {"copy", "parameter"}
            )
            out["copies" if copy else "passes"] += 1
    return out


def _called_as_code(module: Module, name: str) -> list[str]:
    """``name`` and the computations its ``call`` and async instructions
    run as code (a command buffer, an async wrapper), transitively; not
    fused computations, nor a conditional's branches or a loop's body."""
    out, todo = [name], [name]
    while todo:
        for i in module.computations.get(todo.pop(), []):
            if i.opcode not in ("call", "async-start"):
                continue
            for edge, called in i.called:
                if edge in ("to_apply", "calls") and called not in out:
                    out.append(called)
                    todo.append(called)
    return out
