"""jax_fp8: FP8 delayed scaling for JAX, with the whole model's state update fused.

Public API (see SPEC.md):
  amax_and_scale_update  one tensor or a stack [..., L] -> (history, scale, scale_inv)
  update_states          every ScalingState of a pytree, one custom call
  ScalingState           the state of one FP8 tensor (a pytree)
  DelayedScaling, Format the recipe
"""

from jax_fp8._registration import HAS_CPU_KERNEL, HAS_CUDA_KERNEL
from jax_fp8.recipe import DelayedScaling, Format, fp8_max, scaled_max
from jax_fp8.state import ScalingState
from jax_fp8.update import amax_and_scale_update, reduce_amaxes, update_states

__version__ = "0.1.0"

__all__ = [
    "DelayedScaling",
    "Format",
    "HAS_CPU_KERNEL",
    "HAS_CUDA_KERNEL",
    "ScalingState",
    "amax_and_scale_update",
    "fp8_max",
    "scaled_max",
    "reduce_amaxes",
    "update_states",
]

# Training layer (jax_fp8.ops): quantize, FP8 dot_general with delayed scaling, step update.
from jax_fp8.ops import (Fp8Meta, combine_fp8_grads, compute_amax, dequantize,  # noqa: E402
                         fp8_dot_general, fp8_einsum, new_fp8_state, quantize)
__all__ += ["Fp8Meta", "combine_fp8_grads", "compute_amax", "dequantize", "fp8_dot_general",
            "fp8_einsum", "new_fp8_state", "quantize"]

# A model's FP8 states as a few stacked arrays (fewer jit arguments).
from jax_fp8.packing import PackedStates, pack_states, unpack_states  # noqa: E402
__all__ += ["PackedStates", "pack_states", "unpack_states"]
