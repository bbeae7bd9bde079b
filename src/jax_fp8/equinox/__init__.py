"""Equinox integration of jax_fp8: FP8 layers, model conversion, the training step's helpers,
checkpoints (imports no Flax).

    model = jax_fp8.equinox.fp8_model(model)            # eqx.nn.Linear -> Fp8Linear, ...
    opt_state = optim.init(jax_fp8.equinox.params(model))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(jax_fp8.equinox.params(grads), opt_state,
                                          jax_fp8.equinox.params(model))
        model = jax_fp8.equinox.apply_updates(model, updates, grads,   # ONE FP8 update
                                              opt_state=opt_state)
        return model, opt_state, loss

Models are called per example under ``jax.vmap``, and keep that call: under a ``vmap``
that batches a GEMM's input alone (its kernel and FP8 state shared by the batch), the
batch runs as one FP8 GEMM (`jax.custom_batching.custom_vmap`), so its amaxes are the
max over the batch and ``min_fp8_flops`` counts the batched GEMM. Each layer's FP8 state is
an `Fp8State` field, which optax and ``eqx.apply_updates`` refuse with an error naming
the loop above (docs/equinox.md).
"""

from jax_fp8.equinox._conversion import fp8_model
from jax_fp8.equinox._gemm import fp8_gemm
from jax_fp8.equinox._linear import Fp8Linear
from jax_fp8.equinox._serialisation import (
    orbax_restore,
    tree_deserialise_leaves,
    tree_serialise_leaves,
)
from jax_fp8.equinox._state import Fp8Placeholder, Fp8State
from jax_fp8.equinox._training import (
    accumulate_grads,
    apply_updates,
    check_fp8_updated,
    fp8_states,
    params,
)
from jax_fp8.rules import Fp8Rule

__all__ = ["Fp8Linear", "Fp8Placeholder", "Fp8Rule", "Fp8State", "accumulate_grads",
           "apply_updates", "check_fp8_updated", "fp8_gemm", "fp8_model", "fp8_states",
           "orbax_restore", "params", "tree_deserialise_leaves", "tree_serialise_leaves"]
