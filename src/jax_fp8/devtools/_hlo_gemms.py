"""The GEMMs of a compiled HLO program: which kernels are GEMMs, FP8 or not, and their sizes.

Part of `jax_fp8.devtools.hlo` (which re-exports every public name here): a GEMM is a
GEMM library custom call (jax_fp8's grouped GEMMs included), a fusion around a dot, or a
bare dot.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterable
from typing import NamedTuple, cast

from jax_fp8._primitives import grouped_gemm, grouped_wgrad, ragged_dot
from jax_fp8.devtools._hlo_text import (
    _ARRAY,
    Instruction,
    Module,
    Program,
    _callees,
    _dtypes,
    _fusion_kind,
    _is_fp8,
    _target,
    _walk,
    operands,
    parse,
    tuple_elements,
)

# jax_fp8's grouped GEMM custom calls: G products in one kernel, counted as one GEMM (FP8
# where an operand is). Not all their targets say "gemm", as a library call's do.
_GROUPED_TARGETS = frozenset({grouped_gemm.TARGET, grouped_wgrad.TARGET, ragged_dot.TARGET})


def _is_gemm_call(target: str) -> bool:
    return target in _GROUPED_TARGETS or re.search(r"gemm|matmul", target, re.IGNORECASE) \
        is not None

_DOTS = frozenset({"dot", "scaled-dot", "ragged-dot"})


class Gemm(NamedTuple):
    """A kernel-level GEMM: a library call, a fusion around a dot, or a bare dot."""

    name: str      # the instruction's name
    kind: str      # custom-call target, fusion kind (e.g. "__triton_gemm") or "dot"
    fp8: bool      # an FP8 operand (or a cuBLAS FP8 call, target ending in "$f8")


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


def _dots(mod: Module, name: str, seen: set[str]) -> list[bool]:
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
    """The kernel-level GEMMs: GEMM library custom calls (target with "gemm"/"matmul", and
    jax_fp8's grouped GEMMs: its FP8 grouped GEMM and weight gradient, `jax_fp8.ragged_dot`'s
    kernel), fusions whose body has a dot (e.g. Triton GEMMs) and bare dots."""
    mod = parse(program)
    out = []
    for comp, ins in _walk(mod):
        if ins.opcode == "custom-call":
            target = _target(ins)
            if _is_gemm_call(target):
                types = {i.name: i.shape for i in mod.computations[comp]}
                fp8 = target.endswith("$f8") or any(
                    _is_fp8(d) for op in gemm_operands(ins)
                    for d in _dtypes(types.get(op.partition("#")[0], "")))
                out.append(Gemm(ins.name, target, fp8))
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


def _size(lhs: list[int], rhs: list[int], contracting: Iterable[int],
          batch: Iterable[int]) -> GemmSize | None:
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
    if ins.opcode == "custom-call" and _target(ins) in _GROUPED_TARGETS:
        return _grouped_size(lhs, _dims(tuple_elements(ins.shape)[0]))
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


def _grouped_size(lhs: list[int], out: list[int] | None) -> GemmSize | None:
    """A grouped GEMM's sizes summed over its groups, from its first operand and result:
    a product [M, K] -> [M, N] (all M rows, those past the last group included; K
    contracted) or a weight gradient [G, K, N] (its first operand [M, K] or [K, M], the M
    rows contracted, padding included): an upper bound of the FLOPs it computes."""
    if out is None or len(lhs) != 2:
        return None
    if len(out) == 2:
        return GemmSize(1, out[0], out[1], lhs[1])
    if len(out) == 3 and out[1] in lhs:
        return GemmSize(1, out[1], out[2], math.prod(lhs) // out[1])
    return None


def _first_dot(mod: Module, name: str, seen: set[str]) -> tuple[str, Instruction] | None:
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
        if ins.opcode == "custom-call" and _is_gemm_call(_target(ins)):
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


def fp8_gemms(program: Program) -> dict[str, int]:
    """FP8 GEMMs by kind, e.g.
    ``{'__cublas$lt$matmul$f8': 240, '__triton_nested_gemm_fusion': 48}``."""
    return dict(sorted(collections.Counter(g.kind for g in gemms(program) if g.fp8).items()))
