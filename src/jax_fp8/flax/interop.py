"""Converters between jax_fp8 FP8 state and Flax fp8_ops / Transformer Engine layouts.

Flax (``flax.linen.fp8_ops``, e.g. ``Fp8DirectDotGeneralOp``)
-------------------------------------------------------------
Flax keeps, per module, in the ``"_overwrite_with_gradient"`` collection:
``{input,kernel,output_grad}_amax_history`` float32 ``[L]`` and ``{...}_scale`` float32
``[1]`` (leading axes added by ``nn.scan``). Two differences from jax_fp8 (docs/semantics.md):

* Flax's ``scale`` is the *dequantization* factor (``x_fp8 = x / scale``): our
  ``scale_inv``.
* Flax updates inside the next forward: at step t it takes the max of the stored history
  (slot 0 = newest amax, slots 1..L-1 older amaxes, oldest first), computes the scale it
  uses for step t, then rolls and writes step t's amax into slot 0. A Flax history is
  therefore exactly a jax_fp8 history *with its staging slot filled and not yet updated*.

So ``from_flax`` = one fused ``update_states`` over Flax's histories (with
``scale = 1 / flax_scale`` for the "keep the previous scale" case): the result quantizes
step t with the very scale Flax would use. ``to_flax`` inverts it: the history is rolled
back by one and the oldest slot (which Flax drops before it is ever read again) is set to
``fp8_max / scale``, so Flax's next ``max`` reproduces our scale; Flax's ``scale`` gets our
``scale_inv`` (used by Flax only while its history is all zero). Flax has no margin and no
"most_recent" algorithm: the scale survives for margin >= 0 and the "max" algorithm.
Input/kernel states are E4M3 and gradient states E5M2, as Flax hard-codes them
(``fwd_dtype``/``bwd_dtype`` override, e.g. for the fnuz variants).

Module names: Flax's ``Fp8DirectDotGeneralOp_<n>`` (and ``Fp8DotGeneralOp_<n>``,
``NANOOFp8DotGeneralOp_<n>``) become our ``Fp8DotGeneral_<n>`` and back (``rename``),
so ``nn.Dense(..., dot_general_cls=...)`` trees line up; ``Fp8Einsum_<n>`` keeps its name.

Transformer Engine
------------------
TE (PyTorch ``fp8_meta``) stores a group of N tensors as ``amax_history [L, N]`` (history
on axis 0), ``scale [N]`` and ``scale_inv [N]``, with the same convention as
docs/semantics.md. `to_te` stacks every ScalingState of a pytree (leading axes flattened,
tree order) into that layout; `from_te` splits it back, into the structure of a template tree
or into one stacked ScalingState.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import recipe as recipe_lib
from jax_fp8.flax.linen import FP8_COLLECTION
from jax_fp8.recipes.delayed import DelayedScaling
from jax_fp8.state import ScalingState
from jax_fp8.update import update_states

FLAX_COLLECTION = "_overwrite_with_gradient"
_FLAX_PREFIX = {"input": "input", "kernel": "kernel", "grad": "output_grad"}
_FLAX_KEYS = frozenset(f"{p}_{s}" for p in _FLAX_PREFIX.values()
                       for s in ("amax_history", "scale"))
_OURS = frozenset(_FLAX_PREFIX)
_FROM_FLAX_NAME = re.compile(r"^(?:Fp8DirectDotGeneralOp|Fp8DotGeneralOp|NANOOFp8DotGeneralOp)"
                             r"_(\d+)$")
_TO_FLAX_NAME = re.compile(r"^Fp8DotGeneral_(\d+)$")


def _is_state(x: Any) -> bool:
    return isinstance(x, ScalingState)


# ------------------------------------------------------------------------------- Flax

def _map_modules(tree: Any, is_module: Callable[[Any], bool],
                 convert: Callable[[Any], dict[str, Any]],
                 rename_key: Callable[[Hashable], Hashable]) -> Any:
    if is_module(tree):
        return convert(tree)
    if isinstance(tree, dict) or hasattr(tree, "items"):
        return {rename_key(k): _map_modules(v, is_module, convert, rename_key)
                for k, v in tree.items()}
    return tree


def _is_flax_module(d: Any) -> bool:
    return hasattr(d, "keys") and _FLAX_KEYS <= set(d.keys())


def _is_our_module(d: Any) -> bool:
    return (hasattr(d, "keys") and _OURS <= set(d.keys())
            and all(_is_state(d[k]) for k in _OURS))


def from_flax(tree: Any, *, fwd_dtype: DTypeLike = jnp.float8_e4m3fn,
              bwd_dtype: DTypeLike = jnp.float8_e5m2, rename: bool = True,
              implementation: str = "auto") -> Any:
    """Flax fp8_ops variables -> jax_fp8 FP8 state (one fused update for all tensors).

    Args:
      tree: Flax's ``"_overwrite_with_gradient"`` collection, or a whole variables dict
        holding it (then the result is that dict with the collection replaced by our
        ``"fp8_meta"``).
      fwd_dtype: FP8 dtype of the input and kernel states.
      bwd_dtype: FP8 dtype of the gradient states.
      rename: rename ``Fp8DirectDotGeneralOp_<n>`` modules to ``Fp8DotGeneral_<n>``.
      implementation: "auto" (the fused kernel where built) or "jnp", as in
        `jax_fp8.update_states`.

    Returns:
      ``tree`` with each Flax module's variables replaced by ``input``/``kernel``/``grad``
      ScalingStates that quantize the next step with the scales Flax would use.

    Raises:
      ValueError: a ``*_scale`` whose shape is not the history's leading axes plus ``(1,)``.
    """
    if hasattr(tree, "keys") and FLAX_COLLECTION in tree:
        out = {k: v for k, v in tree.items() if k != FLAX_COLLECTION}
        out[FP8_COLLECTION] = from_flax(tree[FLAX_COLLECTION], fwd_dtype=fwd_dtype,
                                        bwd_dtype=bwd_dtype, rename=rename,
                                        implementation=implementation)
        return out
    dtypes = {"input": fwd_dtype, "kernel": fwd_dtype, "grad": bwd_dtype}

    def convert(d: Any) -> dict[str, Any]:
        states = {}
        for ours, theirs in _FLAX_PREFIX.items():
            h = jnp.asarray(d[f"{theirs}_amax_history"], jnp.float32)
            s = jnp.asarray(d[f"{theirs}_scale"], jnp.float32)
            if s.shape[-1:] != (1,) or s.shape[:-1] != h.shape[:-1]:
                raise ValueError(f"{theirs}_scale has shape {s.shape}; expected "
                                 f"{h.shape[:-1] + (1,)} for a history of shape {h.shape}")
            s = s[..., 0]
            # Flax's history is our staged history; its scale is our scale_inv.
            states[ours] = ScalingState(h, 1.0 / s, s, fp8_dtype=dtypes[ours])
        return states

    def rename_key(k: Hashable) -> Hashable:
        m = _FROM_FLAX_NAME.match(k) if rename and isinstance(k, str) else None
        return f"Fp8DotGeneral_{m.group(1)}" if m else k

    staged = _map_modules(tree, _is_flax_module, convert, rename_key)
    # Flax has no margin and always uses the max over the history.
    return update_states(staged, recipe=DelayedScaling(margin=0.0,
                                                                  amax_compute_algo="max"),
                         implementation=implementation)


def _state_to_flax(st: ScalingState) -> tuple[jax.Array, jax.Array]:
    h = jnp.asarray(st.amax_history, jnp.float32)
    length = h.shape[-1]
    fp8_max = np.float32(recipe_lib.fp8_max(st.fp8_dtype))
    flax_h = jnp.roll(h, 1, axis=-1)
    if length > 1:
        implied = fp8_max / st.scale
        seen = jnp.max(h, axis=-1) > 0
        ok = seen & jnp.isfinite(implied) & (implied > 0)
        slot = flax_h[..., 1]
        flax_h = flax_h.at[..., 1].set(jnp.where(ok, jnp.fmax(slot, implied), slot))
    return flax_h, jnp.asarray(st.scale_inv, jnp.float32)[..., None]


def to_flax(tree: Any, *, rename: bool = True) -> Any:
    """jax_fp8 FP8 state -> Flax fp8_ops variables (see the module docstring).

    Args:
      tree: our ``"fp8_meta"`` collection (modules holding ``input``/``kernel``/``grad``
        ScalingStates), or a whole variables dict holding it (then the result holds
        Flax's ``"_overwrite_with_gradient"`` collection instead).
      rename: rename ``Fp8DotGeneral_<n>`` modules to ``Fp8DirectDotGeneralOp_<n>``.

    Returns:
      ``tree`` with each module's ScalingStates replaced by Flax's
      ``{input,kernel,output_grad}_{amax_history,scale}`` variables.
    """
    if hasattr(tree, "keys") and FP8_COLLECTION in tree:
        out = {k: v for k, v in tree.items() if k != FP8_COLLECTION}
        out[FLAX_COLLECTION] = to_flax(tree[FP8_COLLECTION], rename=rename)
        return out

    def convert(d: Any) -> dict[str, Any]:
        out = {}
        for ours, theirs in _FLAX_PREFIX.items():
            h, s = _state_to_flax(d[ours])
            out[f"{theirs}_amax_history"] = h
            out[f"{theirs}_scale"] = s
        return out

    def rename_key(k: Hashable) -> Hashable:
        m = _TO_FLAX_NAME.match(k) if rename and isinstance(k, str) else None
        return f"Fp8DirectDotGeneralOp_{m.group(1)}" if m else k

    return _map_modules(tree, _is_our_module, convert, rename_key)


# --------------------------------------------------------------------- Transformer Engine

def to_te(tree: Any) -> dict[str, jax.Array]:
    """Every ScalingState of ``tree`` -> TE's ``{"amax_history": [L, N], "scale": [N],
    "scale_inv": [N]}`` (tree order, leading axes of each state flattened in C order).

    All states must have the same history length L.
    """
    states = [x for x in jax.tree.leaves(tree, is_leaf=_is_state) if _is_state(x)]
    if not states:
        raise ValueError("to_te: the tree holds no ScalingState")
    lengths = {st.amax_history.shape[-1] for st in states}
    if len(lengths) != 1:
        raise ValueError(f"to_te: every state needs the same history length, got {sorted(lengths)}")
    (length,) = lengths
    hist = jnp.concatenate([jnp.reshape(st.amax_history, (-1, length)) for st in states])
    scale = jnp.concatenate([jnp.reshape(st.scale, (-1,)) for st in states])
    scale_inv = jnp.concatenate([jnp.reshape(st.scale_inv, (-1,)) for st in states])
    return {"amax_history": hist.T, "scale": scale, "scale_inv": scale_inv}


def from_te(amax_history: ArrayLike, scale: ArrayLike, scale_inv: ArrayLike | None = None, *,
            like: Any = None, fp8_dtype: DTypeLike = jnp.float8_e4m3fn) -> Any:
    """TE's ``amax_history [L, N]``, ``scale [N]`` (``scale_inv [N]``) -> jax_fp8 state.

    With ``like`` (a pytree of ScalingStates, e.g. the model's FP8 state) the N tensors
    are split back into its structure, shapes and FP8 dtypes (the inverse of `to_te`);
    without it the result is one ScalingState stacked over N with ``fp8_dtype``.
    ``scale_inv`` defaults to ``1 / scale``.
    """
    amax_history = jnp.asarray(amax_history, jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    if amax_history.ndim != 2:
        raise ValueError(f"amax_history must be [L, N], got shape {amax_history.shape}")
    length, n = amax_history.shape
    scale_inv = 1.0 / scale if scale_inv is None else jnp.asarray(scale_inv, jnp.float32)
    for name, x in (("scale", scale), ("scale_inv", scale_inv)):
        if x.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) to match amax_history [L, N] = "
                             f"{amax_history.shape}, got {x.shape}")
    hist = amax_history.T
    if like is None:
        return ScalingState(hist, scale, scale_inv, fp8_dtype=fp8_dtype)
    leaves, treedef = jax.tree.flatten(like, is_leaf=_is_state)
    total = sum(int(np.prod(leaf.scale.shape, dtype=np.int64)) for leaf in leaves
                if _is_state(leaf))
    if total != n:
        raise ValueError(f"like holds {total} tensors but amax_history has N = {n}")
    out, offset = [], 0
    for leaf in leaves:
        if not _is_state(leaf):
            out.append(leaf)
            continue
        lead = tuple(leaf.scale.shape)
        count = int(np.prod(lead, dtype=np.int64))
        if leaf.amax_history.shape[-1] != length:
            raise ValueError(f"like has a state with history length "
                             f"{leaf.amax_history.shape[-1]}, amax_history has {length}")
        sl = slice(offset, offset + count)
        out.append(ScalingState(hist[sl].reshape(lead + (length,)), scale[sl].reshape(lead),
                                scale_inv[sl].reshape(lead), fp8_dtype=leaf.fp8_dtype))
        offset += count
    return jax.tree.unflatten(treedef, out)


__all__ = ["FLAX_COLLECTION", "from_flax", "from_te", "to_flax", "to_te"]
