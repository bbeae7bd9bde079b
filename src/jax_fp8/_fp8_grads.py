"""FP8 gradients: the amaxes a step observed, as amax records and as `AmaxGrad`s.

The gradient of a delayed-scaling state is no gradient: it carries the amaxes its tensor
had, which the FP8 update reads and which combine by max, never by sum. Two forms:

* **The amax record**, JAX's raw cotangent of a `ScalingState` (what ``jax.grad`` and
  ``eqx.filter_value_and_grad`` return): float32 arrays, which generic code may scale,
  average or sum. The record holds the amax in the staging slot, its low-order part in
  the ``scale`` slot and a unit (1) in the ``scale_inv`` slot; `recorded_amax` reads
  ``amax / unit`` rounded back onto the two parts' grids, so a linear map applied to the
  whole record (a loss scale undone, a clip factor, a mean or sum of identical records,
  as the FP8 ops' backward makes every device's under ``pmap``) reads back the amax
  itself, bit for bit (`amax_record`).
* **`AmaxGrad`**: the amaxes in an array of an extended dtype on which generic gradient
  code (a scaling, a clip, a sum, a pmean) raises at trace time, what jax_fp8's
  value_and_grad functions return.

`fp8_grads_from_cotangents` makes `AmaxGrad`s from records, `amax_cotangents` reads
either back, `combine_fp8_grads` combines those of several microbatches (by max).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.export  # noqa: F401  (register_pytree_node_serialization)
import jax.extend.random
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jax_fp8 import _hints, state as state_lib
from jax_fp8.state import HoldsStates, ScalingState, is_state

# ------------------------------------------------------------------- the amax record
# A float32 amax a splits exactly into a high part (a with its 12 low mantissa bits
# cleared: 12 significant bits) and a low part (a minus it: at most 12 significant bits).
# Each part survives what generic code does to a whole gradient tree: a product with any
# factor c and a division by c move it by at most one float32 rounding, far less than
# the spacing of its 12-bit grid; a sum of up to 2**11 identical copies (divided or not)
# keeps the low part exact and moves the staging slot far less than the high part's
# spacing. So (record / unit) rounded back onto the two grids is a, exactly.
_HIGH_BITS = np.uint32(0xFFFFF000)   # sign, exponent, the 11 leading mantissa bits
_HALF_LOW = np.uint32(0x800)         # half a step of the 12-bit grid


def _twelve_bits(x: jax.Array, rounded: bool) -> jax.Array:
    """x on the grid of 12 significant bits: truncated, or rounded to nearest (half away
    from zero), in integer arithmetic on its bits (no float operation to flush)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    if rounded:
        bits = bits + _HALF_LOW
    return lax.bitcast_convert_type(bits & _HIGH_BITS, jnp.float32)


def _low_part(amax: jax.Array) -> jax.Array:
    """amax minus its high part (exact; at most 12 significant bits); 0 for inf / NaN."""
    return jnp.where(jnp.isfinite(amax), amax - _twelve_bits(amax, rounded=False),
                     jnp.float32(0))


def amax_record(amax: ArrayLike, like: ScalingState) -> ScalingState:
    """The raw cotangent that carries ``amax`` (float32, ``like``'s scale shape) for the
    state ``like``: ``amax_history`` zero but for the staging slot, which holds the amax;
    ``scale`` its low part; ``scale_inv`` the unit, 1. `recorded_amax` reads it back."""
    amax = jnp.asarray(amax, jnp.float32)
    history = jnp.zeros_like(like.amax_history).at[..., 0].set(amax)
    return ScalingState(history, _low_part(amax), jnp.ones_like(like.scale),
                        fp8_dtype=like.fp8_dtype)


def recorded_amax(record: ScalingState) -> jax.Array:
    """The amax an amax record (a state's raw cotangent, packed or not) carries.

    As `amax_record` wrote it: the staging slot, as it is. After a linear map of the
    record (``g / loss_scale``, ``g * clip_factor``, ``-g``, a mean or a sum of identical
    records over devices): ``staging slot / unit`` put back onto the grids of its two
    parts, the amax exactly (a map that makes a part subnormal flushes it first, as XLA
    does). A record whose unit is 0 (a hand-made raw cotangent, a
    ``jnp.zeros_like`` accumulator, a state no op used) is read as its staging slot.
    """
    staged = record.amax_history[..., 0]
    low, unit = record.scale, record.scale_inv
    untouched = (unit == 1) & (low == _low_part(staged))
    unit = jnp.where(unit == 0, jnp.float32(1), unit)   # no 0 / 0 (jax_debug_nans)
    x, lo = staged / unit, _twelve_bits(low / unit, rounded=True)
    rescaled = jnp.where(jnp.isfinite(x), _twelve_bits(x - lo, rounded=True) + lo, x)
    return jnp.where((record.scale_inv == 0) | untouched, staged, rescaled)


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


def _encode_amax(amax: ArrayLike) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.uint32)
    return cast(jax.Array, jax.random.wrap_key_data(bits[..., None], impl=_AMAX_IMPL))


def _is_amax_array(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return (dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
            and jax.random.key_impl(x) == _AMAX_IMPL)


def _not_an_amax(where: str, what: str) -> str:
    param_grads = _hints.of_caller().param_grads
    return (f"{where}: an FP8 gradient (AmaxGrad) holds {what} where the update reads the "
            "observed amaxes; something other than jax_fp8 rebuilt it (e.g. "
            "`jax.tree.map(f, grads)` over the whole gradient). Apply gradient transforms "
            f"to {param_grads} only, combine FP8 gradients with jax_fp8.combine_fp8_grads, "
            "and pass them to the update as the value_and_grad of jax_fp8 returned them.")


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
            raise TypeError(_not_an_amax(where, what))
        bits = jax.random.key_data(self.amax)[..., 0]
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    @classmethod
    def of(cls, amax: ArrayLike) -> AmaxGrad:
        """The FP8 gradient of observed amaxes ``amax`` (float32, the state's scale shape)."""
        return cls(_encode_amax(amax))


def _amax_grad_flatten(g: AmaxGrad) -> tuple[tuple[Any], None]:
    state_lib.check_not_optax()
    return (g.amax,), None


def _amax_grad_flatten_with_keys(
        g: AmaxGrad) -> tuple[tuple[tuple[jax.tree_util.GetAttrKey, Any]], None]:
    state_lib.check_not_optax()
    return ((jax.tree_util.GetAttrKey("amax"), g.amax),), None


jax.tree_util.register_pytree_with_keys(
    AmaxGrad, _amax_grad_flatten_with_keys, lambda _, children: AmaxGrad(*children),
    flatten_func=_amax_grad_flatten)


def _refuse_export(_: Any) -> Any:
    updates = "; ".join(f"{h.framework}: {h.update}" for h in _hints.imported())
    raise ValueError(
        "jax.export cannot serialize a function taking or returning FP8 gradients "
        "(AmaxGrad): their arrays are of an extended dtype that jax.export does not "
        "serialize. Export the step with the FP8 update inside it, taking and returning "
        f"FP8 states ({updates}), or return the amaxes as float32 (AmaxGrad.value()).")


# Registered so that serializing names the fix instead of JAX's "unregistered type".
jax.export.register_pytree_node_serialization(
    AmaxGrad, serialized_name="jax_fp8.AmaxGrad", serialize_auxdata=_refuse_export,
    deserialize_auxdata=_refuse_export)


def _is_grad_leaf(x: Any) -> bool:
    return is_state(x) or isinstance(x, AmaxGrad)


def fp8_grads_from_cotangents(cotangents: Any) -> Any:
    """JAX's raw cotangent of FP8 states -> FP8 gradients that refuse arithmetic.

    ``jax.grad`` with respect to FP8 states returns, for each `ScalingState`, its amax
    record (`amax_record`): plain floats, which a uniform rescale leaves readable but a
    sum of several steps' records would not. This replaces each by its `AmaxGrad`, which
    refuses arithmetic; `AmaxGrad`s and other leaves are kept as they are.
    """
    return jax.tree.map(lambda x: AmaxGrad.of(recorded_amax(x)) if is_state(x) else x,
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
    -> its amaxes, each raw ScalingState cotangent (an amax record) -> `recorded_amax`.

    Raises:
      TypeError: an `AmaxGrad` that does not hold amaxes (rebuilt by generic tree code).
    """
    def amax(path: Any, g: Any) -> Any:
        if isinstance(g, AmaxGrad):
            return g.value("fp8_grads" + jax.tree_util.keystr(path))
        return recorded_amax(g) if is_state(g) else g

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

    def amax(g: Any) -> jax.Array:
        return g.value("combine_fp8_grads") if isinstance(g, AmaxGrad) else recorded_amax(g)

    def combine(*gs: Any) -> Any:
        first = gs[0]
        if not _is_grad_leaf(first):
            return first
        staged = functools.reduce(jnp.fmax, [amax(g) for g in gs])
        if isinstance(first, AmaxGrad):
            return AmaxGrad.of(staged)
        return amax_record(staged, first)

    return jax.tree.map(combine, *fp8_grads, is_leaf=_is_grad_leaf)
