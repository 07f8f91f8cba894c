"""Uniform registers an HGMMA reads that some path to it never wrote, in cuobjdump SASS.

An sm_90 wgmma (SASS ``HGMMA``) takes its shared-memory operands' descriptors from uniform
registers: ``gdesc[URn]`` names URn..URn+3, A's descriptor in the first pair (when A is in
shared memory) and B's in the second. ptxas once emitted, on one branch of a kernel, an HGMMA
whose B descriptor registers were written only on the other branches: the MMA read a stale
descriptor, an out-of-range shared address on the H200 for one shape (tools/PERF_LOG.md,
session 17), possibly a wrong but valid slot for another (:mod:`mxfx.kernels.wgmma_guard`
checks every such kernel as it is compiled). The PTX was well formed, so only the
SASS shows it. This is a must-be-written analysis over the SASS control-flow graph:
conservative where it cannot see (a predicated write does not count; the targets of an
indirect ``BRX``, the blocks nothing else branches to, start from the state after it).
"""
from __future__ import annotations

import re

_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[0-9T]\s+)?([A-Za-z0-9_.]+)\s*(.*?)\s*;")
_ENDS_BLOCK = ("BRA", "BRX", "EXIT", "RET", "JMP")
_NOT_UR_WRITES = ("UISETP", "USETMAXREG")  # their first operand is a predicate or a count


def _instructions(sass: str) -> list[tuple[int, bool, str, str]]:
    """(address, predicated, opcode, operands) of each instruction."""
    return [(int(m[1], 16), m[2] is not None, m[3], m[4]) for m in map(_LINE.match, sass.splitlines()) if m]


def _written(op: str, operands: str) -> set[int]:
    m = re.fullmatch(r"UR(\d+)", operands.split(",")[0].strip())
    if not m or op.startswith(_NOT_UR_WRITES):
        return set()
    n = int(m[1])
    return {n, n + 1} if ".64" in op or ".WIDE" in op else {n}


def _target(operands: str) -> int:
    return int(re.search(r"0x([0-9a-f]+)", operands)[1], 16)


def _descriptor_registers(operands: str) -> set[int]:
    n = int(re.search(r"gdesc\[UR(\d+)\]", operands)[1])
    a_in_shared = operands.split(",")[1].strip().startswith("gdesc")
    return set(range(n, n + 4)) if a_in_shared else {n + 2, n + 3}


def unwritten_descriptor_reads(sass: str) -> list[str]:
    """Each HGMMA (address, text, registers) reading a descriptor register that is not written
    on every path from the function's entry to it. ``sass``: ``cuobjdump -sass`` of one kernel."""
    ins = _instructions(sass)
    index = {a: i for i, (a, *_) in enumerate(ins)}
    starts = {0}
    for i, (_, _, op, operands) in enumerate(ins):
        if op.startswith(_ENDS_BLOCK):
            starts.add(i + 1)
            if op.startswith("BRA"):
                starts.add(index[_target(operands)])
    starts = sorted(s for s in starts if s < len(ins))
    ends = starts[1:] + [len(ins)]
    block_at = {s: b for b, s in enumerate(starts)}
    preds: list[set[int]] = [set() for _ in starts]
    indirect = []
    for b, end in enumerate(ends):
        _, predicated, op, operands = ins[end - 1]
        if not op.startswith(_ENDS_BLOCK) or predicated:
            if b + 1 < len(starts):
                preds[b + 1].add(b)
        if op.startswith("BRA"):
            preds[block_at[index[_target(operands)]]].add(b)
        if op.startswith("BRX"):
            indirect.append(b)
    for b in range(1, len(starts)):
        if not preds[b]:
            preds[b].update(indirect)

    def walk(b: int, state: set[int], check: list | None = None) -> set[int]:
        for a, predicated, op, operands in ins[starts[b]:ends[b]]:
            if check is not None and op.startswith("HGMMA"):
                missing = _descriptor_registers(operands) - state
                if missing:
                    check.append(f"{a:#x} {op} {operands}: UR{sorted(missing)} not written on every path")
            if not predicated:
                state = state | _written(op, operands)
        return state

    everything = set(range(256))
    out = [set(everything) for _ in starts]

    def entry(b: int) -> set[int]:
        return set() if b == 0 or not preds[b] else set.intersection(*(out[p] for p in preds[b]))

    changed = True
    while changed:
        changed = False
        for b in range(len(starts)):
            new = walk(b, entry(b))
            if new != out[b]:
                out[b], changed = new, True
    found: list[str] = []
    for b in range(len(starts)):
        walk(b, entry(b), found)
    return found
