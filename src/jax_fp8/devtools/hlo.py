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
import re
from typing import NamedTuple

from jax_fp8.devtools import _hlo_text
from jax_fp8.devtools._hlo_gemms import (
    Gemm,
    GemmSize,
    fp8_gemms,
    gemm_operands,
    gemm_sizes,
    gemms,
)
from jax_fp8.devtools._hlo_text import (
    Instruction,
    Module,
    Program,
    operands,
    parse,
    shape_bytes,
    text_of,
    tuple_elements,
)

__all__ = [
    "Collective", "Gemm", "GemmSize", "Instruction", "Module", "all_reduce_kinds",
    "collectives", "computations_calling", "count_collectives", "count_custom_calls",
    "count_kernels", "custom_calls", "fp8_gemms", "fusion_kinds", "gemm_operands",
    "gemm_sizes", "gemms", "kernel_bytes", "kernel_instructions", "kernel_name",
    "op_families", "operands", "parse", "shape_bytes", "source_ops", "text_of",
    "tuple_elements",
]


class Collective(NamedTuple):
    """A collective instruction (an async ``-start``/``-done`` pair counts once)."""

    name: str
    opcode: str                # "all-reduce", "all-gather", "reduce-scatter", ...
    dtypes: tuple[str, ...]    # element types of the result, e.g. ("f32",)
    bytes: int                 # bytes of the result
    reduction: str | None      # all-reduce / reduce-scatter: the reducer's root, e.g. "maximum"


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                "collective-permute", "collective-broadcast")


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
    return [ins for _, ins in _hlo_text._walk(parse(program))]


def count_kernels(program: Program) -> dict[str, int]:
    """Kernel-level instructions by opcode, e.g. ``{'copy': 3, 'custom-call': 1, 'fusion': 2}``."""
    return dict(sorted(collections.Counter(i.opcode for i in kernel_instructions(program)).items()))


def custom_calls(program: Program) -> dict[str, int]:
    """Custom calls anywhere in the module by target, e.g. ``{'jax_fp8_update': 1,
    '__cublas$lt$matmul$f8': 72}`` (cuBLAS GEMMs, FFI kernels, ...)."""
    mod = parse(program)
    counts = collections.Counter(_hlo_text._target(i) for comp in mod.computations.values()
                                 for i in comp if i.opcode == "custom-call")
    return dict(sorted(counts.items()))


def count_custom_calls(program: Program, target: str) -> int:
    """How many custom calls to ``target`` the module has (e.g. ``"jax_fp8_update"``)."""
    return custom_calls(program).get(target, 0)


def computations_calling(program: Program, target: str) -> list[str]:
    """Names of the computations holding a custom call to ``target`` (e.g. a command buffer)."""
    return [name for name, comp in parse(program).computations.items()
            if any(i.opcode == "custom-call" and _hlo_text._target(i) == target for i in comp)]


def fusion_kinds(program: Program) -> dict[str, int]:
    """Kernel-level fusions by kind: ``kLoop``, ``kInput``, or a backend kind such as
    ``__triton_gemm``."""
    counts = collections.Counter(_hlo_text._fusion_kind(i) for i in kernel_instructions(program)
                                 if i.opcode == "fusion")
    return dict(sorted(counts.items()))


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
                for c in _hlo_text._callees(ins.line)[:1]:
                    body = mod.computations.get(c, ())
                    roots = [i for i in body if "ROOT" in i.line.split("=")[0]]
                    reduction = roots[-1].opcode if roots else None
            dtypes = tuple(dict.fromkeys(_hlo_text._dtypes(shape)))
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
            out[key] = f"custom-call:{_hlo_text._target(ins)}"
        elif ins.opcode == "fusion":
            out[key] = _FUSION_FAMILIES.get(_hlo_text._fusion_kind(ins), "fusion")
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
        op = m.group(1) if m else next(
            (first[c] for c in _hlo_text._callees(ins.line) if c in first), None)
        if op:
            out[kernel_name(ins.name)] = op
    return out
