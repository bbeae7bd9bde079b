"""Compiled HLO text: computations, kernel-level instructions, custom calls, GEMMs, collectives.

Every function takes a *program*: the text of ``jax.jit(f).lower(...).compile().as_text()``,
the ``Compiled`` object itself, or a `Module` from `parse` (to parse a large program once).
The text is XLA's optimized HLO, so the counts are those of what runs: fusions, library
calls (cuBLAS GEMMs are custom calls), collectives, after XLA's passes. Example::

    compiled = jax.jit(jax_fp8.update_states).lower(states).compile()
    hlo.count_custom_calls(compiled, "jax_fp8_update")   # 1
    hlo.count_kernels(compiled)                          # {'custom-call': 1, 'copy': 3}
"""

from __future__ import annotations

import collections
import functools
import math
import re
from typing import TYPE_CHECKING, NamedTuple, TypeAlias, cast

if TYPE_CHECKING:
    from jax.stages import Compiled, Lowered

__all__ = [
    "Collective", "Gemm", "GemmSize", "Instruction", "Module", "all_reduce_kinds",
    "collectives", "computations_calling", "count_collectives", "count_custom_calls",
    "count_kernels", "custom_calls", "fp8_gemms", "fusion_kinds", "gemm_operands",
    "gemm_sizes", "gemms", "kernel_bytes", "kernel_instructions", "kernel_name",
    "op_families", "operands", "parse", "shape_bytes", "source_ops", "text_of",
    "tuple_elements",
]


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


class Gemm(NamedTuple):
    """A kernel-level GEMM: a library call, a fusion around a dot, or a bare dot."""

    name: str      # the instruction's name
    kind: str      # custom-call target, fusion kind (e.g. "__triton_gemm") or "dot"
    fp8: bool      # an FP8 operand (or an FP8 library call, target ending in "$f8")


class GemmSize(NamedTuple):
    """The sizes of a GEMM: ``batch`` products of ``[M, K] x [K, N]`` (each the product of
    its axes' sizes)."""

    batch: int
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        """2 * batch * M * N * K."""
        return 2 * self.batch * self.m * self.n * self.k


class Collective(NamedTuple):
    """A collective instruction (an async ``-start``/``-done`` pair counts once)."""

    name: str
    opcode: str                # "all-reduce", "all-gather", "reduce-scatter", ...
    dtypes: tuple[str, ...]    # element types of the result, e.g. ("f32",)
    bytes: int                 # bytes of the result
    reduction: str | None      # all-reduce / reduce-scatter: the reducer's root, e.g. "maximum"


# Instructions that launch nothing: buffer plumbing, or the second half of an async pair.
_FREE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "copy-done",
    "async-done", "async-update", "all-reduce-done", "all-gather-done",
    "collective-permute-done", "send-done", "recv-done",
})
_NESTING = frozenset({"call", "async-start", "while", "conditional"})
_DOTS = frozenset({"dot", "scaled-dot", "ragged-dot"})
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                "collective-permute", "collective-broadcast")

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_CALLEES = re.compile(r"\b(?:to_apply|calls|body|condition|branch_computations|true_computation"
                      r"|false_computation|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_BACKEND_KIND = re.compile(r'"kind"\s*:\s*"([^"]+)"')
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
         "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64,
         "f64": 64, "c64": 64, "c128": 128, "token": 0}

# What the functions below read: HLO text, a jax Lowered or Compiled (its ``as_text()``),
# or a `Module` parsed from one.
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


def kernel_bytes(program: Program) -> dict[str, int]:
    """{kernel name (`kernel_name`): bytes} for every kernel-level instruction
    (`kernel_instructions`): the bytes of its result plus those of its distinct operands,
    i.e. what it moves if it reads each operand and writes its result once. A kernel that
    reads part of an operand (a slice) moves less, one that reads an operand twice more.
    An operand written ``%name#k`` is element k of the tuple ``name``."""
    mod = parse(program)
    shapes = {i.name: i.shape for comp in mod.computations.values() for i in comp}
    out = {}
    for ins in kernel_instructions(mod):
        total = shape_bytes(ins.shape)
        for operand in dict.fromkeys(operands(ins)):
            name, _, index = operand.partition("#")
            shape = shapes.get(name, "")
            if index.isdigit():
                elements = tuple_elements(shape)
                shape = elements[int(index)] if int(index) < len(elements) else ""
            total += shape_bytes(shape)
        out[kernel_name(ins.name)] = total
    return out


def kernel_instructions(program: Program) -> list[Instruction]:
    """The instructions that launch work: the entry's, looking into calls (command
    buffers), async wrappers, while bodies and conditionals; not into fusions, whose
    bodies are one kernel each. Parameters, tuples, bitcasts and the like are left out.
    A while body's instructions count once, however many times it runs."""
    return [ins for _, ins in _walk(parse(program))]


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


def count_kernels(program: Program) -> dict[str, int]:
    """Kernel-level instructions by opcode, e.g. ``{'copy': 3, 'custom-call': 1, 'fusion': 2}``."""
    return dict(sorted(collections.Counter(i.opcode for i in kernel_instructions(program)).items()))


def _target(ins: Instruction) -> str:
    m = _TARGET.search(ins.line)
    return m.group(1) if m else "?"


def custom_calls(program: Program) -> dict[str, int]:
    """Custom calls anywhere in the module by target, e.g. ``{'jax_fp8_update': 1,
    '__cublas$lt$matmul$f8': 72}`` (cuBLAS GEMMs, FFI kernels, ...)."""
    mod = parse(program)
    counts = collections.Counter(_target(i) for comp in mod.computations.values()
                                 for i in comp if i.opcode == "custom-call")
    return dict(sorted(counts.items()))


def count_custom_calls(program: Program, target: str) -> int:
    """How many custom calls to ``target`` the module has (e.g. ``"jax_fp8_update"``)."""
    return custom_calls(program).get(target, 0)


def computations_calling(program: Program, target: str) -> list[str]:
    """Names of the computations holding a custom call to ``target`` (e.g. a command buffer)."""
    return [name for name, comp in parse(program).computations.items()
            if any(i.opcode == "custom-call" and _target(i) == target for i in comp)]


def _fusion_kind(ins: Instruction) -> str:
    m = _BACKEND_KIND.search(ins.line) or _FUSION_KIND.search(ins.line)
    return m.group(1) if m else "?"


def fusion_kinds(program: Program) -> dict[str, int]:
    """Kernel-level fusions by kind: ``kLoop``, ``kInput``, or a backend kind such as
    ``__triton_gemm``."""
    counts = collections.Counter(_fusion_kind(i) for i in kernel_instructions(program)
                                 if i.opcode == "fusion")
    return dict(sorted(counts.items()))


def _dots(mod: Module, name: str, seen: set) -> list[bool]:
    """FP8-ness of every dot in computation ``name`` and the computations it calls."""
    if name in seen:
        return []
    seen.add(name)
    comp = mod.computations.get(name, ())
    types = {i.name: i.shape for i in comp}
    found = []
    for ins in comp:
        if ins.opcode in _DOTS:
            found.append(any(_is_fp8(d) for op in operands(ins)
                             for d in _dtypes(types.get(op, ""))))
        for c in _callees(ins.line):
            found += _dots(mod, c, seen)
    return found


def gemms(program: Program) -> list[Gemm]:
    """The kernel-level GEMMs: GEMM library custom calls (target with "gemm"/"matmul"),
    fusions whose body has a dot (e.g. Triton GEMMs) and bare dots."""
    mod = parse(program)
    out = []
    for comp, ins in _walk(mod):
        if ins.opcode == "custom-call":
            target = _target(ins)
            if re.search(r"gemm|matmul", target, re.IGNORECASE):
                out.append(Gemm(ins.name, target, target.endswith("$f8")))
        elif ins.opcode == "fusion":
            dots = [f for c in _callees(ins.line) for f in _dots(mod, c, set())]
            if dots:
                out.append(Gemm(ins.name, _fusion_kind(ins), any(dots)))
        elif ins.opcode in _DOTS:
            types = {i.name: i.shape for i in mod.computations[comp]}
            fp8 = any(_is_fp8(d) for op in operands(ins) for d in _dtypes(types.get(op, "")))
            out.append(Gemm(ins.name, ins.opcode, fp8))
    return out


_DOT_DIMS = {side: re.compile(side + r"_dims=\{([\d,]*)\}")
             for side in ("lhs_contracting", "lhs_batch")}
_GEMM_CONFIG_DIMS = {side: re.compile(r'"' + side + r'_dimensions"\s*:\s*\[([^\]]*)\]')
                     for side in ("lhs_contracting", "lhs_batch")}


def _dims(shape: str) -> list[int] | None:
    m = _ARRAY.search(shape)
    if m is None:
        return None
    dims = [d.strip() for d in m.group(2).replace("<=", "").split(",") if d.strip()]
    return [int(d) for d in dims] if all(d.isdigit() for d in dims) else None


def _size(lhs: list[int], rhs: list[int], contracting, batch) -> GemmSize | None:
    try:
        k = math.prod(lhs[i] for i in contracting)
        b = math.prod(lhs[i] for i in batch)
    except IndexError:
        return None
    if not k or not b:
        return None
    return GemmSize(b, math.prod(lhs) // (b * k), math.prod(rhs) // (b * k), k)


def gemm_operands(ins: Instruction) -> list[str]:
    """The names of a GEMM instruction's two matrix operands (A and B): a dot's and a cuBLAS
    call's first two, jax_fp8's block-scaled GEMM's first and third (it takes a, a's scales,
    b, b's scales)."""
    names = operands(ins)
    if ins.opcode == "custom-call" and _target(ins).startswith("jax_fp8_block_gemm"):
        return names[0:4:2]
    return names[:2]


def _gemm_size(mod: Module, comp: str, ins: Instruction) -> GemmSize | None:
    """The sizes of a GEMM custom call or dot ``ins`` of computation ``comp``: its operands'
    shapes and its contracting and batch axes (a dot's attributes, a cuBLAS call's
    ``dot_dimension_numbers``; without them, a matrix product). jax_fp8's block-scaled
    GEMM takes (a, a's scales, b, b's scales), a [..., M, K] and b [..., N, K]."""
    types = {i.name: i.shape for i in mod.computations.get(comp, ())}
    block = ins.opcode == "custom-call" and _target(ins).startswith("jax_fp8_block_gemm")
    shapes = [_dims(types.get(op.partition("#")[0], "")) for op in gemm_operands(ins)]
    if len(shapes) < 2 or None in shapes:
        return None
    lhs, rhs = cast("list[list[int]]", shapes)
    if block:
        return _size(lhs, rhs, (len(lhs) - 1,), tuple(range(len(lhs) - 2)))
    patterns = _DOT_DIMS if ins.opcode in _DOTS else _GEMM_CONFIG_DIMS
    found = {side: p.search(ins.line) for side, p in patterns.items()}
    if found["lhs_contracting"] is None:
        # A matrix product in one of its layouts: K is the size the two operands share
        # that the result does not have.
        out = math.prod(_dims(tuple_elements(ins.shape)[0]) or [0])
        if len(lhs) != 2 or len(rhs) != 2:
            return None
        for i in (1, 0):
            for j in (0, 1):
                if lhs[i] == rhs[j] and lhs[1 - i] * rhs[1 - j] == out:
                    return GemmSize(1, lhs[1 - i], rhs[1 - j], lhs[i])
        return None
    axes = {side: [int(a) for a in re.findall(r"\d+", m.group(1))] if m else []
            for side, m in found.items()}
    return _size(lhs, rhs, axes["lhs_contracting"], axes["lhs_batch"])


def _first_dot(mod: Module, name: str, seen: set):
    if name in seen:
        return None
    seen.add(name)
    for ins in mod.computations.get(name, ()):
        if ins.opcode in _DOTS:
            return name, ins
        for c in _callees(ins.line):
            found = _first_dot(mod, c, seen)
            if found:
                return found
    return None


def gemm_sizes(program: Program) -> dict[str, GemmSize]:
    """{instruction name: `GemmSize`} for every kernel-level GEMM of `gemms` whose sizes
    the HLO gives (a fusion's are those of the first dot in its body), e.g.
    ``{'custom-call.3': GemmSize(batch=1, m=8192, n=4096, k=14336)}``; ``.flops`` counts
    the GEMM's multiply-adds twice."""
    mod = parse(program)
    out = {}
    for comp, ins in _walk(mod):
        size = None
        if ins.opcode == "custom-call" and re.search(r"gemm|matmul", _target(ins), re.IGNORECASE):
            # cuBLAS calls take A and B first; jax_fp8's block-scaled GEMM as above
            size = _gemm_size(mod, comp, ins)
        elif ins.opcode == "fusion":
            for c in _callees(ins.line):
                found = _first_dot(mod, c, set())
                if found:
                    size = _gemm_size(mod, *found)
                    break
        elif ins.opcode in _DOTS:
            size = _gemm_size(mod, comp, ins)
        if size is not None:
            out[ins.name] = size
    return out


def fp8_gemms(program) -> dict[str, int]:
    """FP8 GEMMs by kind, e.g.
    ``{'__cublas$lt$matmul$f8': 240, '__triton_nested_gemm_fusion': 48}``."""
    return dict(sorted(collections.Counter(g.kind for g in gemms(program) if g.fp8).items()))


def collectives(program: Program) -> list[Collective]:
    """Every collective of the module, in order (async pairs once, with the ``-done``'s
    result as theirs), e.g.
    ``[Collective('all-reduce.3', 'all-reduce', ('f32',), 4096, 'add')]``."""
    mod = parse(program)
    out = []
    for comp in mod.computations.values():
        done = {}
        for ins in comp:
            if ins.opcode.endswith("-done"):
                for op in operands(ins)[:1]:
                    done[op] = ins.shape
        for ins in comp:
            base = ins.opcode[:-len("-start")] if ins.opcode.endswith("-start") else ins.opcode
            if base not in _COLLECTIVES:
                continue
            shape = done.get(ins.name, ins.shape)
            reduction = None
            if base in ("all-reduce", "reduce-scatter"):
                for c in _callees(ins.line)[:1]:
                    body = mod.computations.get(c, ())
                    roots = [i for i in body if "ROOT" in i.line.split("=")[0]]
                    reduction = roots[-1].opcode if roots else None
            dtypes = tuple(dict.fromkeys(_dtypes(shape)))
            out.append(Collective(ins.name, base, dtypes, shape_bytes(shape), reduction))
    return out


def count_collectives(program: Program) -> dict[str, int]:
    """Collectives by opcode, e.g. ``{'all-gather': 8, 'all-reduce': 2}``."""
    return dict(sorted(collections.Counter(c.opcode for c in collectives(program)).items()))


def all_reduce_kinds(program: Program) -> dict[str, int]:
    """All-reduces by reduction, e.g. ``{'add': 1, 'maximum': 1}`` (gradients and amaxes)."""
    counts = collections.Counter(c.reduction or "unknown" for c in collectives(program)
                                 if c.opcode == "all-reduce")
    return dict(sorted(counts.items()))


def kernel_name(instruction: str) -> str:
    """The GPU kernel name XLA gives an instruction's kernel: ``loop_add_fusion.3`` ->
    ``loop_add_fusion_3`` (the key of `op_families` and `source_ops`)."""
    return instruction.replace(".", "_").replace("-", "_")


_FUSION_FAMILIES = {"kLoop": "loop fusion", "kInput": "input fusion",
                    "kOutput": "output fusion", "__triton": "triton fusion"}


def op_families(program: Program) -> dict[str, str]:
    """The family of each kernel-level instruction, by `kernel_name`, for `trace.by_family`:
    ``"fp8 gemm"``/``"gemm"`` for GEMMs, ``"custom-call:<target>"``,
    ``"collective:<opcode>"``, ``"loop fusion"``/``"input fusion"``/``"triton fusion"``
    by fusion kind. (Kernels the trace names otherwise, e.g. cuBLAS's, it classifies by name.)"""
    mod = parse(program)
    out = {kernel_name(g.name): "fp8 gemm" if g.fp8 else "gemm" for g in gemms(mod)}
    for ins in kernel_instructions(mod):
        key = kernel_name(ins.name)
        if key in out:
            continue
        if ins.opcode == "custom-call":
            out[key] = f"custom-call:{_target(ins)}"
        elif ins.opcode == "fusion":
            out[key] = _FUSION_FAMILIES.get(_fusion_kind(ins), "fusion")
    for c in collectives(mod):
        out[kernel_name(c.name)] = f"collective:{c.opcode}"
    return out


def source_ops(program: Program) -> dict[str, str]:
    """The JAX op behind each kernel, by `kernel_name`: the instruction's ``op_name``
    metadata, else that of the first instruction of its fused computation, e.g.
    ``{'loop_add_fusion_3': 'jit(step)/jvp(Model)/block0/add'}``."""
    mod = parse(program)
    first = {}
    for name, comp in mod.computations.items():
        for ins in comp:
            m = _OP_NAME.search(ins.line)
            if m:
                first[name] = m.group(1)
                break
    out = {}
    for ins in kernel_instructions(mod):
        m = _OP_NAME.search(ins.line)
        op = m.group(1) if m else next((first[c] for c in _callees(ins.line) if c in first), None)
        if op:
            out[kernel_name(ins.name)] = op
    return out
