"""The public update functions: one tensor/stack, or every ScalingState of a pytree.

Both validate at trace time (errors name the argument) and bind the
`jax_fp8_update` primitive once, so any number of states is one custom call.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitives.update import ALGOS, IMPLEMENTATIONS, fp8_update_p
from jax_fp8.state import ScalingState, is_state

# A mesh axis name, or a tuple of them (as lax.pmax takes).
AxisName: TypeAlias = Hashable


def _check_array(x: Any, name: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.dtype != jnp.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")


def _check_state_arrays(history: Any, scale: Any, amax: Any, scale_inv: Any = None,
                        where: str = "", *, has_scale_inv: bool = False,
                        has_amax: bool = False) -> None:
    _check_array(history, f"{where}amax_history")
    if history.ndim < 1 or history.shape[-1] < 1:
        raise ValueError(f"{where}amax_history must have a history axis (last) of length "
                         f">= 1, got shape {tuple(history.shape)}")
    lead = tuple(history.shape[:-1])
    for name, x, required in (("scale", scale, True), ("scale_inv", scale_inv, has_scale_inv),
                              ("amax", amax, has_amax)):
        if x is None:
            if required:
                raise TypeError(f"{where}{name} must be a float32 array of shape {lead}, "
                                f"got None")
            continue
        _check_array(x, f"{where}{name}")
        if tuple(x.shape) != lead:
            raise ValueError(f"{where}{name} has shape {tuple(x.shape)} but must have "
                             f"amax_history.shape[:-1] = {lead}")


def _check_options(amax_compute_algo: str, power_of_2_scale: Any, skip_unused: Any,
                   implementation: str) -> None:
    recipe_lib.check_algorithm(amax_compute_algo)
    for name, value in (("power_of_2_scale", power_of_2_scale), ("skip_unused", skip_unused)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if implementation not in IMPLEMENTATIONS[:2]:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS[:2]}, "
                         f"got {implementation!r}")


def _bind(histories: Sequence[jax.Array], scales: Sequence[jax.Array],
          scale_invs: Sequence[jax.Array] | None, amaxes: Sequence[jax.Array] | None,
          scaled_maxes: Sequence[float], amax_compute_algo: str, power_of_2_scale: bool,
          skip_unused: bool, implementation: str,
          in_place: bool = True) -> tuple[Any, Any, Any]:
    operands = [*histories, *scales, *(scale_invs or ()), *(amaxes or ())]
    g = len(histories)
    outs = fp8_update_p.bind(
        *operands, scaled_max=tuple(scaled_maxes),
        amax_compute_algo=ALGOS[amax_compute_algo],
        power_of_2_scale=bool(power_of_2_scale), skip_unused=bool(skip_unused),
        has_scale_inv=scale_invs is not None, has_amax=amaxes is not None,
        in_place=bool(in_place), implementation=implementation)
    return outs[:g], outs[g:2 * g], outs[2 * g:]


def amax_and_scale_update(amax_history: jax.Array, scale: jax.Array,
                          amax: jax.Array | None = None, *,
                          fp8_dtype: DTypeLike = jnp.float8_e4m3fn, margin: float = 0.0,
                          amax_compute_algo: str = "max", power_of_2_scale: bool = False,
                          skip_unused: bool = False, implementation: str = "auto",
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Delayed-scaling update of one FP8 tensor or a stack of them (docs/semantics.md).

    Args:
      amax_history: float32 [..., L]; index 0 is the staging slot.
      scale: float32 [...], the quantization scale (x_fp8 = x * scale).
      amax: optional float32 [...], newly observed amax merged into slot 0.
      fp8_dtype: the FP8 dtype the scale is for (gives fp8_max).
      margin: scale = fp8_max * 2**-margin / amax; finite.
      amax_compute_algo: "max" (max over the history) or "most_recent".
      power_of_2_scale: round each scale down to a power of two.
      skip_unused: leave a tensor untouched when its staged amax is 0.
      implementation: "auto" (the fused kernel where built) or "jnp".

    Returns:
      (new_history [..., L], new_scale [...], new_scale_inv [...]).

    Raises:
      TypeError: an array that is not float32, a non-bool flag, or a dtype that is not
        one of the FP8 dtypes.
      ValueError: shapes that do not match, an unknown algorithm or implementation, or a
        margin that is not finite or leaves no usable range.
    """
    _check_state_arrays(amax_history, scale, amax, has_amax=False)
    _check_options(amax_compute_algo, power_of_2_scale, skip_unused, implementation)
    smax = recipe_lib.scaled_max(recipe_lib.canonical_fp8_dtype(fp8_dtype), margin)
    (h,), (s,), (si,) = _bind([amax_history], [scale], None, None if amax is None else [amax],
                              [smax], amax_compute_algo, power_of_2_scale, skip_unused,
                              implementation)
    return h, s, si


def reduce_amaxes(amaxes: Any, axis_name: AxisName) -> Any:
    """Global max of a pytree of amaxes over `axis_name`, as ONE collective.

    Every leaf is flattened into one float32 vector, reduced with a single
    `lax.pmax`, and split back (the packing TE does before its all-reduce). A NaN on
    one device is ignored (as the kernel ignores a NaN amax) instead of poisoning every
    replica; an amax that is NaN on every device stays NaN.
    """
    leaves, treedef = jax.tree.flatten(amaxes)
    if not leaves:
        return amaxes
    for x in leaves:
        _check_array(x, "amaxes leaf")
    flat = jnp.concatenate([jnp.ravel(x) for x in leaves])
    # jax.lax.pmax is unannotated in JAX.
    flat = jax.lax.pmax(jnp.where(jnp.isnan(flat), -jnp.inf, flat), axis_name)  # type: ignore[no-untyped-call]
    flat = jnp.where(flat == -jnp.inf, jnp.nan, flat)  # only all-NaN gives -inf
    out, start = [], 0
    for x in leaves:
        out.append(flat[start:start + x.size].reshape(x.shape))
        start += x.size
    return jax.tree.unflatten(treedef, out)


# Calls on more state arrays than this are updated out of place by default: XLA's compile
# time grows superlinearly with the number of aliased operands of one custom call.
IN_PLACE_MAX_STATES = 128


def _where(paths: list[Any], i: int, tree: Any) -> str:
    if paths[0] is None:
        paths[0] = [jax.tree_util.keystr(p) for p, _ in
                    jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]]
    return cast(str, paths[0][i])


def update_states(tree: Any, amaxes: Any = None, *, recipe: Any = recipe_lib.DEFAULT_RECIPE,
                  axis_name: AxisName | None = None, implementation: str = "auto",
                  in_place: bool | None = None) -> Any:
    """Updates every ScalingState leaf of `tree` with one fused op.

    Args:
      tree: any pytree; its ScalingState nodes are updated, other leaves returned as is.
      amaxes: None (the newest amaxes are already in each history's staging slot), or a
        pytree with the structure of `tree` holding, in place of each ScalingState, a
        float32 array of that state's scale shape (the newly observed amax).
      recipe: a DelayedScaling; margin, algorithm, power-of-two rounding and
        skip_unused come from it, fp8_max from each state's own dtype.
      axis_name: inside shard_map/pmap, the mesh axis (or axes) to max-reduce the
        amaxes (or, without amaxes, the staging slots) over first, with one collective
        for the whole tree (reduce_amaxes).
      implementation: "auto" (the fused kernel where built) or "jnp".
      in_place: True: every state result aliases its input (with the input donated, the
        update writes where the state lives); False: the results are new buffers, which
        keeps compile time linear in the number of states. None (default): in place for
        up to ``IN_PLACE_MAX_STATES`` states, else out of place. Pack many per-tensor
        states into a few arrays (`pack_states`, Fp8TrainState's default) to have both.

    Returns:
      `tree` with every ScalingState replaced by its updated state.

    Raises:
      TypeError: a recipe that is not a DelayedScaling, a state array that is not
        float32, or an ``in_place`` that is not None or a bool.
      ValueError: ``amaxes`` whose structure or shapes do not match ``tree``, or an
        unknown implementation. An error about one state names its path in ``tree``.

    Example:
        ```python
        states = {"a": ScalingState.create(), "b": ScalingState.create((4,))}
        states = jax.jit(update_states, donate_argnums=0)(states)
        ```
    """
    delayed = recipe_lib.check_delayed(recipe_lib.or_default(recipe), "recipe")
    _check_options(delayed.amax_compute_algo, delayed.power_of_2_scale, delayed.skip_unused,
                   implementation)
    if in_place not in (None, True, False):
        raise TypeError(f"in_place must be None, True or False, got {in_place!r}")
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_state)
    if amaxes is not None:
        try:
            # PyTreeDef.flatten_up_to exists; jax's type stubs do not declare it.
            amax_leaves = treedef.flatten_up_to(amaxes)  # type: ignore[attr-defined]
        except (ValueError, TypeError) as err:
            raise ValueError(f"amaxes must have the structure of tree, with one array per "
                             f"ScalingState: {err}") from None
    index = [i for i, leaf in enumerate(leaves) if is_state(leaf)]
    if not index:
        return tree
    states = [leaves[i] for i in index]
    paths = [None]
    for i, st in zip(index, states):
        amax = None if amaxes is None else amax_leaves[i]
        try:
            _check_state_arrays(st.amax_history, st.scale, amax, st.scale_inv,
                                has_scale_inv=True, has_amax=amaxes is not None)
        except (TypeError, ValueError) as err:
            where = _where(paths, i, tree)
            raise type(err)(f"tree{where}: {err}" + ("" if amaxes is None else
                                                     f" (amaxes{where})")) from None
    if amaxes is not None:
        amax_list = [amax_leaves[i] for i in index]
    elif axis_name is not None:  # the staging slots are the amaxes to reduce
        amax_list = [st.amax_history[..., 0] for st in states]
    else:
        amax_list = None
    if amax_list is not None and axis_name is not None:
        amax_list = reduce_amaxes(amax_list, axis_name)
    if in_place is None:
        in_place = len(states) <= IN_PLACE_MAX_STATES
    scaled = [recipe_lib.scaled_max(recipe_lib.canonical_fp8_dtype(st.fp8_dtype), delayed.margin)
              for st in states]
    h, s, si = _bind([st.amax_history for st in states], [st.scale for st in states],
                     [st.scale_inv for st in states] if in_place else None, amax_list, scaled,
                     delayed.amax_compute_algo, delayed.power_of_2_scale, delayed.skip_unused,
                     implementation, in_place=in_place)
    for n, i in enumerate(index):
        leaves[i] = ScalingState(h[n], s[n], si[n], fp8_dtype=states[n].fp8_dtype)
    return jax.tree.unflatten(treedef, leaves)
