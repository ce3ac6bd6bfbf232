"""The instruction mix of a compiled Triton kernel's loops, read from its SASS without a GPU.

`scripts/triton_sm90_check.py --sass` prints it for every kernel it compiles: for each innermost loop of 100 or
more instructions (a backward branch whose range holds no other loop), its size and its most frequent opcodes. A
kernel whose hot loop issues several times the instructions its tensor-core work needs is bound by the issue of
those instructions, whatever its tiles: what ptxas's register report does not show. The disassembler is the
cuobjdump bundled with Triton's NVIDIA backend.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)[.A-Z0-9_]*\s*([^;]*);")


def _cuobjdump() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(_cuobjdump()), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def _parsed(text: str) -> list[tuple[int, str, str, str]]:
    """(address, opcode, operands, line) of every instruction line of cuobjdump's text."""
    return [(int(m[1], 16), m[2], m[3], line) for m, line in ((_LINE.match(line), line) for line in text.splitlines())
            if m]


def instructions(cubin: bytes) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction of `cubin`."""
    return [row[:3] for row in _parsed(_sass(cubin))]


def innermost_loops(ins: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """(first, last address) of each loop that contains no other loop: a branch back to a lower address."""
    loops = set()
    for addr, op, args in ins:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target[1], 16) < addr:
            loops.add((int(target[1], 16), addr))
    return sorted(loop for loop in loops
                  if not any(other != loop and loop[0] <= other[0] and other[1] <= loop[1] for other in loops))


def loop_mixes(cubin: bytes, min_size: int = 100) -> list[Counter]:
    """Opcode counts of the innermost loops of at least `min_size` instructions, the largest first."""
    ins = instructions(cubin)
    mixes = [Counter(op for addr, op, _ in ins if lo <= addr <= hi) for lo, hi in innermost_loops(ins)]
    return sorted((m for m in mixes if m.total() >= min_size), key=lambda m: -m.total())


def summary(cubin: bytes, top: int = 8) -> str:
    """One line per hot loop: its size, its MMA and lane-shuffle counts, its most frequent opcodes."""
    lines = []
    for mix in loop_mixes(cubin):
        mma = mix["HGMMA"] + mix["HMMA"]
        common = ", ".join(f"{op} {n}" for op, n in mix.most_common(top))
        lines.append(f"loop of {mix.total()} instructions: mma {mma}, shfl {mix['SHFL']}; {common}")
    return "\n".join(lines) or "no loop of 100 instructions or more"


def listing(cubin: bytes) -> str:
    """The largest innermost loop's instructions as cuobjdump prints them (modifiers and operands included), to
    read what its counts are made of: e.g. which multiplies build features and which convert or move them."""
    rows = _parsed(_sass(cubin))
    loops = sorted(innermost_loops([row[:3] for row in rows]), key=lambda loop: loop[0] - loop[1])
    if not loops:
        return "no loop"
    lo, hi = loops[0]
    return "\n".join(line.split(";")[0].strip() + ";" for addr, _, _, line in rows if lo <= addr <= hi)
