"""FP8 formats and the scaling recipes: delayed, current and blockwise (Transformer Engine's
names)."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, TypeAlias

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

ALGORITHMS = ("max", "most_recent")

# The FP8 dtypes the library quantizes to (docs/semantics.md), with their largest finite
# value. Others (float8_e8m0fnu, float8_e3m4, float8_e4m3, float8_e4m3b11fnuz) are refused:
# their ranges and NaN/inf encodings do not follow the saturating cast used here.
FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2),
              np.dtype(jnp.float8_e4m3fnuz), np.dtype(jnp.float8_e5m2fnuz))


def canonical_fp8_dtype(fp8_dtype, name: str = "fp8_dtype") -> np.dtype:
    """`fp8_dtype` as a NumPy dtype, or a TypeError naming `name`."""
    try:
        dtype = np.dtype(fp8_dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must be one of the FP8 dtypes "
                        f"{', '.join('jnp.' + d.name for d in FP8_DTYPES)}; got {fp8_dtype!r}")
    return dtype


def fp8_max(fp8_dtype: DTypeLike) -> float:
    """Largest finite value of an FP8 dtype: 448 for e4m3fn, 57344 for e5m2, ..."""
    return float(jnp.finfo(canonical_fp8_dtype(fp8_dtype)).max)


def check_margin(margin) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float, np.integer, np.floating)):
        raise TypeError(f"margin must be a real number, got {margin!r}")
    if not math.isfinite(margin):
        raise ValueError(f"margin must be finite, got {margin!r}")
    return float(margin)


def scaled_max(fp8_dtype: DTypeLike, margin: float) -> float:
    """float32(fp8_max) * float32(2 ** -margin), computed once in float32 (docs/semantics.md).

    Returned as the Python float equal to that float32 value.
    """
    margin = check_margin(margin)
    try:
        factor = 2.0 ** -margin
    except OverflowError:  # a hugely negative margin: report it below, naming margin
        factor = math.inf
    with np.errstate(over="ignore", under="ignore"):
        value = np.float32(fp8_max(fp8_dtype)) * np.float32(factor)
    if not (np.isfinite(value) and value >= np.finfo(np.float32).tiny):
        raise ValueError(f"margin={margin} leaves no usable range: fp8_max * 2**-margin = "
                         f"{value} in float32")
    return float(value)


def check_algorithm(amax_compute_algo) -> str:
    if amax_compute_algo not in ALGORITHMS:
        raise ValueError(f"amax_compute_algo must be one of {ALGORITHMS}, "
                         f"got {amax_compute_algo!r}")
    return amax_compute_algo


class Format(enum.Enum):
    """Which FP8 dtype forward tensors and gradients use."""

    E4M3 = "E4M3"      # E4M3 everywhere
    HYBRID = "HYBRID"  # E4M3 forward (inputs, weights), E5M2 gradients

    @property
    def fwd_dtype(self) -> np.dtype:
        return np.dtype(jnp.float8_e4m3fn)

    @property
    def bwd_dtype(self) -> np.dtype:
        return np.dtype(jnp.float8_e5m2 if self is Format.HYBRID else jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed-scaling recipe: how every FP8 state of a model is updated.

    Attributes:
      history_len: length L of each amax history (>= 1).
      amax_compute_algo: "max" (max over the history) or "most_recent".
      margin: scale = fp8_max * 2**-margin / amax.
      fp8_format: Format.E4M3 or Format.HYBRID (E5M2 gradients).
      power_of_2_scale: round each scale down to a power of two.
      skip_unused: leave a state untouched when its staged amax is 0.
    """

    history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: float = 0.0
    fp8_format: Format = Format.HYBRID
    power_of_2_scale: bool = False
    skip_unused: bool = False

    def __post_init__(self):
        if (isinstance(self.history_len, bool)
                or not isinstance(self.history_len, (int, np.integer))
                or self.history_len < 1):
            raise ValueError(f"history_len must be an integer >= 1, got {self.history_len!r}")
        check_algorithm(self.amax_compute_algo)
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a jax_fp8.Format, got {self.fp8_format!r}")
        for dtype in (self.fp8_format.fwd_dtype, self.fp8_format.bwd_dtype):
            scaled_max(dtype, self.margin)  # validates margin
        _check_bool(self, "power_of_2_scale", "skip_unused")

    def replace(self, **changes: Any) -> DelayedScaling:
        """A copy with the given fields replaced (as ``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


def _check_bool(obj, *names):
    for name in names:
        if not isinstance(getattr(obj, name), (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {getattr(obj, name)!r}")


def _check_epsilon(amax_epsilon):
    if isinstance(amax_epsilon, bool) or not isinstance(
            amax_epsilon, (int, float, np.integer, np.floating)) \
            or not math.isfinite(amax_epsilon) or amax_epsilon < 0:
        raise ValueError(f"amax_epsilon must be a finite number >= 0, got {amax_epsilon!r}")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling:
    """Current (per-tensor, just-in-time) scaling: each tensor's scale from its own amax.

    ``scale = fp8_max / max(amax, amax_epsilon)`` computed right before the cast
    (``docs/semantics.md``, "Scale from an amax"). No state is kept.

    Attributes:
      fp8_format: Format.HYBRID (E5M2 gradients, the default) or Format.E4M3.
      power_of_2_scale: round each scale down to a power of two.
      amax_epsilon: lower bound applied to each amax before the division.
    """

    fp8_format: Format = Format.HYBRID
    power_of_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self):
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a jax_fp8.Format, got {self.fp8_format!r}")
        _check_bool(self, "power_of_2_scale")
        _check_epsilon(self.amax_epsilon)

    def replace(self, **changes: Any) -> Float8CurrentScaling:
        """A copy with the given fields replaced (as ``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling:
    """Blockwise scaling (DeepSeek-V3's recipe, TE's ``Float8BlockScaling``).

    One scale per ``1 x 128`` block (``*_block_scaling_dim=1``) or ``128 x 128`` tile
    (``=2``) of each GEMM operand laid out as ``[..., M, K]`` (K the contraction axis),
    from the block's own amax. At most one operand of a GEMM has 2-D blocks. No state
    is kept.

    Attributes:
      fp8_format: Format.E4M3 (the default, E4M3 everywhere) or Format.HYBRID.
      power_of_2_scale: round each scale down to a power of two (default True).
      amax_epsilon: lower bound applied to each block's amax.
      x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 or 2, for the
        input (activations), the kernel (weights) and the incoming gradient.
    """

    fp8_format: Format = Format.E4M3
    power_of_2_scale: bool = True
    amax_epsilon: float = 0.0
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self):
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a jax_fp8.Format, got {self.fp8_format!r}")
        _check_bool(self, "power_of_2_scale")
        _check_epsilon(self.amax_epsilon)
        dims = {}
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in (1, 2):
                raise ValueError(f"{name} must be 1 or 2, got {value!r}")
            dims[name] = value
        # Each GEMM pairs two of the three operands (fwd: x, w; dgrad: grad, w; wgrad:
        # grad, x); a cuBLASLt block-scaled GEMM takes at most one 128 x 128 operand.
        for a, b in (("x", "w"), ("grad", "w"), ("grad", "x")):
            if dims[f"{a}_block_scaling_dim"] == dims[f"{b}_block_scaling_dim"] == 2:
                raise ValueError(f"{a}_block_scaling_dim and {b}_block_scaling_dim cannot "
                                 f"both be 2: at most one operand of a GEMM has 2-D blocks")

    def block_shape(self, role: str) -> tuple:
        """The block shape of ``role`` ("x", "w" or "grad"): (1, 128) or (128, 128)."""
        dim = getattr(self, f"{role}_block_scaling_dim")
        return (1, 128) if dim == 1 else (128, 128)

    def replace(self, **changes: Any) -> Float8BlockScaling:
        """A copy with the given fields replaced (as ``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)
# Any of the three recipes, for type hints.
Recipe: TypeAlias = "DelayedScaling | Float8CurrentScaling | Float8BlockScaling"


def check_recipe(recipe, name: str = "recipe"):
    """`recipe` if it is one of the three recipes, else a TypeError naming `name`."""
    if isinstance(recipe, type) and issubclass(recipe, RECIPES):
        raise TypeError(f"{name} must be a recipe instance, got the class {recipe.__name__}: "
                        f"pass `{recipe.__name__}()`, an instance (e.g. "
                        f"`{recipe.__name__}()` for the defaults)")
    if not isinstance(recipe, RECIPES):
        raise TypeError(f"{name} must be a jax_fp8.DelayedScaling, Float8CurrentScaling or "
                        f"Float8BlockScaling instance (e.g. `DelayedScaling()`), got "
                        f"{type(recipe).__name__}")
    return recipe


def check_delayed(recipe, name: str = "recipe"):
    """`recipe` if it is a DelayedScaling (the only recipe with state), else a TypeError."""
    if isinstance(recipe, type) and issubclass(recipe, RECIPES):
        check_recipe(recipe, name)
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"{name} must be a jax_fp8.DelayedScaling here (the recipe with FP8 "
                        f"state), got {type(recipe).__name__}")
    return recipe
