"""The reader of compiled XLA programs (optimized HLO text, from
``jax.jit(f).lower(...).compile().as_text()``; not part of the public API).

:meth:`Module.parse` splits a module into computations of instructions
(:class:`Instr`: name, shape, opcode, operands, attributes) and the
computations each one calls, so a caller can ask which operations run on
every call (reachable from the entry computation without entering a
``conditional``'s branch) and which only inside a branch
(:func:`instructions`), which run inside a loop (:func:`loop_computations`),
and which collectives of a scheduled program have compute in flight
(:func:`overlaps`, :func:`exposure`). ``collective_census`` and
``collective_exposure`` read programs with it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

import numpy as np

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY_RE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_NAME_RE = re.compile(r"%([\w.\-]+)")
_CALLEE_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
# The name scope of the fused step's loop (flags.GATE_LOOP), in its metadata.
_GATE_LOOP = 'optaxaccum_gate/while"'
_BRANCHES_RE = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRUE_FALSE_RE = re.compile(
    r"\btrue_computation=%?([\w.\-]+).*?\bfalse_computation=%?([\w.\-]+)"
)
_KIND_RE = re.compile(r"\bkind=(k\w+)")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape, e.g. ``(f32[], f32[3,5]{1,0})`` -> 64."""
    total = 0
    for dtype, dims in _ARRAY_RE.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        total += _DTYPE_BYTES[dtype] * int(
            np.prod([int(d) for d in dims.split(",") if d])
        )
    return total


@dataclasses.dataclass
class Instr:
    """One instruction of a computation.

    Attributes:
      name: its name, without the ``%``.
      shape: its result's shape, e.g. ``f32[3,5]{1,0}`` or a tuple's
        ``(f32[], s32[])``.
      opcode: e.g. ``fusion``, ``all-reduce-start``.
      operands: the names of the instructions it reads.
      attrs: the text after its operands (``kind=``, ``calls=``,
        ``metadata=``...).
      line: the instruction's line of text.
    """

    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    line: str = ""

    @property
    def counts(self) -> list[int]:
        """The element count of each array in the shape (one for an
        array, one per element of a tuple)."""
        return [
            math.prod(int(d) for d in dims.split(",") if d)
            for _, dims in _ARRAY_RE.findall(self.shape)
        ]

    @property
    def dims(self) -> list[tuple[int, ...]]:
        """The sorted dimensions of each array in the shape (a transposed
        array has the dimensions of the original)."""
        return [
            tuple(sorted(int(d) for d in dims.split(",") if d))
            for _, dims in _ARRAY_RE.findall(self.shape)
        ]

    @property
    def kind(self) -> str | None:
        """A fusion's kind (``kLoop``, ``kCustom``...), else None."""
        m = _KIND_RE.search(self.attrs)
        return m.group(1) if m else None

    @property
    def is_gate_loop(self) -> bool:
        """The fused step's loop of 0 or 1 trips (``flags.loop_or_call``,
        found by its name scope): a branch, like a conditional's."""
        return self.opcode == "while" and _GATE_LOOP in self.attrs

    def _edges(self) -> list[tuple[str, str, int | None]]:
        """``(edge, computation, branch index)`` of every computation the
        instruction calls (see :attr:`callees` and :attr:`called`)."""
        tf = _TRUE_FALSE_RE.search(self.attrs)
        if tf:  # a predicated conditional: branch 1 is the true computation
            return [("branch", tf.group(2), 0), ("branch", tf.group(1), 1)]
        m = _BRANCHES_RE.search(self.attrs)
        if m:
            names = [n.strip().lstrip("%") for n in m.group(1).split(",")]
            return [("branch", n, i) for i, n in enumerate(names)]
        # The fused step's loop of 0 or 1 trips: its body is the gate's
        # open branch (1, as lax.cond's true branch).
        gate_loop = self.is_gate_loop
        return [
            ("branch", name, 1)
            if gate_loop and key == "body"
            else (key, name, None)
            for key, name in _CALLEE_RE.findall(self.attrs)
        ]

    @property
    def callees(self) -> list[tuple[str, int | None]]:
        """``(computation, branch index)`` of the computations it calls;
        the index is None for calls that always run (fusions,
        reductions...), 1 for ``lax.cond``'s true branch."""
        return [(name, index) for _, name, index in self._edges()]

    @property
    def called(self) -> list[tuple[str, str]]:
        """``(edge, computation)``: ``edge`` is ``"branch"`` for the
        branches of a conditional and the body of the gate's loop, the
        attribute's name otherwise (``calls``, ``to_apply``, ``body``...)."""
        return [(edge, name) for edge, name, _ in self._edges()]


def _closing(text: str, depth: int) -> int:
    """The index of the ``)`` that brings ``depth`` open parentheses to 0."""
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i
    return len(text)


def parse_instruction(line: str) -> Instr | None:
    """The instruction of one line of HLO text, else None."""
    head, sep, rest = line.partition(" = ")
    if not sep or not head.split() or not head.split()[-1].startswith("%"):
        return None
    rest = rest.lstrip()
    if rest.startswith("("):  # a tuple shape: up to its matching ")"
        end = _closing(rest, 0) + 1
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    end = _closing(rest, 1)
    return Instr(
        name=head.split()[-1].lstrip("%"),
        shape=shape,
        opcode=opcode.strip(),
        operands=_NAME_RE.findall(rest[:end]),
        attrs=rest[end + 1 :],
        line=line,
    )


@dataclasses.dataclass
class Module:
    """An HLO module: its computations' instructions, by name, and the name
    of its entry computation."""

    computations: dict[str, list[Instr]]
    entry: str

    @classmethod
    def parse(cls, text: str) -> Module:
        """Reads HLO text (``compile().as_text()``).

        Raises:
          ValueError: if the text has no ``ENTRY`` computation.
        """
        comps: dict[str, list[Instr]] = {}
        entry = None
        current = None
        for line in text.splitlines():
            if current is None:
                if (
                    line
                    and not line[0].isspace()
                    and line.rstrip().endswith("{")
                ):
                    words = line.split()
                    is_entry = words[0] == "ENTRY"
                    name = words[1 if is_entry else 0].lstrip("%")
                    if not re.match(r"^[\w.\-]+$", name):
                        continue  # e.g. "HloModule ..., {...}" has no body
                    current = comps.setdefault(name, [])
                    if is_entry:
                        entry = name
            elif line.strip() == "}":
                current = None
            elif (instr := parse_instruction(line)) is not None:
                current.append(instr)
        if entry is None:
            raise ValueError("no ENTRY computation in the HLO text")
        return cls(comps, entry)

    def reachable(self, start: str, through_branches: bool) -> set[str]:
        """The computations of the module ``start`` calls, transitively
        (with ``start``); a conditional's branches only if
        ``through_branches``."""
        seen: set[str] = set()
        todo = [start]
        while todo:
            name = todo.pop()
            if name in seen or name not in self.computations:
                continue
            seen.add(name)
            for instr in self.computations[name]:
                todo.extend(
                    callee
                    for callee, index in instr.callees
                    if through_branches or index is None
                )
        return seen


def instructions(
    text: str,
) -> Iterator[tuple[str, tuple[int, ...], str, str, str]]:
    """Every instruction of an HLO module reachable from its entry, with
    where it runs.

    Yields:
      ``(computation, branches, line, shape, opcode)`` per instruction, in
      the order of a depth-first walk from the entry computation (a
      callee's instructions right after the instruction calling it);
      ``branches`` are the ``conditional`` branches (index; 1 is
      ``lax.cond``'s true branch) that lead to it, ``()`` when it runs on
      every call. A computation is walked once per such path.
    """
    comps = Module.parse(text)
    seen: set[tuple[str, tuple[int, ...]]] = set()

    def visit(name: str, branches: tuple[int, ...]) -> Iterator:
        if (name, branches) in seen or name not in comps.computations:
            return
        seen.add((name, branches))
        for instr in comps.computations[name]:
            yield (name, branches, instr.line, instr.shape, instr.opcode)
            for callee, index in instr.callees:
                inner = branches if index is None else (*branches, index)
                yield from visit(callee, inner)

    yield from visit(comps.entry, ())


_WHILE_RE = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")


def loop_computations(text: str) -> set[str]:
    """The computations of an HLO module that run inside a ``while`` loop
    (a ``lax.scan``'s or ``lax.fori_loop``'s body, once per iteration):
    those reachable from a ``while`` instruction's body or condition."""
    module = Module.parse(text)
    found: set[str] = set()
    for instrs in module.computations.values():
        for instr in instrs:
            if instr.opcode != "while":
                continue
            for name in _WHILE_RE.findall(instr.line):
                found |= module.reachable(name, through_branches=True)
    return found


# -------------------------------------------------- the scheduled program

_COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
)
_GEMM_TARGET_RE = re.compile(r"custom_call_target=\"[^\"]*(gemm|matmul|triton)")
_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_Comps = dict[str, list[Instr]]


def _collective_of(instr: Instr, comps: _Comps) -> str | None:
    """The collective an instruction starts or is (``all-gather`` ...):
    ``X`` / ``X-start`` directly, or an ``async-start`` wrapping it."""
    for op in _COLLECTIVES:
        if instr.opcode in (op, f"{op}-start"):
            return op
    if instr.opcode == "async-start":
        for callee, _ in instr.callees:
            for inner in comps.get(callee, ()):
                if inner.opcode in _COLLECTIVES:
                    return inner.opcode
    return None


def _largest_array(shape: str) -> int:
    """Bytes of the largest array of an HLO shape (the gathered result of
    an all-gather, the full operand of a reduce-scatter)."""
    return max(
        (shape_bytes(f"{d}[{dims}]") for d, dims in _ARRAY_RE.findall(shape)),
        default=0,
    )


def _computes(comps: _Comps, instr: Instr, memo: dict) -> bool:
    """Whether an instruction is compute worth hiding a collective under:
    a GEMM (``dot``, ``convolution``, a GEMM custom call, or a fusion or
    call holding one) or a loop (``while``)."""
    if instr.opcode in ("dot", "convolution", "while"):
        return True
    if instr.opcode == "custom-call":
        return bool(_GEMM_TARGET_RE.search(instr.line))
    if instr.opcode in ("fusion", "call", "conditional", "async-start"):
        return any(_holds_compute(comps, c, memo) for c, _ in instr.callees)
    return False


def _holds_compute(comps: _Comps, name: str, memo: dict) -> bool:
    if name not in memo:
        memo[name] = False  # a cycle guard
        memo[name] = any(
            _computes(comps, instr, memo) for instr in comps.get(name, ())
        )
    return memo[name]


def _operand_bytes(instr: Instr, shapes: dict) -> int:
    """Bytes of an instruction's operands defined in its computation."""
    inside = instr.line.split(f"{instr.opcode}(", 1)[-1].split(")", 1)[0]
    return sum(
        shape_bytes(shapes.get(n, "")) for n in _OPERAND_RE.findall(inside)
    )


_CHANNEL_RE = re.compile(r"\bchannel_id=(\d+)")
_ASYNC_TARGET_RE = re.compile(
    r"custom_call_target=\"AsyncCollective(Start|Done)\""
)


def _fused_collective(comps: _Comps, name: str, memo: dict) -> dict | None:
    """What a fusion's body does with a collective (XLA:TPU's forms), or
    None if it holds none: ``kind`` is ``"start"`` / ``"done"`` (its root
    is an ``AsyncCollectiveStart`` / ``AsyncCollectiveDone`` custom call),
    ``"continuation"`` (it also computes: a convolution or dot runs while
    the collective is in flight) or ``"sync"``; ``op``, ``channel`` (its
    ``channel_id``, the same in every fusion of one collective) and
    ``bytes`` (the larger of its operands and its result)."""
    instrs = comps.get(name, ())
    shapes: dict[str, str] = {}
    found = None
    for instr in instrs:
        shapes[instr.name] = instr.shape
        if found is None and instr.opcode in _COLLECTIVES:
            nbytes = _operand_bytes(instr, shapes)
            channel = _CHANNEL_RE.search(instr.line)
            found = dict(
                op=instr.opcode,
                channel=channel.group(1) if channel else None,
                bytes=max(nbytes, shape_bytes(instr.shape)),
            )
    if found is None:
        return None
    target = _ASYNC_TARGET_RE.search("\n".join(i.line for i in instrs))
    if target:
        found["kind"] = target.group(1).lower()
    elif _holds_compute(comps, name, memo):
        found["kind"] = "continuation"
    else:
        found["kind"] = "sync"
    if found["op"] == "all-reduce" and "reduce-scatter" in name:
        found["op"] = "reduce-scatter"  # XLA:TPU's all-reduce + slice
    return found


def _row(op: str, nbytes: int, name: str, loop: bool, sync: bool) -> dict:
    return dict(
        op=op, bytes=nbytes, computation=name, loop=loop, sync=sync, compute=0
    )


def _schedule(comps: _Comps, name: str, loop: bool, memo: dict) -> list[dict]:
    """The collectives of one scheduled computation (see :func:`overlaps`)."""
    shapes: dict[str, str] = {}
    started: dict[str, dict] = {}
    fused: dict[str, dict] = {}  # XLA:TPU's: one per channel
    rows = []
    for instr in comps[name]:
        shape, opcode, lhs = instr.shape, instr.opcode, instr.name
        shapes[lhs] = shape
        if started and _computes(comps, instr, memo):
            for row in started.values():
                row["compute"] += 1
        if opcode == "fusion":
            body = next((c for c, _ in instr.callees), "")
            info = _fused_collective(comps, body, memo)
            if info is not None:
                rows += _fused_step(info, lhs, name, loop, started, fused)
            continue
        op = _collective_of(instr, comps)
        if op is not None:
            sync = not opcode.endswith("-start")
            row = _row(op, _operand_bytes(instr, shapes), name, loop, sync)
            if sync:
                row["bytes"] = max(row["bytes"], shape_bytes(shape))
            else:
                started[lhs] = row
            rows.append(row)
        elif opcode.endswith("-done"):
            inside = instr.line.split(f"{opcode}(", 1)[-1]
            for operand in _OPERAND_RE.findall(inside):
                row = started.pop(operand, None)
                if row is not None:
                    row["bytes"] = max(row["bytes"], shape_bytes(shape))
    return rows


def _fused_step(
    info: dict, lhs: str, name: str, loop: bool, started: dict, fused: dict
) -> list[dict]:
    """Books one XLA:TPU collective fusion; returns the new row, if any.

    A start opens the collective (keyed by channel), a done closes it; a
    continuation fusion of an open one was counted as compute in flight,
    one of a collective with no start is that collective, overlapped (it
    runs inside the fusion's compute); a sync fusion is exposed."""
    key = f"channel {info['channel']}" if info["channel"] else lhs
    sync = info["kind"] == "sync"
    if info["kind"] == "done":
        row = started.pop(key, None) or fused.get(key)
        if row is not None:
            row["bytes"] = max(row["bytes"], info["bytes"])
        return []
    if key in started or key in fused:
        return []
    row = _row(info["op"], info["bytes"], name, loop, sync)
    fused[key] = row
    if info["kind"] == "start":
        started[key] = row
    elif info["kind"] == "continuation":
        row["compute"] = 1
    return [row]


def overlaps(text: str) -> list[dict]:
    """Every collective of a scheduled HLO module (``compile().as_text()``)
    and the compute scheduled while it is in flight.

    Reads XLA:GPU's asynchronous forms (a ``-start``/``-done`` pair, an
    ``async-start`` wrapping a collective) and XLA:TPU's: a fusion whose
    root is an ``AsyncCollectiveStart`` custom call opens a collective that
    a fusion ending in ``AsyncCollectiveDone`` closes, and the fusions in
    between that hold the same collective (its ``channel_id``) and a
    convolution are its continuation: compute run while it is in flight
    (async collective fusion). A collective fused with compute and no start
    is overlapped; one alone in a fusion is synchronous. Each collective is
    one row, however many fusions hold it.

    Returns:
      One dict per collective: ``op`` (e.g. ``"all-gather"``),
      ``bytes`` (the larger of its operands and its result: the gathered
      result, the scattered operand; all of them for a combined one),
      ``computation``, ``loop`` (inside a ``while`` loop's body), ``sync``
      and ``compute``: the number of instructions between its start and its
      done that are a GEMM (``dot``, ``convolution``, a GEMM custom call, or
      a fusion, call or conditional holding one) or a loop; 0 for a sync
      collective.
    """
    comps = Module.parse(text).computations
    in_loop = loop_computations(text)
    memo: dict = {}
    inner = {
        callee
        for instrs in comps.values()
        for instr in instrs
        if instr.opcode in ("async-start", "fusion")
        for callee, _ in instr.callees
    }
    rows = []
    for name in comps:
        if name not in inner:  # a fusion's body: read at the fusion
            rows += _schedule(comps, name, name in in_loop, memo)
    return rows


def exposure(rows: list[dict], min_bytes: int = 0) -> dict:
    """Of the collectives of at least ``min_bytes`` (rows of
    :func:`overlaps`): how many there are, how many are exposed (no
    compute between start and done), how many run inside a loop, and the
    share of their bytes overlapped by compute."""
    big = [r for r in rows if r["bytes"] >= min_bytes]
    total = sum(r["bytes"] for r in big)
    hidden = sum(r["bytes"] for r in big if r["compute"])
    return dict(
        collectives=len(big),
        exposed=sum(not r["compute"] for r in big),
        in_loop=sum(r["loop"] for r in big),
        overlapped=hidden / total if total else 0.0,
        bytes=total,
    )
