"""`ragged_dot`: ``jax.lax.ragged_dot`` (a mixture-of-experts layer's grouped GEMM) without FP8,
as one grouped kernel on a GPU.

XLA:GPU lowers ``jax.lax.ragged_dot`` by expanding it into a dense product over all G experts
(G times the FLOPs and a G-times temporary). `ragged_dot` is the same function, with the
same gradients, computed on an SM90 GPU by CUTLASS's grouped GEMM with the group sizes on the
device (the primitive ``jax_fp8_ragged_dot``, `jax_fp8._primitives.ragged_dot`), and by
``jax.lax.ragged_dot_general`` elsewhere. It is what an expert GEMM kept out of FP8 runs, and
the baseline of every FP8 mixture-of-experts figure (docs/moe.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jax_fp8._primitives import ragged_dot as _rd

__all__ = ["ragged_dot"]

_TYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def ragged_dot(lhs: ArrayLike, rhs: ArrayLike, group_sizes: ArrayLike, precision: Any = None,
               preferred_element_type: DTypeLike | None = None,
               group_offset: ArrayLike | None = None) -> jax.Array:
    """``jax.lax.ragged_dot``: lhs [M, K] (the tokens, sorted by expert) times rhs [G, K, N]
    (one weight per expert), group_sizes integer [G] -> out [M, N].

    Rows ``[offset_g, offset_g + size_g)`` are multiplied by ``rhs[g]``, rows past the groups
    are 0; the sizes are clamped in order (a negative size counts as 0, a group reaching past
    row M is cut there). Products are summed in float32 and rounded once to the result type
    (``preferred_element_type``, else the operands' type). Differentiable in lhs and rhs to
    any order (``jax.grad``, ``jax.jvp``, ``jax.vjp``), every product of the gradients a
    grouped GEMM too; ``group_sizes`` gets no gradient.

    On an SM90 GPU with jax_fp8's CUDA module built with CUTLASS, bfloat16 operands with K
    and N multiples of 8 run as one grouped kernel each (forward, input gradient, weight
    gradient); every other case, and every other platform, runs ``jax.lax.ragged_dot_general``
    with float32 accumulation. ``jax_fp8.devtools.explain`` says which runs and why. Under a
    jit over several devices each device runs the kernel on the tokens it holds.

    Args:
      precision: passed to ``jax.lax.ragged_dot`` for operands the kernel does not take
        (16-bit operands have one precision).
      preferred_element_type: bfloat16, float16 or float32.
      group_offset: not supported, as in ``jax.lax.ragged_dot`` (NotImplementedError).
    """
    if group_offset is not None:
        raise NotImplementedError("ragged_dot: group_offset is not supported (nor by "
                                  "jax.lax.ragged_dot)")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    group_sizes = jnp.asarray(group_sizes)
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"ragged_dot: need lhs [M, K] and rhs [G, K, N], got "
                         f"{list(lhs.shape)} and {list(rhs.shape)}")
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype,
                                                                   jnp.integer):
        raise ValueError(f"ragged_dot: group_sizes must be integer [{rhs.shape[0]}] (one size "
                         f"per group of rhs), got {group_sizes.dtype}{list(group_sizes.shape)}")
    dtype = np.dtype(jnp.result_type(lhs, rhs))
    out_dtype = np.dtype(preferred_element_type if preferred_element_type is not None
                         else dtype)
    if dtype not in _TYPES or out_dtype not in _TYPES or (
            precision is not None and dtype == np.float32):
        return lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type)
    return _rd.ragged_product(lhs.astype(dtype), rhs.astype(dtype),
                              group_sizes.astype(jnp.int32), mode=_rd.FORWARD,
                              out_dtype=out_dtype)
