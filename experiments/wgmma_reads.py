"""Finds instructions in a kernel's PTX that touch a wgmma accumulator while its wgmma may still run: the cause of
ptxas's note C7514 ("wgmma.mma_async instructions are serialized due to non wgmma instructions reading accumulator
registers of a wgmma between start and end of the pipeline stage"). With that note ptxas makes every wgmma of the
kernel wait for the one before, so one hoisted negation can slow a whole kernel.

    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=/tmp/dump python3 experiments/bench_mosaic_grads.py --end_to_end=false
    python3 experiments/wgmma_reads.py /tmp/dump/*.ptx

Prints, per file, the wgmma count and each instruction that reads (or writes) accumulator registers of a wgmma
not yet retired by `wgmma.wait_group`, with its PTX line and the nearest `.loc` (the kernel's source line). The
walk is linear in the text: it follows no branches, which suits Mosaic GPU's straight-line chunk bodies; inside a
loop a hazard across the back edge is not seen.
"""

from __future__ import annotations

import dataclasses
import re
import sys

_WGMMA = re.compile(r"wgmma\.mma_async[^{]*\{([^}]*)\}")
_WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)")
_REGISTER = re.compile(r"%[a-z]+\d+")
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)")
# Opcodes whose first register operand is read, not written.
_NO_DESTINATION = ("st.", "mbarrier", "bar.", "barrier", "red.", "atom.", "bra", "ret", "@")


@dataclasses.dataclass(frozen=True)
class Access:
    line: int  # 1-based PTX line
    source: str  # "file:line" of the nearest preceding .loc, or "?"
    instruction: str
    registers: tuple[str, ...]
    kind: str  # "read" or "write"


def early_accumulator_accesses(ptx: str) -> tuple[int, list[Access]]:
    """(number of wgmmas, the accesses to accumulators of wgmmas not yet waited for), in text order.

    A wgmma's accumulator registers stay in flight from its issue until a `wgmma.wait_group N` leaves fewer than
    its commit group among the N newest groups; uncommitted wgmmas are never retired by a wait."""
    uncommitted: set[str] = set()
    committed: list[set[str]] = []
    count, accesses, loc = 0, [], "?"
    for number, line in enumerate(ptx.splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("//"):
            continue
        if match := _LOC.match(text):
            loc = f"{match.group(1)}:{match.group(2)}"
            continue
        if match := _WGMMA.search(text):
            count += 1
            uncommitted |= set(_REGISTER.findall(match.group(1)))
            continue
        if "wgmma.commit_group" in text:
            committed.append(uncommitted)
            uncommitted = set()
            continue
        if match := _WAIT.search(text):
            keep = int(match.group(1))
            committed = committed[len(committed) - keep:] if keep else []
            continue
        in_flight = uncommitted.union(*committed)
        if not in_flight or "wgmma.fence" in text:
            continue
        opcode, _, operands = text.partition(" ")
        registers = _REGISTER.findall(operands)
        if not registers:
            continue
        written = [] if opcode.startswith(_NO_DESTINATION) else registers[:1]
        read = registers[len(written):]
        for kind, regs in (("read", read), ("write", written)):
            hit = tuple(r for r in regs if r in in_flight)
            if hit:
                accesses.append(Access(number, loc, text, hit, kind))
    return count, accesses


def report(name: str, ptx: str, shown: int = 12) -> str:
    count, accesses = early_accumulator_accesses(ptx)
    lines = [f"{name}: {count} wgmma, {len(accesses)} accesses to accumulators in flight"]
    for access in accesses[:shown]:
        lines.append(f"  PTX line {access.line} (source {access.source}), {access.kind} {', '.join(access.registers)}: "
                     f"{access.instruction[:100]}")
    if len(accesses) > shown:
        lines.append(f"  ... {len(accesses) - shown} more")
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    for path in paths:
        with open(path) as f:
            print(report(path, f.read()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
