"""FP8 formats and the delayed-scaling recipe (Transformer Engine's names)."""

from __future__ import annotations

import dataclasses
import enum
import math

import jax.numpy as jnp
import numpy as np

ALGORITHMS = ("max", "most_recent")


def canonical_fp8_dtype(fp8_dtype, name: str = "fp8_dtype") -> np.dtype:
    """`fp8_dtype` as a NumPy dtype, or a TypeError naming `name`."""
    try:
        dtype = np.dtype(fp8_dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.itemsize != 1 or not dtype.name.startswith("float8"):
        raise TypeError(f"{name} must be an FP8 dtype such as jnp.float8_e4m3fn or "
                        f"jnp.float8_e5m2, got {fp8_dtype!r}")
    return dtype


def fp8_max(fp8_dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 for e4m3fn, 57344 for e5m2, ..."""
    return float(jnp.finfo(canonical_fp8_dtype(fp8_dtype)).max)


def check_margin(margin) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float, np.integer, np.floating)):
        raise TypeError(f"margin must be a real number, got {margin!r}")
    if not math.isfinite(margin):
        raise ValueError(f"margin must be finite, got {margin!r}")
    return float(margin)


def scaled_max(fp8_dtype, margin) -> float:
    """float32(fp8_max) * float32(2 ** -margin), computed once in float32 (SPEC.md).

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
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, (int, np.integer)) \
                or self.history_len < 1:
            raise ValueError(f"history_len must be an integer >= 1, got {self.history_len!r}")
        check_algorithm(self.amax_compute_algo)
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a jax_fp8.Format, got {self.fp8_format!r}")
        for dtype in (self.fp8_format.fwd_dtype, self.fp8_format.bwd_dtype):
            scaled_max(dtype, self.margin)  # validates margin
        for name in ("power_of_2_scale", "skip_unused"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
