"""The tests' queries of compiled programs, on the library's reader
(``optaxaccum._src.hlo``): which lines run on every call and which only in
a branch, how many instructions of an opcode, the all-reduces and their
bytes."""

from __future__ import annotations

from optaxaccum._src import hlo


def parse_hlo(text: str) -> tuple[dict[str, list[str]], str]:
    """Splits HLO text into computations: ``({name: lines}, entry name)``,
    the lines being those of the computation's instructions."""
    module = hlo.Module.parse(text)
    comps = {
        name: [i.line for i in instrs]
        for name, instrs in module.computations.items()
    }
    return comps, module.entry


def split_instruction(line: str) -> tuple[str, str] | None:
    """``(shape, opcode)`` of an HLO instruction line, else None."""
    instr = hlo.parse_instruction(line)
    return None if instr is None else (instr.shape, instr.opcode)


def all_reduces(text: str) -> list[dict]:
    """Every all-reduce of an HLO module, with where it runs.

    Returns:
      One dict per all-reduce op (``all-reduce`` or ``all-reduce-start``):
      ``bytes`` it reduces, ``computation`` holding it and ``branches``: the
      ``conditional`` branches (index; 1 is ``lax.cond``'s true branch) that
      lead to it from the entry computation, ``()`` when it runs on every
      call (see ``hlo.instructions``).
    """
    return [
        dict(bytes=hlo.shape_bytes(shape), computation=name, branches=branches)
        for name, branches, _, shape, opcode in hlo.instructions(text)
        if opcode in ("all-reduce", "all-reduce-start")
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


def split(text: str) -> tuple[list[str], list[str]]:
    """``(unconditional_lines, branch_lines)`` of an HLO module.

    ``unconditional_lines`` are the instructions that run on every call: those
    reachable from the entry computation without entering a conditional's
    branch; ``branch_lines`` are those reachable only through a branch.
    """
    module = hlo.Module.parse(text)
    always = module.reachable(module.entry, through_branches=False)
    everything = module.reachable(module.entry, through_branches=True)

    def lines(names):
        return [i.line for n in names for i in module.computations[n]]

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
