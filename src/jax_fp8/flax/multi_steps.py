"""The FP8 state under ``optax.MultiSteps``, one logic for linen's `Fp8TrainState`, NNX's
`Fp8Optimizer` and any other step: the framework-neutral training step
(`jax_fp8._training_step`) owns it; its functions are importable from here as before.

Under gradient accumulation the optimizer applies once every k calls. The FP8 state
follows it: the amaxes each call observes are combined by max into *pending* amaxes
(a flat list of float32 arrays, one per delayed-scaling state in tree order, so it
checkpoints as plain arrays whatever container holds the states), and the one fused
update runs on the call where the optimizer applies.
"""

from jax_fp8._training_step import accumulate, find, gradient_step, zero_pending

__all__ = ["accumulate", "find", "gradient_step", "zero_pending"]
