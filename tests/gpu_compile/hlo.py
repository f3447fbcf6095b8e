"""Reads a compiled XLA program (``jax.jit(f).lower(...).compile().as_text()``).

The text is parsed into computations of instructions with their shapes,
operands and called computations. Two questions are answered from it:

* where does an op run: outside every ``conditional`` (on every call) or
  only inside one of its branches (``placement``);
* is each dense weight's accumulation folded into the GEMM fusion that makes
  its gradient, with no loop fusion reading the gradient again (``fold``);
* what else the path a non-closing call takes does with weight-sized arrays:
  copies and passes outside the GEMMs (``non_closing``).
"""

from __future__ import annotations

import dataclasses
import math
import re

_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_KIND = re.compile(r"\bkind=(k\w+)")
_FOLLOW = frozenset({"bitcast", "copy", "get-tuple-element", "reshape"})
_GATE_LOOP = 'optaxaccum_gate/while"'
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__triton")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str

    @property
    def counts(self) -> list[int]:
        """The element count of each array in the shape (one for an
        array, one per element of a tuple)."""
        return [
            math.prod(int(d) for d in dims.split(",") if d)
            for _, dims in _SHAPE.findall(self.shape)
        ]

    @property
    def dims(self) -> list[tuple[int, ...]]:
        """The sorted dimensions of each array in the shape (a transposed
        array has the dimensions of the original)."""
        return [
            tuple(sorted(int(d) for d in dims.split(",") if d))
            for _, dims in _SHAPE.findall(self.shape)
        ]

    @property
    def kind(self) -> str | None:
        m = _KIND.search(self.attrs)
        return m.group(1) if m else None

    @property
    def is_gate_loop(self) -> bool:
        """The fused step's loop of 0 or 1 trips (``flags.loop_or_call``,
        found by its name scope): a branch, like a conditional's."""
        return self.opcode == "while" and _GATE_LOOP in self.attrs

    @property
    def called(self) -> list[tuple[str, str]]:
        """``(edge, computation)``: ``edge`` is ``"branch"`` for the
        branches of a conditional and the body of the gate's loop, the
        attribute's name otherwise."""
        out = []
        for key, name in _CALLED.findall(self.attrs):
            branch = key.endswith("_computation") or (
                key == "body" and self.is_gate_loop
            )
            out.append(("branch" if branch else key, name))
        for group in _BRANCHES.findall(self.attrs):
            out += [("branch", n) for n in _NAME.findall(group)]
        return out


def _closing(text: str, depth: int) -> int:
    """The index of the ``)`` that brings ``depth`` open parentheses to 0."""
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i
    return len(text)


def _split_instr(line: str) -> Instr | None:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    if not line.startswith("%") or " = " not in line:
        return None
    name, rest = line[1:].split(" = ", 1)
    if rest.startswith("("):  # a tuple shape: up to its matching ")"
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 2 :]
    else:
        shape, rest = rest.split(" ", 1)
    opcode, rest = rest.split("(", 1)
    end = _closing(rest, 1)
    return Instr(
        name, shape, opcode, _NAME.findall(rest[:end]), rest[end + 1 :]
    )


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str

    @classmethod
    def parse(cls, text: str) -> Module:
        comps: dict[str, list[Instr]] = {}
        entry, current = "", None
        for line in text.splitlines():
            if line.endswith("{") and (
                line.startswith("%") or line.startswith("ENTRY %")
            ):
                current = _NAME.search(line).group(1)  # type: ignore[union-attr]
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            elif line.startswith("}"):
                current = None
            elif current is not None:
                instr = _split_instr(line)
                if instr is not None:
                    comps[current].append(instr)
        if not entry:
            raise ValueError("no ENTRY computation in the HLO text")
        return cls(comps, entry)

    def reachable(self, start: str, through_branches: bool) -> set[str]:
        """The computations ``start`` calls, transitively (with ``start``);
        a conditional's branches only if ``through_branches``."""
        seen, todo = {start}, [start]
        while todo:
            for instr in self.computations.get(todo.pop(), []):
                for edge, name in instr.called:
                    if edge == "branch" and not through_branches:
                        continue
                    if name not in seen:
                        seen.add(name)
                        todo.append(name)
        return seen

    def every_call(self) -> set[str]:
        """The computations that run on every call: reachable from the
        entry without entering a conditional's branch."""
        return self.reachable(self.entry, through_branches=False)

    def conditionals(self) -> list[Instr]:
        return [
            i
            for name in self.every_call()
            for i in self.computations[name]
            if i.opcode == "conditional" or i.is_gate_loop
        ]

    def branch_bodies(self) -> set[str]:
        """Every computation a conditional's branch calls (transitively)."""
        out: set[str] = set()
        for cond in self.conditionals():
            for edge, name in cond.called:
                if edge == "branch":
                    out |= self.reachable(name, through_branches=True)
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

    every = module.every_call()
    return {
        "outside": count(every),
        "inside": count(module.branch_bodies() - every),
        "conditionals": len(module.conditionals()),
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
            lead = _SHAPE.search(src.shape).group(2).split(",")[0]  # type: ignore[union-attr]
            if count == size:
                return "loop"
            if count % size == 0 and int(lead) == count // size:
                return "split-k"
            if count > size:
                return "merged"
    return ",".join(sorted({r.opcode for r in readers})) or "unread"


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
    for cond in module.conditionals():
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
