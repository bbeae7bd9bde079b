"""`fp8_einsum`: a two-operand einsum as one `fp8_dot_general`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from jax_fp8.gemm.dot_general import fp8_dot_general
from jax_fp8.meta import Fp8Meta

__all__ = ["fp8_einsum"]


def fp8_einsum(eqn: str, lhs: ArrayLike, rhs: ArrayLike, meta: Fp8Meta,
               preferred_element_type: DTypeLike | None = None, *,
               min_fp8_flops: float | str = 0) -> tuple[jax.Array, Fp8Meta]:
    """Two-operand einsum (``"...,...->..."``) as one `fp8_dot_general`; returns (out, meta).

    Letters in both operands and the output are batch axes, in both operands only are
    contracted, in one operand only are kept (or summed first when absent from the output).
    Repeated letters within one operand (diagonals) and ellipses are not supported.
    ``min_fp8_flops`` as in `fp8_dot_general`.
    """
    eqn = eqn.replace(" ", "")
    if "..." in eqn:
        raise ValueError("fp8_einsum does not support '...'")
    if "->" not in eqn:
        raise ValueError("fp8_einsum needs an explicit output: 'ab,bc->ac'")
    ins, out = eqn.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        raise ValueError(f"fp8_einsum takes exactly two operands, got {eqn!r}")
    a, b = parts
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, spec, x in (("lhs", a, lhs), ("rhs", b, rhs)):
        if len(set(spec)) != len(spec):
            raise ValueError(f"fp8_einsum: repeated letter in {name} spec {spec!r}")
        if len(spec) != x.ndim:
            raise ValueError(f"fp8_einsum: {name} spec {spec!r} has {len(spec)} letters but "
                             f"{name} has {x.ndim} axes")
    if len(set(out)) != len(out) or not set(out) <= set(a) | set(b):
        raise ValueError(f"fp8_einsum: bad output spec {out!r}")
    # Sum away letters that appear in one operand only and not in the output.
    for side in (0, 1):
        spec, other = (a, b) if side == 0 else (b, a)
        drop = [i for i, c in enumerate(spec) if c not in other and c not in out]
        if drop:
            keep = "".join(c for i, c in enumerate(spec) if i not in drop)
            if side == 0:
                lhs, a = jnp.sum(lhs, axis=tuple(drop)), keep
            else:
                rhs, b = jnp.sum(rhs, axis=tuple(drop)), keep
    batch = [c for c in a if c in b and c in out]
    contract = [c for c in a if c in b and c not in out]
    dn = ((tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
          (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
    y, meta = fp8_dot_general(lhs, rhs, dn, meta, preferred_element_type=preferred_element_type,
                              min_fp8_flops=min_fp8_flops)
    produced = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
    perm = tuple(produced.index(c) for c in out)
    if perm != tuple(range(len(perm))):
        y = jnp.transpose(y, perm)
    return y, meta
