"""A small reader of optimized HLO text, for tests and benchmarks that count
operations (not part of the public API).

It splits a module into computations and follows calls, so a caller can ask
which operations run on every call (reachable from the entry computation
without entering a ``conditional``'s branch) and which only inside a branch,
and how many bytes each all-reduce moves.
"""

from __future__ import annotations

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
_CALLEE_RE = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
# The name scope of the fused step's loop (flags.GATE_LOOP), in its metadata.
_GATE_LOOP = 'optaxaccum_gate/while"'
_BRANCHES_RE = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRUE_FALSE_RE = re.compile(
    r"\btrue_computation=%?([\w.\-]+).*?\bfalse_computation=%?([\w.\-]+)"
)
_ALL_REDUCE_OPS = ("all-reduce", "all-reduce-start")


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


def split_instruction(line: str) -> tuple[str, str] | None:
    """``(shape, opcode)`` of an HLO instruction line, else None."""
    head, sep, rest = line.partition(" = ")
    if not sep or not head.split() or not head.split()[-1].startswith("%"):
        return None
    rest = rest.lstrip()
    if rest.startswith("("):  # tuple shape: up to the matching parenthesis
        depth = 0
        end = 0
        for end, c in enumerate(rest, 1):  # noqa: B007
            depth += (c == "(") - (c == ")")
            if depth == 0:
                break
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode = rest.split("(", 1)[0].strip()
    return shape, opcode


def parse_hlo(text: str) -> tuple[dict[str, list[str]], str]:
    """Splits HLO text into computations: ``({name: lines}, entry name)``."""
    comps: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        if current is None:
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
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
        else:
            current.append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def callees(line: str) -> Iterator[tuple[str, int | None]]:
    """Computations called by an instruction: ``(name, branch index)``;
    the index is None for calls that always run (fusions, reductions...)."""
    tf = _TRUE_FALSE_RE.search(line)
    if tf:  # a predicated conditional: branch 1 is the true computation
        yield tf.group(2), 0
        yield tf.group(1), 1
        return
    m = _BRANCHES_RE.search(line)
    if m:
        for i, name in enumerate(m.group(1).split(",")):
            yield name.strip().lstrip("%"), i
        return
    gate_loop = " while(" in line and _GATE_LOOP in line
    for name in _CALLEE_RE.findall(line):
        # The fused step's loop of 0 or 1 trips: its body is the gate's
        # open branch (1, as lax.cond's true branch).
        body = gate_loop and re.search(rf"\bbody=%?{re.escape(name)}\b", line)
        yield name, 1 if body else None


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
    comps, entry = parse_hlo(text)
    seen: set[tuple[str, tuple[int, ...]]] = set()

    def visit(name: str, branches: tuple[int, ...]) -> Iterator:
        if (name, branches) in seen or name not in comps:
            return
        seen.add((name, branches))
        for line in comps[name]:
            parsed = split_instruction(line)
            if parsed is not None:
                yield (name, branches, line, *parsed)
            for callee, index in callees(line):
                inner = branches if index is None else (*branches, index)
                yield from visit(callee, inner)

    yield from visit(entry, ())


def all_reduces(text: str) -> list[dict]:
    """Every all-reduce of an HLO module, with where it runs.

    Returns:
      One dict per all-reduce op (``all-reduce`` or ``all-reduce-start``):
      ``bytes`` it reduces, ``computation`` holding it and ``branches``: the
      ``conditional`` branches (index; 1 is ``lax.cond``'s true branch) that
      lead to it from the entry computation, ``()`` when it runs on every
      call (see :func:`instructions`).
    """
    return [
        dict(bytes=shape_bytes(shape), computation=name, branches=branches)
        for name, branches, _, shape, opcode in instructions(text)
        if opcode in _ALL_REDUCE_OPS
    ]


def summarize(text: str) -> dict:
    """All-reduce ops and bytes at the top level and inside conditionals."""
    ops = all_reduces(text)
    top = [o for o in ops if not o["branches"]]
    cond = [o for o in ops if o["branches"]]
    return {
        "top_ops": len(top),
        "top_bytes": sum(o["bytes"] for o in top),
        "branch_ops": len(cond),
        "branch_bytes": sum(o["bytes"] for o in cond),
        "true_branch_only": all(o["branches"][-1] == 1 for o in cond),
    }


def _reachable(
    comps: dict[str, list[str]], entry: str, *, into_branches: bool
) -> set[str]:
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo.extend(
                callee
                for callee, index in callees(line)
                if into_branches or index is None
            )
    return seen


_WHILE_RE = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")


def loop_computations(text: str) -> set[str]:
    """The computations of an HLO module that run inside a ``while`` loop
    (a ``lax.scan``'s or ``lax.fori_loop``'s body, once per iteration):
    those reachable from a ``while`` instruction's body or condition."""
    comps, _ = parse_hlo(text)
    found: set[str] = set()
    for lines in comps.values():
        for line in lines:
            parsed = split_instruction(line)
            if parsed is None or parsed[1] != "while":
                continue
            for name in _WHILE_RE.findall(line):
                found |= _reachable(comps, name, into_branches=True)
    return found


def split(text: str) -> tuple[list[str], list[str]]:
    """``(unconditional_lines, branch_lines)`` of an HLO module.

    ``unconditional_lines`` are the instructions that run on every call: those
    reachable from the entry computation without entering a conditional's
    branch; ``branch_lines`` are those reachable only through a branch.
    """
    comps, entry = parse_hlo(text)
    always = _reachable(comps, entry, into_branches=False)
    everything = _reachable(comps, entry, into_branches=True)
    lines = lambda names: [ln for n in names for ln in comps[n]]  # noqa: E731
    return lines(always), lines(everything - always)


def count(lines: list[str], op: str) -> int:
    """Number of instructions among ``lines`` whose opcode is ``op`` (or its
    asynchronous ``op-start``)."""
    n = 0
    for line in lines:
        parsed = split_instruction(line)
        if parsed is not None and parsed[1] in (op, f"{op}-start"):
            n += 1
    return n


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


def _collective_of(opcode: str, line: str, comps: dict) -> str | None:
    """The collective an instruction starts or is (``all-gather`` ...):
    ``X`` / ``X-start`` directly, or an ``async-start`` wrapping it."""
    for op in _COLLECTIVES:
        if opcode in (op, f"{op}-start"):
            return op
    if opcode == "async-start":
        for callee, _ in callees(line):
            for inner in comps.get(callee, ()):
                parsed = split_instruction(inner)
                if parsed is not None and parsed[1] in _COLLECTIVES:
                    return parsed[1]
    return None


def _largest_array(shape: str) -> int:
    """Bytes of the largest array of an HLO shape (the gathered result of
    an all-gather, the full operand of a reduce-scatter)."""
    return max(
        (shape_bytes(f"{d}[{dims}]") for d, dims in _ARRAY_RE.findall(shape)),
        default=0,
    )


def _computes(comps: dict, line: str, opcode: str, memo: dict) -> bool:
    """Whether an instruction is compute worth hiding a collective under:
    a GEMM (``dot``, ``convolution``, a GEMM custom call, or a fusion or
    call holding one) or a loop (``while``)."""
    if opcode in ("dot", "convolution", "while"):
        return True
    if opcode == "custom-call":
        return bool(_GEMM_TARGET_RE.search(line))
    if opcode in ("fusion", "call", "conditional", "async-start"):
        return any(_holds_compute(comps, c, memo) for c, _ in callees(line))
    return False


def _holds_compute(comps: dict, name: str, memo: dict) -> bool:
    if name not in memo:
        memo[name] = False  # a cycle guard
        memo[name] = any(
            _computes(comps, line, p[1], memo)
            for line in comps.get(name, ())
            if (p := split_instruction(line)) is not None
        )
    return memo[name]


def _operand_bytes(line: str, opcode: str, shapes: dict) -> int:
    """Bytes of an instruction's operands defined in its computation."""
    inside = line.split(f"{opcode}(", 1)[-1].split(")", 1)[0]
    return sum(
        shape_bytes(shapes.get(n, "")) for n in _OPERAND_RE.findall(inside)
    )


_CHANNEL_RE = re.compile(r"\bchannel_id=(\d+)")
_ASYNC_TARGET_RE = re.compile(
    r"custom_call_target=\"AsyncCollective(Start|Done)\""
)


def _fused_collective(comps: dict, name: str, memo: dict) -> dict | None:
    """What a fusion's body does with a collective (XLA:TPU's forms), or
    None if it holds none: ``kind`` is ``"start"`` / ``"done"`` (its root
    is an ``AsyncCollectiveStart`` / ``AsyncCollectiveDone`` custom call),
    ``"continuation"`` (it also computes: a convolution or dot runs while
    the collective is in flight) or ``"sync"``; ``op``, ``channel`` (its
    ``channel_id``, the same in every fusion of one collective) and
    ``bytes`` (the larger of its operands and its result)."""
    lines = comps.get(name, ())
    shapes: dict[str, str] = {}
    found = None
    for line in lines:
        parsed = split_instruction(line)
        if parsed is None:
            continue
        shape, opcode = parsed
        shapes[line.split(" = ", 1)[0].split()[-1].lstrip("%")] = shape
        if found is None and opcode in _COLLECTIVES:
            nbytes = _operand_bytes(line, opcode, shapes)
            channel = _CHANNEL_RE.search(line)
            found = dict(
                op=opcode,
                channel=channel.group(1) if channel else None,
                bytes=max(nbytes, shape_bytes(shape)),
            )
    if found is None:
        return None
    target = _ASYNC_TARGET_RE.search("\n".join(lines))
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


def _schedule(comps: dict, name: str, loop: bool, memo: dict) -> list[dict]:
    """The collectives of one scheduled computation (see :func:`overlaps`)."""
    shapes: dict[str, str] = {}
    started: dict[str, dict] = {}
    fused: dict[str, dict] = {}  # XLA:TPU's: one per channel
    rows = []
    for line in comps[name]:
        parsed = split_instruction(line)
        if parsed is None:
            continue
        shape, opcode = parsed
        lhs = line.split(" = ", 1)[0].split()[-1].lstrip("%")
        shapes[lhs] = shape
        if started and _computes(comps, line, opcode, memo):
            for row in started.values():
                row["compute"] += 1
        if opcode == "fusion":
            body = next((c for c, _ in callees(line)), "")
            info = _fused_collective(comps, body, memo)
            if info is not None:
                rows += _fused_step(info, lhs, name, loop, started, fused)
            continue
        op = _collective_of(opcode, line, comps)
        if op is not None:
            sync = not opcode.endswith("-start")
            row = _row(
                op, _operand_bytes(line, opcode, shapes), name, loop, sync
            )
            if sync:
                row["bytes"] = max(row["bytes"], shape_bytes(shape))
            else:
                started[lhs] = row
            rows.append(row)
        elif opcode.endswith("-done"):
            inside = line.split(f"{opcode}(", 1)[-1]
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
    comps, _ = parse_hlo(text)
    in_loop = loop_computations(text)
    memo: dict = {}
    inner = {
        callee
        for lines in comps.values()
        for line in lines
        if (p := split_instruction(line)) is not None
        and p[1] in ("async-start", "fusion")
        for callee, _ in callees(line)
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
