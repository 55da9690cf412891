"""The collectives of a compiled program, read from its HLO text.

Used by the tests (no ``[B, T, V]``-sized collective) and by ``bench --mesh`` (bytes each device
puts into collectives per step).
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVE_OPS = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
                  "reduce-scatter")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_LINE = re.compile(r"=\s*(?P<type>\(.*?\)|\S+)\s+(?P<op>" + "|".join(COLLECTIVE_OPS)
                   + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its opcode and result arrays ``(dtype, shape)``."""

    op: str
    arrays: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def elements(self) -> int:
        """Elements of the largest result array."""
        return max((math.prod(s) for _, s in self.arrays), default=0)

    @property
    def bytes(self) -> int:
        """Bytes of all result arrays (the payload a device receives)."""
        return sum(math.prod(s) * _ITEMSIZE.get(d, 4) for d, s in self.arrays)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in ``hlo_text`` (``compiled.as_text()``), in program order.

    An asynchronous ``*-start`` counts once (its ``*-done`` is skipped); its result tuple holds
    the operand too, so only its last array is kept as the result.
    """
    found = []
    for m in _LINE.finditer(hlo_text):
        arrays = tuple((a["dtype"], tuple(int(d) for d in a["dims"].split(",") if d))
                       for a in _ARRAY.finditer(m["type"]) if a["dtype"] in _ITEMSIZE)
        if m["start"] and len(arrays) > 1:
            arrays = arrays[-1:]
        found.append(Collective(m["op"], arrays))
    return found


def summary(hlo_text: str) -> dict[str, int]:
    """``{op: bytes}`` summed over the program, plus ``"total"`` and ``"largest_elements"``."""
    out: dict[str, int] = {}
    largest = 0
    for c in collectives(hlo_text):
        out[c.op] = out.get(c.op, 0) + c.bytes
        largest = max(largest, c.elements)
    out["total"] = sum(out.values())
    out["largest_elements"] = largest
    return out
