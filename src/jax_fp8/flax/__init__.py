"""Flax integration of jax_fp8: linen and NNX FP8 layers, train-step helpers, converters.

Linen (the default namespace):

    nn.Dense(features, dot_general_cls=jax_fp8.flax.Fp8DotGeneral)
    state = jax_fp8.flax.Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=tx)

An existing model in one call (docs/convert.md):

    model = jax_fp8.flax.fp8_model(model, jax_fp8.flax.Fp8Rule(recipe=recipe))

NNX: `jax_fp8.flax.nnx` (Fp8Linear, Fp8DotGeneral, Fp8State, update_fp8, fp8_model, ...).
Converters to/from Flax's own fp8_ops variables and Transformer Engine's layout:
`jax_fp8.flax.interop`.
"""

from jax_fp8.flax import (
    interop,
    nnx,
    serialization,  # noqa: F401  (msgpack support)
)
from jax_fp8.flax.checkpointing import orbax_restore
from jax_fp8.flax.conversion import Fp8ConversionWarning, Fp8Rule, fp8_model
from jax_fp8.flax.linen import (
    FP8_COLLECTION,
    Fp8DotGeneral,
    Fp8Einsum,
    Fp8TrainState,
    fp8_value_and_grad,
    split_fp8,
)

__all__ = ["FP8_COLLECTION", "Fp8ConversionWarning", "Fp8DotGeneral", "Fp8Einsum", "Fp8Rule",
           "Fp8TrainState", "fp8_model", "interop", "fp8_value_and_grad", "nnx", "orbax_restore",
           "split_fp8"]
