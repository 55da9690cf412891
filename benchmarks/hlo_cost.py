"""A compiled program's flops and HBM bytes with every loop counted as often as it runs.

XLA's ``cost_analysis()`` walks each ``while`` body once, whatever its trip count, so a
chunked program (a ``lax.scan`` over token chunks, ours or tunix's) reports one chunk's work.
:func:`loop_costs` reads the optimized HLO text (``compiled.as_text()``) instead and sums,
per executed instruction, what ``cost_analysis`` counts:

- bytes: every operand's and the result's bytes, for each instruction outside a fusion
  (a fusion's inside stays in registers or on-chip memory); a fusion operand that the fused
  computation only slices or gathers from counts what is read, and an in-place
  ``dynamic-update-slice`` or ``scatter`` counts the update, not the buffer it writes into;
  an asynchronous copy counts its source and destination once, a buffer allocation nothing;
- flops: ``2 * result elements * contracted size`` for each ``dot`` and ``convolution``,
  inside fusions too; element-wise work is left out (at a vocabulary of 151,936 the head's
  matmuls are over 99% of the flops);
- a ``while`` body and condition times the loop's trip count: the ``known_trip_count`` XLA
  wrote, else the bound its condition compares the induction variable with (``i < N`` from
  ``i = 0``: what ``lax.scan`` and ``fori_loop`` lower to); a loop whose count is found
  neither way is counted once and named in ``unknown_loops``.

:func:`loop_costs` with ``trips=False`` counts each body once, as ``cost_analysis`` does: the
flops then agree with XLA's within 0.3% and the bytes within about a third, XLA's TPU cost
model counting some instructions' bytes its own way (tests/benchmarks/test_hlo_cost.py;
``tpu_tunix_iteration.py`` prints both). A ``conditional`` counts its costliest branch, read
from ``branch_computations`` only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
          "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
          "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
# Instructions that move no data of their own.
_FREE = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                   "after-all", "partition-id", "replica-id", "copy-done", "opt-barrier",
                   "add-dependency"})
# Users that read only part of an operand (their result's worth of it).
_SLICES = frozenset({"dynamic-slice", "slice", "gather"})
# In-place writers: operand 0 is the buffer written into, this operand the part written.
_UPDATE_OPERAND = {"dynamic-update-slice": 1, "scatter": 2}


@dataclasses.dataclass
class Instr:
    """One HLO instruction: its result type, opcode, operand names, the raw text between the
    opcode's parentheses (a parameter's index, a constant's value) and the attributes."""

    name: str
    type_: str
    opcode: str
    operands: list[str]
    args: str
    attrs: str


@dataclasses.dataclass
class Costs:
    """Flops and bytes accessed of a program, with the loops that were counted once."""

    flops: float = 0.0
    bytes_accessed: float = 0.0
    unknown_loops: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: "Costs", times: float = 1.0) -> None:
        self.flops += times * other.flops
        self.bytes_accessed += times * other.bytes_accessed
        self.unknown_loops += other.unknown_loops


def _split_type(rest: str) -> tuple[str, str]:
    """``rest`` (after ``name = ``) split into its result type and what follows."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _call(text: str) -> tuple[str, list[str], str, str]:
    """``opcode(args), attrs`` split into the opcode, the operand names, the args' text and
    the attrs."""
    opcode, _, rest = text.partition("(")
    depth, i = 1, 0
    while depth and i < len(rest):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        i += 1
    args = rest[:i - 1]
    return opcode.strip(), re.findall(r"%([\w.\-]+)", args), args, rest[i:]


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
    """The computations of an HLO module's text (name -> instructions) and the entry's name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            type_, rest = _split_type(m.group(2))
            comps[current].append(Instr(m.group(1), type_, *_call(rest)))
    return comps, entry


def type_bytes(type_: str) -> float:
    """Bytes of every array in an HLO type (a tuple's elements summed)."""
    return sum(_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x)
               for d, dims in _ARRAY.findall(type_))


def _dims(type_: str) -> list[int]:
    m = _ARRAY.search(type_)
    return [int(x) for x in m.group(2).split(",") if x] if m else []


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(key + r"=([%\w.\-]+)", attrs)
    return m.group(1).lstrip("%") if m else None


def _matmul_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """``2 * result elements * contracted size`` of a ``dot`` or ``convolution``."""
    out = math.prod(_dims(ins.type_))
    lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
    if ins.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        idx = [int(x) for x in m.group(1).split(",") if x] if m else []
        return 2.0 * out * math.prod(lhs[i] for i in idx if i < len(lhs))
    m = re.search(r"dim_labels=(\w+)_(\w+)->", ins.attrs)
    if not m or "f" not in m.group(1):
        return 0.0
    rhs = _dims(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
    window = math.prod(rhs[i] for i, c in enumerate(m.group(2)) if c.isdigit() and i < len(rhs))
    groups = int(_attr(ins.attrs, "feature_group_count") or 1)
    return 2.0 * out * lhs[m.group(1).index("f")] * window / groups


def trip_count(ins: Instr, comps: dict[str, list[Instr]]) -> int | None:
    """A ``while``'s trip count: XLA's ``known_trip_count``, else its condition's bound."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    if m:
        return int(m.group(1))
    cond = comps.get(_attr(ins.attrs, "condition") or "", [])
    by_name = {i.name: i for i in cond}
    root = cond[-1] if cond else None
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
        return None
    bound = by_name.get(root.operands[1]) if len(root.operands) > 1 else None
    if bound is None or bound.opcode != "constant" or not re.fullmatch(r"-?\d+", bound.args):
        return None
    return int(bound.args)


class _Walker:
    def __init__(self, comps: dict[str, list[Instr]], trips: bool):
        self.comps, self.trips = comps, trips
        self.shapes = {c: {i.name: i.type_ for i in body} for c, body in comps.items()}

    def fused_flops(self, comp: str) -> float:
        total = 0.0
        for ins in self.comps.get(comp, []):
            if ins.opcode in ("dot", "convolution"):
                total += _matmul_flops(ins, self.shapes[comp])
            elif ins.opcode == "fusion":
                total += self.fused_flops(_attr(ins.attrs, "calls") or "")
        return total

    def fusion_bytes(self, ins: Instr, shapes: dict[str, str]) -> float:
        """Operands (only what is read where the fused computation only slices or gathers from
        them) and the result (only the update of an in-place dynamic-update-slice or
        scatter)."""
        body = self.comps.get(_attr(ins.attrs, "calls") or "", [])
        index = {i.name: int(i.args) for i in body if i.opcode == "parameter"}
        users: dict[str, list[Instr]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        by_name = {i.name: i for i in body}
        total = 0.0
        in_place = set()
        root = body[-1] if body else None
        roots = ([by_name[o] for o in root.operands if o in by_name]
                 if root is not None and root.opcode == "tuple" else [root] if root else [])
        out_bytes = type_bytes(ins.type_)
        for r in roots:
            k = _UPDATE_OPERAND.get(r.opcode)
            if k is not None and r.operands and r.operands[0] in index and len(r.operands) > k:
                in_place.add(r.operands[0])
                out_bytes += type_bytes(by_name[r.operands[k]].type_) - type_bytes(r.type_)
        for pname, k in index.items():
            if pname in in_place:
                continue
            if k >= len(ins.operands):
                continue
            us = users.get(pname, [])
            if us and all(u.opcode in _SLICES and u.operands[0] == pname for u in us):
                total += sum(type_bytes(u.type_) for u in us)
            else:
                total += type_bytes(shapes.get(ins.operands[k], ""))
        return total + out_bytes

    def walk(self, comp: str) -> Costs:
        costs, shapes = Costs(), self.shapes.get(comp, {})
        for ins in self.comps.get(comp, []):
            op = ins.opcode
            if op in _FREE:
                continue
            if op == "while":
                n = trip_count(ins, self.comps) if self.trips else 1
                if n is None:
                    costs.unknown_loops.append(ins.name)
                    n = 1
                costs.add(self.walk(_attr(ins.attrs, "body") or ""), n)
                costs.add(self.walk(_attr(ins.attrs, "condition") or ""), n)
                continue
            if op in ("call", "call-start", "async-start"):  # the called computation's work
                costs.add(self.walk(_attr(ins.attrs, "to_apply") or _attr(ins.attrs, "calls")
                                    or ""))
                continue
            if op in ("call-done", "async-done", "async-update") or (
                    op == "custom-call" and 'custom_call_target="AllocateBuffer"' in ins.attrs):
                continue
            if op == "copy-start":  # its result is (destination, source, context)
                costs.bytes_accessed += 2 * sum(type_bytes(shapes.get(o, ""))
                                                for o in ins.operands)
                continue
            if op == "conditional":
                names = re.findall(r"%([\w.\-]+)", ins.attrs.split("branch_computations=")[-1]
                                   .split("}")[0]) if "branch_computations" in ins.attrs else []
                branches = [self.walk(b) for b in names]
                if branches:
                    costs.add(max(branches, key=lambda c: c.bytes_accessed))
                continue
            if op == "fusion":
                costs.bytes_accessed += self.fusion_bytes(ins, shapes)
                costs.flops += self.fused_flops(_attr(ins.attrs, "calls") or "")
                continue
            costs.bytes_accessed += type_bytes(ins.type_) + sum(
                type_bytes(shapes.get(o, "")) for o in ins.operands)
            if op in ("dot", "convolution"):
                costs.flops += _matmul_flops(ins, shapes)
        return costs


def loop_costs(hlo_text: str, trips: bool = True) -> Costs:
    """Flops and bytes of the optimized HLO module ``hlo_text``, each loop body counted
    ``trip count`` times (``trips=False``: once, as XLA's ``cost_analysis`` does)."""
    comps, entry = parse(hlo_text)
    return _Walker(comps, trips).walk(entry)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="HLO",
                   help="optimized HLO text files (compiled.as_text()), one JSON line each: "
                   "flops and bytes with loops counted, and once")
    for path in p.parse_args(argv).files:
        with open(path) as f:
            text = f.read()
        print(json.dumps({"file": path, **{k: dataclasses.asdict(loop_costs(text, t))
                                           for k, t in (("counted", True), ("once", False))}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
