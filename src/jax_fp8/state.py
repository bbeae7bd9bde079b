"""ScalingState: the delayed-scaling state of one FP8 tensor (or a stack of them)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export
from jax.typing import DTypeLike

from jax_fp8 import _hints, recipe as recipe_lib

# fp8_dtype as given -> np.dtype (only valid FP8 dtypes are stored)
_CANONICAL: dict[Any, np.dtype] = {}


@dataclasses.dataclass(frozen=True)
class ScalingState:
    """A registered pytree; leaves amax_history, scale, scale_inv; fp8_dtype is static.

    The leaves' tree keys name the FP8 format too (`field_key`: ``.scale_float8_e4m3fn``),
    so checkpoints record it.

    Attributes:
      amax_history: float32 [..., L]; index 0 is the staging slot for the next amax.
      scale: float32 [...]; quantize as x_fp8 = saturate_cast(x * scale).
      scale_inv: float32 [...]; 1 / scale, the dequantization factor.
      fp8_dtype: the FP8 dtype these tensors are quantized to (static).
    """

    amax_history: Any
    scale: Any
    scale_inv: Any
    fp8_dtype: Any = dataclasses.field(default=jnp.float8_e4m3fn)

    def __post_init__(self) -> None:
        # One spelling of the dtype, so tree structures compare and hash equal. JAX
        # rebuilds states on every unflatten, so the common case is a dict lookup.
        try:
            dtype = _CANONICAL.get(self.fp8_dtype)
        except TypeError:  # unhashable: let canonical_fp8_dtype name the problem
            dtype = recipe_lib.canonical_fp8_dtype(self.fp8_dtype)
        if dtype is None:
            dtype = recipe_lib.canonical_fp8_dtype(self.fp8_dtype)
            _CANONICAL[self.fp8_dtype] = dtype
        object.__setattr__(self, "fp8_dtype", dtype)

    @classmethod
    def create(cls, shape: Sequence[int] = (), history_len: int = 1024,
               fp8_dtype: DTypeLike = jnp.float8_e4m3fn) -> ScalingState:
        """A fresh state: zero history, scale = scale_inv = 1."""
        if isinstance(history_len, bool) or int(history_len) != history_len or history_len < 1:
            raise ValueError(f"history_len must be an integer >= 1, got {history_len!r}")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape must have non-negative sizes, got {shape}")
        dtype = recipe_lib.canonical_fp8_dtype(fp8_dtype)
        return cls(amax_history=jnp.zeros(shape + (int(history_len),), jnp.float32),
                   scale=jnp.ones(shape, jnp.float32), scale_inv=jnp.ones(shape, jnp.float32),
                   fp8_dtype=dtype)

    @property
    def history_len(self) -> int:
        return cast(int, self.amax_history.shape[-1])

    def replace(self, **changes: Any) -> ScalingState:
        """A copy with the given fields replaced (as ``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


FIELDS = ("amax_history", "scale", "scale_inv")


def field_key(field: str, fp8_dtype: DTypeLike) -> str:
    """The tree key of a state's array: its field and FP8 format, ``scale_float8_e5m2``.

    The format is static, so a restore that only compares keys and shapes (orbax) would
    put a checkpoint's arrays into a state of another format and relabel them; with the
    format in the keys, such a restore finds different keys and refuses.
    """
    return f"{field}_{np.dtype(fp8_dtype).name}"


# fp8_dtype -> the GetAttrKeys of its three fields
_KEYS: dict[np.dtype, tuple[jax.tree_util.GetAttrKey, ...]] = {}

def optax_refuses() -> str:
    """The message of an optax function given FP8 states or FP8 gradients, naming the fix
    of the framework on the call stack (or, where none is, plain JAX's and those of the
    adapters imported)."""
    fixes = "; ".join(f"{h.framework}: {h.optimizer}; {h.loop}" for h in _hints.imported())
    return ("optax was given jax_fp8 FP8 scaling states, or their gradients (the amaxes a "
            "step observed): an optimizer would add its updates to the amax histories and "
            "scales, and the FP8 update would never run. FP8 states never go through an "
            "optimizer; keep them out of it. " + fixes + ".")


def is_optax(module: str) -> bool:
    """Whether ``module`` is the optax package or one of its modules (not a user's module
    whose name merely starts with "optax", e.g. ``optax_utils``)."""
    return module == "optax" or module.startswith("optax.")


def check_not_optax() -> None:
    """Raises ValueError when the pytree operation flattening a state was called by optax
    (the Python frames above the flatten, past JAX's own tree functions).

    FP8 gradients refuse arithmetic by their dtype, whatever code meets them
    (`jax_fp8.meta.AmaxGrad`); this check only names the fix where it is optax. FP8
    *states* are floats: for them it is what refuses an optimizer given them as
    parameters (e.g. Flax's ``TrainState.create(params=variables)``)."""
    frame: FrameType | None
    try:
        frame = sys._getframe(2)
    except ValueError:  # called from the top level
        return
    for _ in range(8):
        if frame is None:
            return
        module = frame.f_globals.get("__name__", "")
        if is_optax(module):
            raise ValueError(optax_refuses())
        if not (module == "jax" or module.startswith(("jax.", "jaxlib", "jax_fp8"))):
            return
        frame = frame.f_back


def _flatten(st: ScalingState) -> tuple[tuple[Any, Any, Any], np.dtype]:
    check_not_optax()
    return (st.amax_history, st.scale, st.scale_inv), st.fp8_dtype


def _flatten_with_keys(
        st: ScalingState) -> tuple[tuple[tuple[jax.tree_util.GetAttrKey, Any], ...], np.dtype]:
    check_not_optax()
    keys = _KEYS.get(st.fp8_dtype)
    if keys is None:
        keys = _KEYS[st.fp8_dtype] = tuple(
            jax.tree_util.GetAttrKey(field_key(f, st.fp8_dtype)) for f in FIELDS)
    return tuple(zip(keys, (st.amax_history, st.scale, st.scale_inv))), st.fp8_dtype


def _unflatten(fp8_dtype: np.dtype, arrays: Iterable[Any]) -> ScalingState:
    amax_history, scale, scale_inv = arrays
    return ScalingState(amax_history, scale, scale_inv, fp8_dtype=fp8_dtype)


jax.tree_util.register_pytree_with_keys(
    ScalingState, _flatten_with_keys, _unflatten, flatten_func=_flatten)

# jax.export: a serialized function taking or returning states names them
# "jax_fp8.ScalingState" (deserializing it needs `import jax_fp8`).
jax_export.register_pytree_node_serialization(
    ScalingState, serialized_name="jax_fp8.ScalingState",
    serialize_auxdata=lambda fp8_dtype: np.dtype(fp8_dtype).name.encode(),
    deserialize_auxdata=lambda data: np.dtype(getattr(jnp, data.decode())))


def is_state(x: Any) -> bool:
    return isinstance(x, ScalingState)


class HoldsStates:
    """Base of pytree nodes that hold ScalingStates in a layout of their own
    (`jax_fp8.PackedStates`): `states_info` lists their states through `slot_info`, so
    this module need not know the layouts built on it."""

    def slot_info(self) -> list[tuple[Any, np.dtype, int]]:
        """(path in the unpacked tree, fp8_dtype, history_len) for each state held."""
        raise NotImplementedError


def _role(path: tuple[Any, ...]) -> str | None:
    """"grad", "input", "kernel" from the last key of a state's tree path, else None."""
    if not path:
        return None
    key = path[-1]
    name = getattr(key, "name", getattr(key, "key", None))
    return name if name in ("input", "kernel", "grad") else None


def check_states_follow(recipe: Any, tree: Any, name: str = "tree",
                        hints: _hints.StepHints | None = None) -> None:
    """Raises ValueError when a state of `tree` was not made by `recipe` (a stateless
    recipe, current or blockwise, makes none).

    Each state's history length must be ``recipe.state_history_len()`` and its FP8 dtype
    the one the recipe gives its role (``fwd_dtype`` for ``input``/``kernel``, ``bwd_dtype``
    for ``grad``; either for states whose role the tree does not name). The message
    names ``hints``' fix (default: the framework on the call stack, else plain JAX's).
    """
    recipe_lib.check_recipe(recipe, "recipe")
    found = states_info(tree)
    if not recipe.keeps_state:
        if found:
            _refuse(hints, f"{name}{jax.tree_util.keystr(found[0][0])} is a delayed-scaling "
                           f"state, but the recipe {type(recipe).__name__} keeps none")
        return
    dtypes, length = recipe.state_dtypes(), recipe.state_history_len()
    for path, fp8_dtype, history_len in found:
        role = _role(path)
        want = (dtypes[role],) if role in dtypes else tuple(dtypes.values())
        problems = []
        if history_len != length:
            problems.append(f"history length {history_len}, the recipe's is {length}")
        if fp8_dtype not in want:
            problems.append(f"FP8 dtype {fp8_dtype.name}, the recipe's is "
                            f"{' or '.join(d.name for d in dict.fromkeys(want))}")
        if problems:
            default = (" (the default, taken when no recipe is passed)"
                       if recipe == recipe_lib.default() else "")
            _refuse(hints, f"{name}{jax.tree_util.keystr(path)} does not follow the recipe "
                           f"{recipe}{default}: it has {'; '.join(problems)}")


def _refuse(hints: _hints.StepHints | None, problem: str) -> None:
    hints = _hints.of_caller() if hints is None else hints
    raise ValueError(f"{hints.call + ': ' if hints.call else ''}{problem}. The update must "
                     f"be given the recipe the layers were made with: {hints.recipe}.")


def states_info(tree: Any) -> list[tuple[tuple[Any, ...], np.dtype, int]]:
    """(path, fp8_dtype, history_len) for every state of `tree`; the states a
    `HoldsStates` node (a PackedStates) holds by their paths in the unpacked tree."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: is_state(x) or isinstance(x, HoldsStates))[0]:
        if isinstance(leaf, HoldsStates):
            out += [(path + sub, dtype, length) for sub, dtype, length in leaf.slot_info()]
        elif is_state(leaf):
            out.append((path, leaf.fp8_dtype, leaf.history_len))
    return out


def new_state(recipe: Any, role: str, shape: Sequence[int] = (),
              history_len: int | None = None) -> ScalingState:
    """A fresh state of ``recipe`` (one that keeps state) for ``role``, as
    `jax_fp8.recipe.Recipe.create_state` describes: its dtype from ``recipe.state_dtypes()``,
    its history length ``history_len`` or ``recipe.state_history_len()``."""
    name = type(recipe).__name__
    dtypes = recipe.state_dtypes()
    if role not in dtypes:
        raise ValueError(f"{name} keeps no {role!r} state; its states are {', '.join(dtypes)}")
    length = recipe.state_history_len() if history_len is None else history_len
    if length is None:
        raise TypeError(f"{name} keeps state but gives no state_history_len()")
    return ScalingState.create(shape, length, dtypes[role])
