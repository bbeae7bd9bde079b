"""jax_fp8: FP8 training for JAX, with a whole model's delayed-scaling update fused into one op.

Public API (reference: ``docs/reference/``, built by ``mkdocs build``; the arithmetic in
``docs/semantics.md``):

- **recipes**: `DelayedScaling`, `Float8CurrentScaling`, `Float8BlockScaling`,
  `MXFP8BlockScaling`, `Format`, `fp8_max`, `scaled_max`; `Recipe` (the interface each
  implements)
- **state**: `ScalingState`, `update_states`, `amax_and_scale_update`, `reduce_amaxes`
- **training ops**: `Fp8Meta`, `fp8_dot_general`, `fp8_einsum`, `fp8_ragged_dot`,
  `ragged_dot` (``jax.lax.ragged_dot`` as one grouped kernel on a GPU, without FP8),
  `fp8_ragged_dot_general`, `new_fp8_state`,
  `combine_fp8_grads`, `AmaxGrad`, `fp8_grads_from_cotangents`, `amax_cotangents`,
  `frozen_scales`, `check_fp8_updated`
- **quantization**: `quantize`, `dequantize`, `compute_amax`, `quantize_blocks`,
  `quantize_mxfp8`, `scale_from_amax`
- **packing**: `PackedStates`, `pack_states`, `unpack_states`
- **conversion**: `Fp8Rule` (which GEMMs a framework's `fp8_model` converts),
  `Fp8ConversionWarning` (a matched module that runs no GEMM in FP8)
- **kernels, export**: `HAS_CPU_KERNEL`, `HAS_CUDA_KERNEL`, `export_disabled_checks`
- **frameworks**: `jax_fp8.flax` (linen), `jax_fp8.flax.nnx`, `jax_fp8.flax.interop`,
  `jax_fp8.equinox`
"""

# grouped_gemm, grouped_wgrad: register jax_fp8_grouped_gemm and jax_fp8_grouped_wgrad (their
# FFI targets are in every module's table).
# interception.ragged: the converters' interception of jax.lax.ragged_dot.
from jax_fp8._primitives import (
    grouped_gemm as _grouped_gemm,  # noqa: F401
    grouped_wgrad as _grouped_wgrad,  # noqa: F401
    ragged_dot as _ragged_dot_primitive,  # noqa: F401
)
from jax_fp8._registration import HAS_CPU_KERNEL, HAS_CUDA_KERNEL, export_disabled_checks
from jax_fp8.gemm.dot_general import fp8_dot_general
from jax_fp8.gemm.einsum import fp8_einsum
from jax_fp8.gemm.ragged import ragged_dot
from jax_fp8.gemm.ragged_fp8 import fp8_ragged_dot, fp8_ragged_dot_general
from jax_fp8.interception import ragged as _interception_ragged  # noqa: F401
from jax_fp8.meta import (
    AmaxGrad,
    Fp8Meta,
    amax_cotangents,
    check_fp8_updated,
    combine_fp8_grads,
    fp8_grads_from_cotangents,
    frozen_scales,
    new_fp8_state,
)
from jax_fp8.packing import PackedStates, pack_states, unpack_states
from jax_fp8.quantization import compute_amax, dequantize, quantize
from jax_fp8.quantization.blockwise import quantize_blocks, scale_from_amax
from jax_fp8.recipe import Format, Recipe, fp8_max, scaled_max
from jax_fp8.recipes import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
)
from jax_fp8.recipes.mxfp8 import quantize_mxfp8
from jax_fp8.rules import Fp8ConversionWarning, Fp8Rule
from jax_fp8.state import ScalingState
from jax_fp8.update import amax_and_scale_update, reduce_amaxes, update_states

__version__ = "0.2.0"

__all__ = [
    "AmaxGrad",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "Fp8ConversionWarning",
    "Fp8Meta",
    "Fp8Rule",
    "HAS_CPU_KERNEL",
    "HAS_CUDA_KERNEL",
    "MXFP8BlockScaling",
    "PackedStates",
    "Recipe",
    "ScalingState",
    "amax_and_scale_update",
    "amax_cotangents",
    "check_fp8_updated",
    "combine_fp8_grads",
    "compute_amax",
    "dequantize",
    "export_disabled_checks",
    "fp8_dot_general",
    "fp8_einsum",
    "fp8_grads_from_cotangents",
    "fp8_ragged_dot",
    "fp8_ragged_dot_general",
    "fp8_max",
    "frozen_scales",
    "new_fp8_state",
    "pack_states",
    "quantize",
    "quantize_blocks",
    "quantize_mxfp8",
    "ragged_dot",
    "reduce_amaxes",
    "scale_from_amax",
    "scaled_max",
    "unpack_states",
    "update_states",
]
