"""The public update functions: one tensor/stack, or every ScalingState of a pytree.

Both validate at trace time (errors name the argument) and bind the
`jax_fp8_update` primitive once, so any number of states is one custom call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitive import ALGOS, IMPLEMENTATIONS, fp8_update_p
from jax_fp8.state import ScalingState


def _check_array(x, name):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.dtype != jnp.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")


def _check_state_arrays(history, scale, amax, scale_inv=None, where=""):
    _check_array(history, f"{where}amax_history")
    if history.ndim < 1 or history.shape[-1] < 1:
        raise ValueError(f"{where}amax_history must have a history axis (last) of length "
                         f">= 1, got shape {tuple(history.shape)}")
    lead = tuple(history.shape[:-1])
    for name, x in (("scale", scale), ("scale_inv", scale_inv), ("amax", amax)):
        if x is None:
            continue
        _check_array(x, f"{where}{name}")
        if tuple(x.shape) != lead:
            raise ValueError(f"{where}{name} has shape {tuple(x.shape)} but must have "
                             f"amax_history.shape[:-1] = {lead}")


def _check_options(amax_compute_algo, power_of_2_scale, skip_unused, implementation):
    recipe_lib.check_algorithm(amax_compute_algo)
    for name, value in (("power_of_2_scale", power_of_2_scale), ("skip_unused", skip_unused)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if implementation not in IMPLEMENTATIONS[:2]:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS[:2]}, "
                         f"got {implementation!r}")


def _bind(histories, scales, scale_invs, amaxes, scaled_maxes, amax_compute_algo,
          power_of_2_scale, skip_unused, implementation):
    operands = [*histories, *scales, *(scale_invs or ()), *(amaxes or ())]
    g = len(histories)
    outs = fp8_update_p.bind(
        *operands, scaled_max=tuple(scaled_maxes),
        amax_compute_algo=ALGOS[amax_compute_algo],
        power_of_2_scale=bool(power_of_2_scale), skip_unused=bool(skip_unused),
        has_scale_inv=scale_invs is not None, has_amax=amaxes is not None,
        implementation=implementation)
    return outs[:g], outs[g:2 * g], outs[2 * g:]


def amax_and_scale_update(amax_history, scale, amax=None, *, fp8_dtype=jnp.float8_e4m3fn,
                          margin=0.0, amax_compute_algo="max", power_of_2_scale=False,
                          skip_unused=False, implementation="auto"):
    """Delayed-scaling update of one FP8 tensor or a stack of them (SPEC.md).

    Args:
      amax_history: float32 [..., L]; index 0 is the staging slot.
      scale: float32 [...], the quantization scale (x_fp8 = x * scale).
      amax: optional float32 [...], newly observed amax merged into slot 0.
      fp8_dtype: the FP8 dtype the scale is for (gives fp8_max).
      margin, amax_compute_algo, power_of_2_scale, skip_unused: as in SPEC.md.
      implementation: "auto" (the fused kernel where built) or "jnp".

    Returns:
      (new_history [..., L], new_scale [...], new_scale_inv [...]).
    """
    _check_state_arrays(amax_history, scale, amax)
    _check_options(amax_compute_algo, power_of_2_scale, skip_unused, implementation)
    smax = recipe_lib.scaled_max(recipe_lib.canonical_fp8_dtype(fp8_dtype), margin)
    (h,), (s,), (si,) = _bind([amax_history], [scale], None, None if amax is None else [amax],
                              [smax], amax_compute_algo, power_of_2_scale, skip_unused,
                              implementation)
    return h, s, si


def _is_state(x):
    return isinstance(x, ScalingState)


def reduce_amaxes(amaxes, axis_name):
    """Global max of a pytree of amaxes over `axis_name`, as ONE collective.

    Every leaf is flattened into one float32 vector, reduced with a single
    `lax.pmax`, and split back (the packing TE does before its all-reduce). NaN
    entries become -inf first, so a NaN on one device is ignored, as the kernel
    ignores a NaN amax, instead of poisoning every replica.
    """
    leaves, treedef = jax.tree.flatten(amaxes)
    if not leaves:
        return amaxes
    for x in leaves:
        _check_array(x, "amaxes leaf")
    flat = jnp.concatenate([jnp.ravel(x) for x in leaves])
    flat = jax.lax.pmax(jnp.where(jnp.isnan(flat), -jnp.inf, flat), axis_name)
    out, start = [], 0
    for x in leaves:
        out.append(flat[start:start + x.size].reshape(x.shape))
        start += x.size
    return jax.tree.unflatten(treedef, out)


def update_states(tree, amaxes=None, *, recipe=recipe_lib.DelayedScaling(),
                  axis_name=None, implementation="auto"):
    """Updates every ScalingState leaf of `tree` with one fused op.

    Args:
      tree: any pytree; its ScalingState nodes are updated, other leaves returned as is.
      amaxes: None, or a pytree with the structure of `tree` holding, in place of each
        ScalingState, a float32 array of that state's scale shape (the newly
        observed amax, already reduced across devices).
      recipe: a DelayedScaling; margin, algorithm, power-of-two rounding and
        skip_unused come from it, fp8_max from each state's own dtype.
      axis_name: inside shard_map/pmap, the mesh axis (or axes) to max-reduce the
        amaxes over first, with one collective for the whole tree (reduce_amaxes).
      implementation: "auto" (the fused kernel where built) or "jnp".

    Returns:
      `tree` with every ScalingState replaced by its updated state.
    """
    if not isinstance(recipe, recipe_lib.DelayedScaling):
        raise TypeError(f"recipe must be a jax_fp8.DelayedScaling, got {type(recipe).__name__}")
    _check_options(recipe.amax_compute_algo, recipe.power_of_2_scale, recipe.skip_unused,
                   implementation)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_state)
    if amaxes is not None:
        try:
            amax_leaves = treedef.flatten_up_to(amaxes)
        except (ValueError, TypeError) as err:
            raise ValueError(f"amaxes must have the structure of tree, with one array per "
                             f"ScalingState: {err}") from None
    index = [i for i, leaf in enumerate(leaves) if _is_state(leaf)]
    if not index:
        return tree
    if amaxes is not None and axis_name is not None:
        reduced = reduce_amaxes([amax_leaves[i] for i in index], axis_name)
        for i, a in zip(index, reduced):
            amax_leaves[i] = a
    states = [leaves[i] for i in index]
    paths = None
    for i, st in zip(index, states):
        amax = None if amaxes is None else amax_leaves[i]
        try:
            _check_state_arrays(st.amax_history, st.scale, amax, st.scale_inv)
        except (TypeError, ValueError) as err:
            if paths is None:
                paths = [jax.tree_util.keystr(p) for p, _ in
                         jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_state)[0]]
            where = f"tree{paths[i]}" if paths[i] else "tree"
            raise type(err)(f"{where}: {err}" + ("" if amaxes is None else
                                                   f" (amaxes{paths[i]})")) from None
    scaled = [recipe_lib.scaled_max(recipe_lib.canonical_fp8_dtype(st.fp8_dtype), recipe.margin)
              for st in states]
    h, s, si = _bind([st.amax_history for st in states], [st.scale for st in states],
                     [st.scale_inv for st in states],
                     None if amaxes is None else [amax_leaves[i] for i in index],
                     scaled, recipe.amax_compute_algo, recipe.power_of_2_scale,
                     recipe.skip_unused, implementation)
    for n, i in enumerate(index):
        leaves[i] = ScalingState(h[n], s[n], si[n], fp8_dtype=states[n].fp8_dtype)
    return jax.tree.unflatten(treedef, leaves)
