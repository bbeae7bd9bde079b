"""FP8 gradients: the amaxes a step observed, in leaves that refuse arithmetic (`AmaxGrad`).

The gradient of a delayed-scaling state is no gradient: it carries the amaxes its tensor
had, which the FP8 update reads and which combine by max, never by sum. `AmaxGrad` holds
them in an array of an extended dtype on which generic gradient code (a scaling, a clip,
a sum, a pmean) raises at trace time; `fp8_grads_from_cotangents` makes them from JAX's
raw cotangents, `amax_cotangents` reads them back, `combine_fp8_grads` combines those of
several microbatches.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.export  # noqa: F401  (register_pytree_node_serialization)
import jax.extend.random
import jax.numpy as jnp

from jax_fp8 import state as state_lib
from jax_fp8.state import HoldsStates, ScalingState, is_state


def _not_a_key(*_: Any, **__: Any) -> Any:
    raise TypeError("a jax_fp8 FP8 gradient (AmaxGrad) holds observed amaxes, not a random key")


# The dtype of an FP8 gradient's array: JAX's extended (key) dtypes accept no arithmetic,
# no conversion to a number and no reduction, so generic gradient code (a scaling, a
# clip, a sum, a norm, a pmean) given one raises at trace time, its message naming
# this dtype, instead of changing what the update reads. Its data is the amax's float32
# bit pattern (uint32 [..., 1]).
AMAX_DTYPE_TAG = ("jax_fp8 FP8 gradient: observed amaxes, no arithmetic; "
                  "see docs/semantics.md#fp8-gradients")
_AMAX_IMPL = jax.extend.random.define_prng_impl(
    key_shape=(1,), seed=_not_a_key, split=_not_a_key, random_bits=_not_a_key,
    fold_in=_not_a_key, name="jax_fp8.AmaxGrad", tag=AMAX_DTYPE_TAG)


def _encode_amax(amax) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.uint32)
    return jax.random.wrap_key_data(bits[..., None], impl=_AMAX_IMPL)


def _is_amax_array(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return (dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
            and jax.random.key_impl(x) == _AMAX_IMPL)


_NOT_AN_AMAX = ("{where}: an FP8 gradient (AmaxGrad) holds {what} where the update reads the "
                "observed amaxes; something other than jax_fp8 rebuilt it (e.g. "
                "`jax.tree.map(f, grads)` over the whole gradient). Apply gradient transforms "
                "to the parameter gradients only (grads['params'], or the nnx.Param part), "
                "combine FP8 gradients with jax_fp8.combine_fp8_grads, and pass them to the "
                "update as the value_and_grad of jax_fp8 returned them.")


@dataclasses.dataclass(frozen=True)
class AmaxGrad:
    """The FP8 gradient of one `ScalingState` (or a stack of them): the amaxes its tensor
    had in a step, in a leaf that refuses arithmetic.

    What `jax_fp8.flax.fp8_value_and_grad`, `Fp8TrainState.value_and_grad` and NNX's
    `fp8_value_and_grad` return for each state (`fp8_grads_from_cotangents` makes them
    from JAX's raw cotangents). Its one leaf ``amax`` is an array of the state's lead shape
    whose dtype is an extended JAX dtype (``key<jax_fp8 FP8 gradient ...>``), holding the
    amax's float32 bits: it passes through ``jit``, ``lax.scan`` / ``cond`` carries,
    ``pmap``, ``device_put``, ``jnp.zeros_like`` (a zero amax) and pytree round trips,
    and every arithmetic operation, conversion to a number, reduction or collective on it
    raises ``TypeError`` at trace time. Combine several with `combine_fp8_grads` (max).

    Attributes:
      amax: the amaxes, an array of the extended dtype, shape = the state's scale shape.
    """

    amax: Any

    def value(self, where: str = "fp8_grads") -> jax.Array:
        """The amaxes as float32 (the state's scale shape)."""
        if not _is_amax_array(self.amax):
            what = (f"a {getattr(self.amax, 'dtype', type(self.amax).__name__)} array"
                    if hasattr(self.amax, "dtype") else type(self.amax).__name__)
            raise TypeError(_NOT_AN_AMAX.format(where=where, what=what))
        bits = jax.random.key_data(self.amax)[..., 0]
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    @classmethod
    def of(cls, amax) -> AmaxGrad:
        """The FP8 gradient of observed amaxes ``amax`` (float32, the state's scale shape)."""
        return cls(_encode_amax(amax))


def _amax_grad_flatten(g: AmaxGrad):
    state_lib.check_not_optax()
    return (g.amax,), None


def _amax_grad_flatten_with_keys(g: AmaxGrad):
    state_lib.check_not_optax()
    return ((jax.tree_util.GetAttrKey("amax"), g.amax),), None


jax.tree_util.register_pytree_with_keys(
    AmaxGrad, _amax_grad_flatten_with_keys, lambda _, children: AmaxGrad(*children),
    flatten_func=_amax_grad_flatten)


_NOT_EXPORTABLE = (
    "jax.export cannot serialize a function taking or returning FP8 gradients (AmaxGrad): "
    "their arrays are of an extended dtype that jax.export does not serialize. Export "
    "the step with the FP8 update inside it, taking and returning FP8 states "
    "(Fp8TrainState.apply_gradients, jax_fp8.new_fp8_state, NNX's update_fp8), or "
    "return the amaxes as float32 (AmaxGrad.value()).")


def _refuse_export(_: Any) -> Any:
    raise ValueError(_NOT_EXPORTABLE)


# Registered so that serializing names the fix instead of JAX's "unregistered type".
jax.export.register_pytree_node_serialization(
    AmaxGrad, serialized_name="jax_fp8.AmaxGrad", serialize_auxdata=_refuse_export,
    deserialize_auxdata=_refuse_export)


def _is_grad_leaf(x) -> bool:
    return is_state(x) or isinstance(x, AmaxGrad)


def fp8_grads_from_cotangents(cotangents: Any) -> Any:
    """JAX's raw cotangent of FP8 states -> FP8 gradients that refuse arithmetic.

    ``jax.grad`` with respect to FP8 states returns, for each `ScalingState`, a
    ScalingState-shaped float cotangent whose staging slot holds the observed amax: plain
    floats, which a gradient transform (a loss scale, a clip, a sum) would change
    without notice. This replaces each by its `AmaxGrad`; call it where ``jax.grad``
    returns, before anything else touches the gradient. `AmaxGrad`s and other leaves are
    kept as they are.
    """
    return jax.tree.map(lambda x: AmaxGrad.of(x.amax_history[..., 0]) if is_state(x) else x,
                        cotangents, is_leaf=_is_grad_leaf)


def holds_fp8_grads(tree: Any) -> bool:
    """Whether ``tree`` holds an FP8 gradient (an `AmaxGrad`, a raw ScalingState
    cotangent, or a packed group of either)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: _is_grad_leaf(x) or
                             isinstance(x, HoldsStates))
    return any(_is_grad_leaf(x) or (isinstance(x, HoldsStates) and bool(x.slot_info()))
               for x in leaves)


def amax_cotangents(fp8_grads: Any) -> Any:
    """The observed amaxes carried by FP8 gradients, as float32 arrays: each `AmaxGrad`
    -> its amaxes, each raw ScalingState cotangent -> its staging slot.

    Raises:
      TypeError: an `AmaxGrad` that does not hold amaxes (rebuilt by generic tree code).
    """
    def amax(path, g):
        if isinstance(g, AmaxGrad):
            return g.value("fp8_grads" + jax.tree_util.keystr(path))
        return g.amax_history[..., 0] if is_state(g) else g

    return jax.tree_util.tree_map_with_path(amax, fp8_grads, is_leaf=_is_grad_leaf)


def combine_fp8_grads(*fp8_grads: Any) -> Any:
    """Combines the FP8 gradients of several microbatches (or steps) by max, never sum.

    Each may hold `AmaxGrad`s or raw ScalingState cotangents (an accumulator started as
    ``jax.tree.map(jnp.zeros_like, state.fp8)`` or ``jax.tree.map(jnp.zeros_like, grads)``
    included); the result has the representation of the first (so a ``lax.scan`` carry
    keeps its type).
    """
    if not fp8_grads:
        raise ValueError("combine_fp8_grads needs at least one gradient tree")

    def amax(g):
        return g.value("combine_fp8_grads") if isinstance(g, AmaxGrad) else \
            g.amax_history[..., 0]

    def combine(*gs):
        first = gs[0]
        if not _is_grad_leaf(first):
            return first
        staged = functools.reduce(jnp.fmax, [amax(g) for g in gs])
        if isinstance(first, AmaxGrad):
            return AmaxGrad.of(staged)
        return ScalingState(jnp.zeros_like(first.amax_history).at[..., 0].set(staged),
                            jnp.zeros_like(first.scale), jnp.zeros_like(first.scale_inv),
                            fp8_dtype=first.fp8_dtype)

    return jax.tree.map(combine, *fp8_grads, is_leaf=_is_grad_leaf)
