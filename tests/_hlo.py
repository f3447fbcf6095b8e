"""A small reader of optimized HLO text, for tests that count operations.

It splits a module into computations and follows calls, so a test can ask
which operations run unconditionally (reachable from the entry computation
without entering a ``conditional``'s branch) and which only inside the
branches of a ``conditional``.
"""

import re

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation)="
    r"%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BRANCH_KW = re.compile(r"(?:true_computation|false_computation)=%?([\w.\-]+)")


def computations(hlo_text):
    """Maps computation name -> list of instruction lines; also the entry."""
    comps, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line.strip())
            if m and "=" not in line.split("{")[0].split("(")[0]:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps, entry


def _callees(line, *, into_branches):
    if " conditional(" in line:
        if not into_branches:
            return []
        names = _BRANCH_KW.findall(line)
        m = _BRANCHES.search(line)
        if m:
            names += [n.strip().lstrip("%") for n in m.group(1).split(",")]
        return names
    return _CALLEE.findall(line)


def _reachable(comps, roots, *, into_branches):
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo.extend(_callees(line, into_branches=into_branches))
    return seen


def split(hlo_text):
    """Returns (unconditional_lines, branch_lines) of an HLO module.

    ``unconditional_lines`` are the instructions that run on every call: those
    reachable from the entry computation without entering a conditional's
    branch. ``branch_lines`` are those reachable only through a branch.
    """
    comps, entry = computations(hlo_text)
    always = _reachable(comps, [entry], into_branches=False)
    everything = _reachable(comps, [entry], into_branches=True)
    lines = lambda names: [l for n in names for l in comps[n]]  # noqa: E731
    return lines(always), lines(everything - always)


def count(lines, op):
    """Number of instructions among ``lines`` whose opcode is ``op``."""
    pattern = re.compile(r"=\s*[^=]*?\s" + re.escape(op) + r"(?:-start)?\(")
    return sum(1 for line in lines if pattern.search(line))
