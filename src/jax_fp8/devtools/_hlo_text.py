"""Parsing of compiled HLO text: computations, instructions, their operands and types.

What `jax_fp8.devtools.hlo` reads: a program (HLO text, a ``Compiled`` / ``Lowered``, or
a `Module` parsed once), the instructions that launch work (`kernel_instructions`'s walk
into calls, async wrappers, loops and conditionals), and the sizes of HLO types.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

if TYPE_CHECKING:
    from jax.stages import Compiled, Lowered


class Instruction(NamedTuple):
    """One HLO instruction: ``%name = shape opcode(operands), attributes``."""

    name: str      # "loop_add_fusion.3"
    opcode: str    # "fusion", "custom-call", "all-reduce", ...
    shape: str     # the result type, e.g. "f32[16,4]{1,0}" or "(f32[2], bf16[])"
    line: str      # the whole line, attributes included


class Module(NamedTuple):
    """A parsed HLO module: computations by name (instructions in order) and the entry's name."""

    computations: dict[str, tuple[Instruction, ...]]
    entry: str | None


# Instructions that launch nothing: buffer plumbing, or the second half of an async pair.
_FREE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "copy-done",
    "async-done", "async-update", "all-reduce-done", "all-gather-done",
    "collective-permute-done", "send-done", "recv-done",
})
_NESTING = frozenset({"call", "async-start", "while", "conditional"})
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_CALLEES = re.compile(r"\b(?:to_apply|calls|body|condition|branch_computations|true_computation"
                      r"|false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_BACKEND_KIND = re.compile(r'"kind"\s*:\s*"([^"]+)"')
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
         "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64,
         "f64": 64, "c64": 64, "c128": 128, "token": 0}


# What the functions of `jax_fp8.devtools.hlo` read: HLO text, a jax Lowered or Compiled
# (its ``as_text()``), or a `Module` parsed from one.
Program: TypeAlias = "str | Compiled | Lowered | Module"


def text_of(program: str | Compiled | Lowered) -> str:
    """The HLO text of ``program``: a str as is, else ``program.as_text()`` (a ``Compiled``)."""
    if isinstance(program, str):
        return program
    as_text = getattr(program, "as_text", None)
    if as_text is None:
        raise TypeError(f"expected HLO text or a compiled program, got {type(program).__name__}")
    return as_text() or ""


def _split_shape(rest: str) -> tuple[str, str]:
    """'(f32[2], f32[]) fusion(%a), ...' -> ('(f32[2], f32[])', 'fusion(%a), ...')."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                return rest[:i + 1], rest[i + 1:]
        return rest, ""
    shape, _, tail = rest.partition(" ")
    return shape, tail


@functools.lru_cache(maxsize=2)
def _parse_text(text: str) -> Module:
    comps: dict[str, list[Instruction]] = {}
    entry = current = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line) if line and not line[0].isspace() else None
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        shape, tail = _split_shape(m.group(2))
        op = _OPCODE.match(tail)
        if op:
            comps[current].append(Instruction(m.group(1).lstrip("%"), op.group(1), shape, line))
    return Module({k: tuple(v) for k, v in comps.items()}, entry)


def parse(program: Program) -> Module:
    """Parses HLO text into its computations; e.g. ``parse(text).computations["main.1"][0]``."""
    return program if isinstance(program, Module) else _parse_text(text_of(program))


def _callees(line: str) -> list[str]:
    out = []
    for group in _CALLEES.findall(line):
        out += re.findall(r"%?([\w.\-]+)", group)
    return out


def operands(ins: Instruction) -> list[str]:
    """The operand names of ``ins`` (types printed before them are dropped); element k of
    a tuple operand is ``name#k``."""
    start = ins.line.find(ins.opcode + "(", ins.line.find("="))
    if start < 0:
        return []
    i, depth = start + len(ins.opcode) + 1, 1
    cur: list[str] = []
    out: list[str] = []
    while i < len(ins.line) and depth:
        ch = ins.line[i]
        depth += (ch in "([{") - (ch in ")]}")
        if depth == 0 or (ch == "," and depth == 1):
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    return [o.split()[-1].lstrip("%") for o in out if o.strip()]


def _dtypes(shape: str) -> list[str]:
    return [m.group(1) for m in _ARRAY.finditer(shape)]


def _is_fp8(dtype: str) -> bool:
    return dtype.startswith("f8")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO type: ``shape_bytes("(f32[16,4]{1,0}, bf16[8])") == 272``."""
    total = 0
    for m in _ARRAY.finditer(shape):
        dtype, dims = m.group(1), m.group(2).replace("<=", "")
        bits = 8 if _is_fp8(dtype) else 4 if dtype.startswith("f4") else _BITS.get(dtype, 0)
        n = 1
        for d in filter(None, (x.strip() for x in dims.split(","))):
            n *= int(d) if d.isdigit() else 0
        total += n * bits
    return total // 8


def tuple_elements(shape: str) -> list[str]:
    """The element types of a tuple type, or ``[shape]`` for an array type:
    ``tuple_elements("(f32[2]{0}, (bf16[], s8[4]))") == ["f32[2]{0}", "(bf16[], s8[4])"]``."""
    text = shape.strip()
    if not text.startswith("("):
        return [text]
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text[1:-1]:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    return out + [tail] if tail else out


def _walk(mod: Module) -> list[tuple[str, Instruction]]:
    """(computation, instruction) of every kernel-level instruction (`kernel_instructions`)."""
    out: list[tuple[str, Instruction]] = []

    def visit(name: str, depth: int) -> None:
        for ins in mod.computations.get(name, ()):
            if ins.opcode in _FREE:
                continue
            callees = _callees(ins.line) if ins.opcode in _NESTING and depth < 16 else []
            if callees:
                for c in callees:
                    visit(c, depth + 1)
            else:
                out.append((name, ins))

    if mod.entry is not None:
        visit(mod.entry, 0)
    return out


def _target(ins: Instruction) -> str:
    m = _TARGET.search(ins.line)
    return m.group(1) if m else "?"


def _fusion_kind(ins: Instruction) -> str:
    m = _BACKEND_KIND.search(ins.line) or _FUSION_KIND.search(ins.line)
    return m.group(1) if m else "?"
