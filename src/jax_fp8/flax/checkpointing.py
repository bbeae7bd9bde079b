"""Orbax restores of Flax models with FP8 state, checked against the model first.

`orbax_restore(checkpointer, directory, target)` compares the checkpoint's metadata with
``target`` (an `Fp8TrainState`, a variables dict, an ``nnx.State``; packed or unpacked
FP8 state) before reading anything, and refuses a changed model with a ValueError that
names the variable and the fix, where orbax would print its tree-structure dump or, for an
amax history of another length, suggest padding or truncating it (which would make a
history of another model's steps). ``fresh_fp8=True`` restores everything but the FP8
state and keeps ``target``'s: the way to keep the parameters (and optimizer state) of a
checkpoint whose FP8 layers or recipe changed, or of a checkpoint saved without FP8
(Flax's own ``TrainState``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jax_fp8.packing import PackedStates
from jax_fp8.state import ScalingState

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["orbax_restore"]

# Tree keys of FP8 state: a ScalingState's fields (``amax_history_float8_e4m3fn``), a
# packed group (``float8_e4m3fn_L16_6rows_<digest>``), and Fp8TrainState's bookkeeping.
_FIELD = re.compile(r"(amax_history|scale|scale_inv)_float8_\w+")
_GROUP = re.compile(r"(float8_\w+?)_L(\d+)_(\d+)rows_[0-9a-f]{12}")
_BOOKKEEPING = ("fp8_formats", "fp8_pending")

_FIX = ("The model's FP8 layers or recipe changed since the checkpoint was saved (or it was "
        "saved without FP8 state, e.g. by Flax's TrainState). FP8 states are scaling "
        "statistics, not weights: restore with `jax_fp8.flax.orbax_restore(checkpointer, "
        "directory, target, fresh_fp8=True)` to keep the checkpoint's params (and optimizer "
        "state) and start the FP8 states fresh (target's), or restore into the model that "
        "wrote it. Never pad or truncate an amax history (orbax's strict=False): it would "
        "hold another model's steps.")


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _parts(path: Sequence[Any]) -> tuple[str, ...]:
    return tuple(_key_name(k) for k in path)


def _text(parts: tuple[str, ...]) -> str:
    return "/".join(parts)


def _is_fp8(parts: tuple[str, ...]) -> bool:
    return (bool(parts) and parts[0] in _BOOKKEEPING) or any(
        _FIELD.fullmatch(p) or _GROUP.fullmatch(p) for p in parts)


def _describe(parts: tuple[str, ...], shape: Sequence[int]) -> str:
    """A checkpoint / target FP8 variable in words."""
    for i, p in enumerate(parts):
        m = _GROUP.fullmatch(p)
        if m:
            return (f"packed FP8 group {_text(parts[:i + 1])} ({m.group(3)} states of "
                    f"{m.group(1)}, history {m.group(2)})")
    m = _FIELD.fullmatch(parts[-1]) if parts else None
    if m:
        dtype = parts[-1][len(m.group(1)) + 1:]
        return (f"FP8 state {_text(parts[:-1])} ({dtype}, its {m.group(1)} of shape "
                f"{tuple(shape)})")
    return f"FP8 bookkeeping {_text(parts)}"


def _group_rows(target: Any) -> dict[str, list[str]]:
    """Per packed group key of ``target``: its states' paths in the unpacked tree."""
    out: dict[str, list[str]] = {}
    for packed in jax.tree.leaves(target, is_leaf=lambda x: isinstance(x, PackedStates)):
        if isinstance(packed, PackedStates):
            for key, rows in zip(packed.layout.keys, packed.layout.rows):
                out[key] = [path for path, _ in rows]
    return out


def _flat(tree: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Leaf path -> shape (orbax compares shapes and converts dtypes)."""
    return {_parts(p): tuple(np.shape(x))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if x is not None}


def _compare(saved: dict[tuple[str, ...], tuple[int, ...]],
             want: dict[tuple[str, ...], tuple[int, ...]], rows: dict[str, list[str]],
             fresh_fp8: bool) -> None:
    fp8_problems, others = [], []
    for parts, shape in want.items():
        fp8 = _is_fp8(parts)
        if fp8 and fresh_fp8:
            continue
        if parts not in saved:
            if fp8:
                what, note = _describe(parts, shape), ""
                group = next((p for p in parts if _GROUP.fullmatch(p)), None)
                if group in rows:
                    where = parts[:parts.index(group)]
                    there = sorted({p[len(where)] for p in saved if p[:len(where)] == where
                                    and _GROUP.fullmatch(p[len(where)])})
                    what += f": the states {', '.join(rows[group])}"
                    note = f" (its groups there: {', '.join(there) or 'none'})"
                fp8_problems.append(f"the target's {what} is not in the checkpoint{note}")
            else:
                others.append(f"the checkpoint has no variable {_text(parts)} (shape "
                              f"{shape}) of the model it is restored into")
        elif saved[parts] != shape:
            if fp8:
                fp8_problems.append(f"the {_describe(parts, shape)}: the checkpoint's has shape "
                                    f"{saved[parts]} (another history length or number of "
                                    f"layers)")
            else:
                others.append(f"the variable {_text(parts)} has shape {saved[parts]} in "
                              f"the checkpoint, the target's {shape}")
    for parts, shape in saved.items():
        if parts not in want and not (fresh_fp8 and _is_fp8(parts)):
            if _is_fp8(parts):
                fp8_problems.append(f"the checkpoint's {_describe(parts, shape)} is not in "
                                    f"the model it is restored into")
            else:
                others.append(f"the checkpoint's variable {_text(parts)} (shape {shape}) "
                              f"is not in the model it is restored into")
    problems = fp8_problems + others
    if not problems:
        return
    more = f" ({len(problems) - 1} more differences)" if len(problems) > 1 else ""
    raise ValueError(f"orbax_restore: {problems[0]}{more}. " + (
        _FIX if fp8_problems else "The model changed since the checkpoint was saved: "
                                  "restore into the model that wrote it."))


def _metadata_tree(checkpointer: Any, directory: Any) -> Any:
    metadata = checkpointer.metadata(directory)
    return getattr(metadata, "item_metadata", metadata)


def _restore(checkpointer: Any, directory: Any, item: Any) -> Any:
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, item)
    if isinstance(checkpointer, ocp.StandardCheckpointer):
        return checkpointer.restore(directory, abstract)
    return checkpointer.restore(directory, args=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item)))


def orbax_restore(checkpointer: Any, directory: Any, target: Any, *,
                  fresh_fp8: bool = False) -> Any:
    """The checkpoint at ``directory`` restored into the structure of ``target``.

    Args:
      checkpointer: an orbax ``StandardCheckpointer`` or ``PyTreeCheckpointer`` (for a
        ``CheckpointManager``, the checkpointer of its step's item directory).
      directory: where ``checkpointer.save(directory, tree)`` wrote the checkpoint.
      target: the tree to restore into, made from the model as it is now: an
        `Fp8TrainState` (packed FP8 state or not), a variables dict, ``nnx.state(model)``.
      fresh_fp8: False (the default): restore everything, FP8 states included; True:
        restore everything but the FP8 states (and `Fp8TrainState`'s ``fp8_formats`` /
        ``fp8_pending``), which are ``target``'s as they are (fresh, for a target just
        made), whatever the checkpoint holds of them.

    Returns:
      ``target`` with its values from the checkpoint (the FP8 states ``target``'s with
      ``fresh_fp8``).

    Raises:
      ValueError: before anything is read, when the checkpoint and ``target`` differ in
        a variable that is restored: an FP8 state (a layer added, removed, moved or
        renamed; another history length, FP8 format or stacking; a packed group of other
        rows; no FP8 state in the checkpoint), named with its path (a packed group with
        its FP8 dtype, history length and, for the target's, its states), and the fix
        (``fresh_fp8=True``); or another variable (the model changed).
    """
    saved = _flat(_metadata_tree(checkpointer, directory))
    want = _flat(target)
    _compare(saved, want, _group_rows(target), fresh_fp8)
    if not fresh_fp8:
        return _restore(checkpointer, directory, target)
    # Everything but the FP8 state: restored as saved, then put in target's structure.
    is_state: Callable[[Any], bool] = \
        lambda x: isinstance(x, (ScalingState, PackedStates))  # noqa: E731
    raw = checkpointer.restore(directory)
    by_path = {_parts(p): x for p, x in jax.tree_util.tree_flatten_with_path(raw)[0]}

    def take(path: Sequence[Any], x: Any) -> Any:
        parts = _parts(path)
        if is_state(x) or _is_fp8(parts) or x is None:
            return x
        value = by_path[parts]
        sharding = getattr(x, "sharding", None)
        return (jax.device_put(value, sharding) if sharding is not None
                else jax.numpy.asarray(value, getattr(x, "dtype", None)))

    return jax.tree_util.tree_map_with_path(take, target, is_leaf=is_state)
