"""The scaling recipes, one module each, registered with `jax_fp8.recipe.register` as they are
imported here (each implements `jax_fp8.recipe.Recipe`)."""

from jax_fp8.recipes.block import Float8BlockScaling
from jax_fp8.recipes.current import Float8CurrentScaling
from jax_fp8.recipes.delayed import DelayedScaling
from jax_fp8.recipes.mxfp8 import MXFP8BlockScaling

__all__ = ["DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling", "MXFP8BlockScaling"]
