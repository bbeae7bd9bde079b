"""ScalingState: the delayed-scaling state of one FP8 tensor (or a stack of them)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax_fp8 import recipe as recipe_lib


_CANONICAL: dict = {}  # fp8_dtype as given -> np.dtype (only valid FP8 dtypes are stored)


@dataclasses.dataclass(frozen=True)
class ScalingState:
    """A registered pytree; leaves amax_history, scale, scale_inv; fp8_dtype is static.

    Attributes:
      amax_history: float32 [..., L]; index 0 is the staging slot for the next amax.
      scale: float32 [...]; quantize as x_fp8 = saturate_cast(x * scale).
      scale_inv: float32 [...]; 1 / scale, the dequantization factor.
      fp8_dtype: the FP8 dtype these tensors are quantized to (static).
    """

    amax_history: Any
    scale: Any
    scale_inv: Any
    fp8_dtype: Any = dataclasses.field(default=jnp.float8_e4m3fn)

    def __post_init__(self):
        # One spelling of the dtype, so tree structures compare and hash equal. JAX
        # rebuilds states on every unflatten, so the common case is a dict lookup.
        try:
            dtype = _CANONICAL.get(self.fp8_dtype)
        except TypeError:  # unhashable: let canonical_fp8_dtype name the problem
            dtype = recipe_lib.canonical_fp8_dtype(self.fp8_dtype)
        if dtype is None:
            dtype = recipe_lib.canonical_fp8_dtype(self.fp8_dtype)
            _CANONICAL[self.fp8_dtype] = dtype
        object.__setattr__(self, "fp8_dtype", dtype)

    @classmethod
    def create(cls, shape=(), history_len: int = 1024, fp8_dtype=jnp.float8_e4m3fn,
               ) -> "ScalingState":
        """A fresh state: zero history, scale = scale_inv = 1."""
        if isinstance(history_len, bool) or int(history_len) != history_len or history_len < 1:
            raise ValueError(f"history_len must be an integer >= 1, got {history_len!r}")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape must have non-negative sizes, got {shape}")
        dtype = recipe_lib.canonical_fp8_dtype(fp8_dtype)
        return cls(amax_history=jnp.zeros(shape + (int(history_len),), jnp.float32),
                   scale=jnp.ones(shape, jnp.float32), scale_inv=jnp.ones(shape, jnp.float32),
                   fp8_dtype=dtype)

    @property
    def history_len(self) -> int:
        return self.amax_history.shape[-1]


jax.tree_util.register_dataclass(ScalingState,
                                 data_fields=["amax_history", "scale", "scale_inv"],
                                 meta_fields=["fp8_dtype"])
