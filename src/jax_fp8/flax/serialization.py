"""flax.serialization (msgpack) support for ScalingState and PackedStates, dtype-checked.

``flax.serialization.to_bytes(state)`` records each state's FP8 dtype; ``from_bytes``
into a target whose FP8 dtypes differ raises ValueError instead of relabelling the
states. Registered when ``jax_fp8.flax`` is imported.
"""

from __future__ import annotations

from flax import serialization

from jax_fp8.packing import PackedStates, group_name
from jax_fp8.state import ScalingState

_FIELDS = ("amax_history", "scale", "scale_inv")


def _state_dict(st: ScalingState) -> dict:
    out = {f: serialization.to_state_dict(getattr(st, f)) for f in _FIELDS}
    out["fp8_dtype"] = st.fp8_dtype.name
    return out


def _from_state_dict(target: ScalingState, state: dict) -> ScalingState:
    saved = state.get("fp8_dtype")
    if isinstance(saved, bytes):
        saved = saved.decode()
    if saved is not None and saved != target.fp8_dtype.name:
        raise ValueError(f"restoring a ScalingState saved as {saved} into a target of "
                         f"{target.fp8_dtype.name}: the FP8 formats differ (create the "
                         f"target with the recipe the checkpoint was trained with)")
    missing = [f for f in _FIELDS if f not in state]
    if missing:
        raise ValueError(f"a serialized ScalingState lacks {missing}")
    return ScalingState(*(serialization.from_state_dict(getattr(target, f), state[f])
                          for f in _FIELDS), fp8_dtype=target.fp8_dtype)


def _packed_state_dict(p: PackedStates) -> dict:
    out = {group_name(*key): _state_dict(g) for key, g in zip(p.layout.groups, p.groups)}
    out.update({f"other{i}": serialization.to_state_dict(o) for i, o in enumerate(p.others)})
    return out


def _packed_from_state_dict(target: PackedStates, state: dict) -> PackedStates:
    names = [group_name(*key) for key in target.layout.groups]
    saved = sorted(k for k in state if not k.startswith("other"))
    if sorted(names) != saved:
        raise ValueError(f"restoring packed FP8 states saved as groups {saved} into a target "
                         f"with groups {sorted(names)}: the FP8 formats or history lengths "
                         f"differ")
    groups = tuple(_from_state_dict(g, state[n]) for n, g in zip(names, target.groups))
    others = tuple(serialization.from_state_dict(o, state[f"other{i}"])
                   for i, o in enumerate(target.others))
    return PackedStates(groups, others, target.layout)


serialization.register_serialization_state(ScalingState, _state_dict, _from_state_dict,
                                           override=True)
serialization.register_serialization_state(PackedStates, _packed_state_dict,
                                           _packed_from_state_dict, override=True)
