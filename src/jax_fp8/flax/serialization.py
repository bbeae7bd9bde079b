"""flax.serialization (msgpack) support for ScalingState and PackedStates, checked on restore.

``flax.serialization.to_bytes(state)`` records each state's FP8 dtype, and for a packed
state the tree path and lead shape of every row. ``from_bytes`` into a target that does
not match raises ValueError naming the state (its path) and what differs, instead of
relabelling the arrays or handing one layer's rows to another:

- a ScalingState saved in another FP8 format, or with another history length or lead
  shape (arrays of other shapes);
- a PackedStates whose rows are other states: a layer added, removed, moved or renamed,
  or a state of another format, history length or lead shape; also a checkpoint of
  unpacked states restored into a packed target.

Registered when ``jax_fp8.flax`` is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from flax import serialization

from jax_fp8.packing import PackedCollection, PackedStates
from jax_fp8.state import FIELDS, ScalingState

if TYPE_CHECKING:
    from typing import Any

# FP8 states are scaling statistics, not weights: when the model changed, training can
# start from fresh ones.
_FIX = ("Restore into a target made from the model that wrote the checkpoint (the same FP8 "
        "layers and recipe), or restore only the params and start from the new model's "
        "fresh FP8 states.")


def _where() -> str:
    # flax.serialization's functions are unannotated.
    path = serialization.current_path()  # type: ignore[no-untyped-call]  # "./fp8/Dense_0/..."; "." at the top
    return path.removeprefix(".").removeprefix("/") or "the top level"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _state_dict(st: ScalingState) -> dict[str, Any]:
    out = {f: serialization.to_state_dict(getattr(st, f)) for f in FIELDS}
    out["fp8_dtype"] = st.fp8_dtype.name
    return out


def _from_state_dict(target: ScalingState, state: dict[str, Any]) -> ScalingState:
    if not isinstance(state, dict) or "fp8_dtype" not in state:
        raise ValueError(f"restoring the ScalingState at {_where()}: the checkpoint holds "
                         f"no ScalingState there. {_FIX}")
    saved = _text(state["fp8_dtype"])
    if saved != target.fp8_dtype.name:
        raise ValueError(f"restoring the ScalingState at {_where()}: it was saved as "
                         f"{saved}, the target's FP8 format is {target.fp8_dtype.name}. "
                         f"{_FIX}")
    missing = [f for f in FIELDS if f not in state]
    if missing:
        raise ValueError(f"restoring the ScalingState at {_where()}: the checkpoint's state "
                         f"lacks {missing}")
    for f in FIELDS:
        have, want = np.shape(state[f]), np.shape(getattr(target, f))
        if have != want:
            raise ValueError(
                f"restoring the ScalingState at {_where()}: its {f} was saved with shape "
                f"{have}, the target's has {want} (another history length or number of "
                f"stacked layers). {_FIX}")
    history, scale, scale_inv = (serialization.from_state_dict(getattr(target, f), state[f])
                                 for f in FIELDS)
    return ScalingState(history, scale, scale_inv, fp8_dtype=target.fp8_dtype)


def _describe(rows: Sequence[tuple[str, int, str, tuple[int, ...]]]
              ) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """{path: (fp8 dtype, history length, lead shape)} of a packed state's rows."""
    return {path: (dtype, length, tuple(lead)) for dtype, length, path, lead in rows}


def _target_rows(p: PackedStates) -> list[tuple[str, int, str, tuple[int, ...]]]:
    return [(np.dtype(dtype).name, int(length), path, tuple(lead))
            for (dtype, length), rows in zip(p.layout.groups, p.layout.rows)
            for path, lead in rows]


def _saved_rows(state: dict[str, Any]) -> list[tuple[str, int, str, tuple[int, ...]]]:
    """The rows a packed state dict was saved with, or raises naming why there are none."""
    out = []
    for key, entry in state.items():
        if key.startswith("other_"):
            continue
        if not isinstance(entry, dict) or any(f not in entry for f in ("fp8_dtype", *FIELDS)):
            raise ValueError(
                f"restoring the packed FP8 states at {_where()}: the checkpoint holds "
                f"{key!r} there, not a packed group: it was saved unpacked (e.g. "
                f"Fp8TrainState.create(..., pack_fp8=False)). Restore into an unpacked "
                f"target, then pack it with jax_fp8.pack_states")
        if "rows" not in entry:
            raise ValueError(
                f"restoring the packed FP8 states at {_where()}: the group {key!r} was "
                f"saved without the paths of its rows, so whose they are cannot be "
                f"checked. {_FIX}")
        length = int(np.shape(entry["amax_history"])[-1])
        out += [(_text(entry["fp8_dtype"]), length, _text(path), tuple(lead))
                for path, lead in entry["rows"]]
    return out


def _layout_error(saved: Sequence[tuple[str, int, str, tuple[int, ...]]],
                  want: Sequence[tuple[str, int, str, tuple[int, ...]]]) -> ValueError:
    have, need = _describe(saved), _describe(want)

    def desc(info: tuple[str, int, tuple[int, ...]]) -> str:
        dtype, length, lead = info
        return f"{dtype}, history {length}" + (f", lead shape {lead}" if lead else "")

    head = f"restoring the packed FP8 states at {_where()}: "
    missing = [p for p in need if p not in have]
    extra = [p for p in have if p not in need]
    changed = [p for p in need if p in have and have[p] != need[p]]
    if changed:
        p = changed[0]
        what = f"the state {p} was saved as {desc(have[p])}; the target's is {desc(need[p])}"
    elif missing or extra:
        parts = []
        if missing:
            parts.append(f"the target's state {missing[0]} ({desc(need[missing[0]])}) is not "
                         f"in the checkpoint")
        if extra:
            parts.append(f"the checkpoint's state {extra[0]} ({desc(have[extra[0]])}) is not "
                         f"in the target")
        what = "; ".join(parts)
    else:
        what = "the checkpoint's rows hold the target's states in another order"
    counts = (f" (checkpoint: {len(have)} states, target: {len(need)}; "
              f"{len(missing)} missing, {len(extra)} extra, {len(changed)} changed)")
    return ValueError(head + what + counts + ". " + _FIX)


def _packed_state_dict(p: PackedStates) -> dict[str, Any]:
    keys = p.layout.keys
    out = {}
    for key, group, rows in zip(keys, p.groups, p.layout.rows):
        out[key] = _state_dict(group)
        out[key]["rows"] = [[path, list(lead)] for path, lead in rows]
    for key, other in zip(keys[len(p.groups):], p.others):
        out[key] = serialization.to_state_dict(other)
    return out


def _packed_from_state_dict(target: PackedStates, state: dict[str, Any]) -> PackedStates:
    if not isinstance(state, dict):
        raise ValueError(f"restoring the packed FP8 states at {_where()}: the checkpoint "
                         f"holds a {type(state).__name__} there. {_FIX}")
    saved, want = _saved_rows(state), _target_rows(target)
    keys = target.layout.keys
    names = keys[:len(target.groups)]
    if sorted(saved) != sorted(want) or any(k not in state for k in names):
        raise _layout_error(saved, want)
    others = []
    other_paths = [p for slot, p in zip(target.layout.slots, target.layout.paths)
                   if slot is None]
    for key, other, path in zip(keys[len(target.groups):], target.others, other_paths):
        if key not in state:
            raise ValueError(f"restoring the packed FP8 states at {_where()}: the checkpoint "
                             f"lacks the target's leaf {path} (not a state). {_FIX}")
        others.append(serialization.from_state_dict(other, state[key], name=key))
    groups = tuple(serialization.from_state_dict(g, state[n], name=n)
                   for n, g in zip(names, target.groups))
    return PackedStates(groups, tuple(others), target.layout)


serialization.register_serialization_state(  # type: ignore[no-untyped-call]
    ScalingState, _state_dict, _from_state_dict, override=True)
for _cls in (PackedStates, PackedCollection):  # flax looks the exact type up
    serialization.register_serialization_state(  # type: ignore[no-untyped-call]
        _cls, _packed_state_dict, _packed_from_state_dict, override=True)
