"""The frame every jax_fp8 primitive is declared in, and the one place that picks a lowering.

A primitive is a `Spec`: its name, abstract evaluation, jax.numpy reference (the bits
every lowering must give), the FFI kernel per platform with the predicate for when it
applies, and how it batches, differentiates and partitions. `register` turns a Spec into
a JAX primitive with its eager impl, lowerings, batching, JVP and sharding rules.

Every primitive takes the parameter ``implementation``, one of `IMPLEMENTATIONS`
(``"auto"`` unless bound with another; the environment variable
``JAX_FP8_IMPLEMENTATION=jnp``, read when jax_fp8 is imported, makes every ``"auto"`` a
``"jnp"``: the one switch that runs the reference everywhere):

* ``"auto"``: the platform's kernel where it is built and takes the operands; under a
  jit over several devices, one partitioned call where the Spec says how to partition
  (each device runs the kernel on the shards it holds), else the reference, whose XLA
  ops XLA's partitioner shards;
* ``"jnp"``: the reference everywhere.

`decide` is the one decision of which lowering runs, and why (``choose`` asks it while
lowering, ``jax_fp8.devtools.explain`` for a whole program); `kernels_on` says which
primitives have a kernel on a platform in this process.

The frame is in four modules, whose names this one re-exports: ``spec`` (the declaration:
`Spec`, `Kernel`, `Partitioning`, the implementations), ``decision`` (`decide`),
``platforms`` (`ByPlatform`) and this one (`register`: the primitive, its binding on
Explicit meshes and inside shard_map, its rules, `compiled_call`).

A computation in XLA ops with a version per platform and no kernel (the FP8 GEMM's
accumulation, named as a dot algorithm only on CUDA) is a `ByPlatform`: `by_platform`
makes it a function whose version is chosen where it is lowered, `decide_platform` says
which and why (explain reports it too), and ``JAX_FP8_IMPLEMENTATION=jnp`` makes it the
reference.

Two rules every primitive gets from the frame by declaring them:

* ``Spec.same_varying``: inside shard_map, the operands are made to vary over the union
  of their manual axes before the primitive is bound (and abstract evaluation checks it);
* ``Partitioning.explicit``: on a mesh with Explicit axes (sharding in types), the
  primitive runs per device under ``jax.shard_map`` with the shardings its Partitioning
  gives (the operands resharded to them first), so its results carry those shardings in
  their types: the same per-device program as custom_partitioning runs on Auto meshes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp8 import _registration
from jax_fp8._primitives import axis_types, jax_compat
from jax_fp8._primitives.decision import (  # noqa: F401 (the frame's names, re-exported)
    choose as choose,
    decide as decide,
    jnp_reason as jnp_reason,
    needs_partitioning as needs_partitioning,
    partition_devices as partition_devices,
)
from jax_fp8._primitives.platforms import (  # noqa: F401
    BY_PLATFORM as BY_PLATFORM,
    VARIANT as VARIANT,
    ByPlatform as ByPlatform,
    Variant as Variant,
    by_platform as by_platform,
    decide_platform as decide_platform,
    device_platform as device_platform,
)
from jax_fp8._primitives.spec import (  # noqa: F401
    DEFAULT as DEFAULT,
    ENV as ENV,
    IMPLEMENTATIONS as IMPLEMENTATIONS,
    KERNEL as KERNEL,
    PARTITIONED as PARTITIONED,
    PER_DEVICE as PER_DEVICE,
    REFERENCE as REFERENCE,
    SPECS as SPECS,
    Kernel as Kernel,
    Partitioning as Partitioning,
    Spec as Spec,
    kernels_on as kernels_on,
    static_params as static_params,
)


class _Primitive(Primitive):
    """A primitive whose ``implementation`` parameter defaults to `DEFAULT`, with the frame's
    rules for shard_map's varying axes and Explicit meshes (see the module docstring)."""

    def bind(self, *args: Any, **params: Any) -> Any:
        if params.get("implementation", "auto") == "auto":
            params["implementation"] = DEFAULT   # "auto" unless the environment says "jnp"
        spec = SPECS[self.name]
        if spec.same_varying:
            args = tuple(axis_types.vary_like(args))
        part = spec.partitioning
        if (part is not None and part.explicit and params["implementation"] in IMPLEMENTATIONS
                and any(axis_types.on_explicit_mesh(a) for a in args)):
            return _explicit_mesh_bind(spec, self, args, params)
        # JAX's Primitive.bind is unannotated.
        return super().bind(*args, **params)  # type: ignore[no-untyped-call]


def _spec_of(aval: Any, mesh: jax.sharding.Mesh) -> NamedSharding:
    """aval's sharding on `mesh` (replicated where its type names no mesh)."""
    sharding: Any = getattr(aval, "sharding", None)
    if getattr(getattr(sharding, "mesh", None), "empty", True):
        # PartitionSpec's constructor is unannotated in JAX.
        return NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]
    return NamedSharding(mesh, sharding.spec)


def _explicit_mesh_bind(spec: Spec, prim: _Primitive, args: Sequence[Any],
                        params: dict[str, Any]) -> Any:
    """`prim` on operands typed on a mesh with Explicit axes: resharded to the shardings
    its Partitioning asks for, then each device's computation (as under
    custom_partitioning) under shard_map, whose results carry the result shardings."""
    part = spec.partitioning
    assert part is not None, "bound here only for a partitioned spec"
    params = dict(params)
    local = PER_DEVICE if params.pop("implementation") == "auto" else "jnp"
    avals = [jax.typeof(a) for a in args]
    mesh = next(a.sharding.mesh for a in avals if axis_types.on_explicit_mesh(a))
    # jax.ShapeDtypeStruct's constructor and jax.sharding.reshard are unannotated in JAX.
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_spec_of(a, mesh))  # type: ignore[no-untyped-call]
              for a in avals]
    arg_shardings, result_shardings = part.shardings(params, mesh, shapes)
    args = [jax.sharding.reshard(a, s) for a, s in zip(args, arg_shardings)]  # type: ignore[no-untyped-call]

    def per_device(*operands: Any) -> Any:
        return _per_device(spec, prim, params, mesh, arg_shardings, operands, local)

    specs: Callable[[Any], tuple[Any, ...]] = \
        lambda shardings: tuple(s.spec for s in shardings)  # noqa: E731
    out_specs = specs(result_shardings) if spec.multiple_results else result_shardings.spec
    with jax.named_scope(per_device_scope(spec.name)):
        return jax.shard_map(per_device, mesh=mesh, in_specs=specs(arg_shardings),
                             out_specs=out_specs)(*args)


def per_device_scope(name: str) -> str:
    """The name scope of a partitioned primitive's per-device computation: its ops carry
    it in their HLO metadata (op_name), whichever lowering they got."""
    return f"{name}_per_device"


def _per_device(spec: Spec, prim: _Primitive, params: dict[str, Any], mesh: jax.sharding.Mesh,
                arg_shardings: Any, operands: Sequence[Any],
                implementation: str = PER_DEVICE) -> Any:
    """One device's computation of a partitioned `prim` on the shards it holds (with
    ``implementation="jnp"``: the reference on them)."""
    part = spec.partitioning
    assert part is not None, "called only for a partitioned spec"

    def bind(*ops: Any, **kw: Any) -> Any:
        outs = prim.bind(*ops, implementation=implementation, **kw)
        return tuple(outs) if spec.multiple_results else outs

    if part.local is not None:
        return part.local(bind, operands, mesh=mesh, shardings=arg_shardings, params=params)
    outs = bind(*operands, **params)
    return part.combine(outs, mesh) if part.combine else outs


def register(spec: Spec) -> _Primitive:
    """The JAX primitive of `spec`, with all its rules registered."""
    if spec.name in SPECS:
        raise ValueError(f"primitive {spec.name} is already registered")
    SPECS[spec.name] = spec
    prim = _Primitive(spec.name)
    prim.multiple_results = spec.multiple_results
    rules = _Rules(spec, prim)
    # Primitive.def_abstract_eval and def_impl are unannotated in JAX.
    prim.def_abstract_eval(rules.abstract_eval)  # type: ignore[no-untyped-call]
    prim.def_impl(eager_impl(prim))  # type: ignore[no-untyped-call]
    mlir.register_lowering(prim, functools.partial(rules.lowering, platform=None))
    for platform in spec.kernels:
        if _registration.has_kernel(spec.name, platform):
            mlir.register_lowering(prim, functools.partial(rules.lowering, platform=platform),
                                   platform=platform)
    batch = {"leading_axes": rules.batch_leading_axes, "reference": rules.batch_reference}
    batching.primitive_batchers[prim] = (batch[spec.batch] if isinstance(spec.batch, str)
                                         else spec.batch)
    if spec.jvp == "linear":
        ad.deflinear2(prim, spec.transpose)  # type: ignore[no-untyped-call]  # unannotated in JAX
    else:
        ad.primitive_jvps[prim] = {"zero": rules.jvp_zero,
                                   "reference": rules.jvp_reference}[spec.jvp]
    if spec.partitioning is not None:
        jax_compat.require_devices_during_lowering(prim)
    return prim


def eager_impl(prim: Primitive) -> Callable[..., Any]:
    """An impl rule that runs `prim` as a compiled one-primitive program (`compiled_call`)."""
    return functools.partial(compiled_call, prim.bind)


def compiled_call(fn: Callable[..., Any], *operands: Any, **params: Any) -> Any:
    """``fn(*operands, **params)`` run as one compiled program, also eagerly and under
    ``jax.disable_jit()`` (which would otherwise run it op by op, or turn a primitive's
    jit back into its impl): one jit per `fn` and static (hashable) `params`, kept for the
    life of the process. The one cache of eager compiled programs."""
    with jax.disable_jit(False):
        return _compiled(fn, static_params(params))(*operands)


@functools.cache
def _compiled(fn: Callable[..., Any], static: tuple[Any, ...]) -> Callable[..., Any]:
    return jax.jit(functools.partial(fn, **dict(static)))


@dataclasses.dataclass(frozen=True, eq=False)
class _Rules:
    """The rules `register` generates for one Spec."""
    spec: Spec
    prim: _Primitive

    def _results(self, outs: Any, value: Any) -> Any:
        return [value] * len(outs) if self.spec.multiple_results else value

    def abstract_eval(self, *avals: Any, implementation: str, **params: Any) -> Any:
        if implementation not in IMPLEMENTATIONS + (PER_DEVICE,):
            raise ValueError(f"{self.spec.name}: implementation must be one of "
                             f"{IMPLEMENTATIONS}, got {implementation!r}")
        if self.spec.same_varying:
            axis_types.check_same_varying(self.spec.name, avals)
        return self.spec.abstract_eval(*avals, **params)

    # ----------------------------------------------------------------------- lowering

    def lowering(self, ctx: Any, *operands: Any, platform: str | None, implementation: str,
                 **params: Any) -> Any:
        how = choose(self.spec, platform, ctx, implementation, params)
        if how == KERNEL:
            # KERNEL is chosen only for a platform with a kernel (never None).
            return self.spec.kernels[cast(str, platform)].lower(ctx, *operands, **params)
        if how == PARTITIONED:
            partitioned = functools.partial(self._partitioned(), static_params(params))

            def fn(*ops: Any) -> Any:
                with jax.named_scope(per_device_scope(self.spec.name)):
                    return partitioned(*ops)

            return self._lower_fun(fn)(ctx, *operands)
        if self.spec.reference_lowering is not None:
            return self.spec.reference_lowering(ctx, *operands, **params)
        return self._lower_fun(self._reference(static_params(params)))(ctx, *operands)

    def _lower_fun(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if self.spec.multiple_results:
            return mlir.lower_fun(lambda *ops: list(fn(*ops)), multiple_results=True)
        return mlir.lower_fun(fn, multiple_results=False)

    @functools.cache  # noqa: B019 (one _Rules per primitive, alive as long as the process)
    def _reference(self, static: tuple[Any, ...]) -> Callable[..., Any]:
        fn = functools.partial(cast("Callable[..., Any]", self.spec.reference), **dict(static))
        return jax.jit(fn) if self.spec.cache_reference else fn

    @functools.cache  # noqa: B019
    def _partitioned(self) -> Any:
        part = cast(Partitioning, self.spec.partitioning)   # made only for a spec with one

        def per_device(static: tuple[Any, ...], *operands: Any) -> Any:
            outs = self.prim.bind(*operands, implementation=PER_DEVICE, **dict(static))
            return tuple(outs) if self.spec.multiple_results else outs

        def partition(static: tuple[Any, ...], mesh: jax.sharding.Mesh, arg_shapes: Any,
                      result_shape: Any) -> tuple[Any, Callable[..., Any], Any, Any]:
            del result_shape
            args, results = part.shardings(dict(static), mesh, arg_shapes)

            def lower(*operands: Any) -> Any:
                return _per_device(self.spec, self.prim, dict(static), mesh, args, operands)

            return mesh, lower, results, args

        def infer(static: tuple[Any, ...], mesh: jax.sharding.Mesh, arg_shapes: Any,
                  result_shape: Any) -> Any:
            del result_shape
            return part.shardings(dict(static), mesh, arg_shapes)[1]

        def rule(static: tuple[Any, ...], mesh: Any, operand_types: Any,
                 result_types: Any) -> Any:
            del mesh, result_types
            return part.rule(dict(static), operand_types)

        # custom_partitioning and its def_partition are unannotated in JAX.
        fn = custom_partitioning(per_device, static_argnums=(0,))  # type: ignore[no-untyped-call]
        fn.def_partition(partition=partition, infer_sharding_from_operands=infer,  # type: ignore[no-untyped-call]
                         sharding_rule=rule)
        return fn

    # ----------------------------------------------------------------------- batching

    def batch_leading_axes(self, args: Sequence[Any], dims: Sequence[int | None],
                           **params: Any) -> tuple[Any, Any]:
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        # batching.bdim_at_front is unannotated in JAX.
        args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]  # type: ignore[no-untyped-call]
        outs = self.prim.bind(*args, **params)
        return outs, self._results(outs, 0)

    def batch_reference(self, args: Sequence[Any], dims: Sequence[int | None], *,
                        implementation: str, **params: Any) -> tuple[Any, Any]:
        del implementation
        outs = jax.vmap(
            functools.partial(cast("Callable[..., Any]", self.spec.reference), **params),
            in_axes=tuple(dims))(*args)
        return outs, self._results(outs, 0)

    # ---------------------------------------------------------------------------- JVP

    def jvp_zero(self, primals: Sequence[Any], tangents: Sequence[Any],
                 **params: Any) -> tuple[Any, Any]:
        del tangents
        outs = self.prim.bind(*primals, **params)
        if self.spec.multiple_results:
            return outs, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]
        return outs, ad.Zero(jax.typeof(outs).to_tangent_aval())

    def jvp_reference(self, primals: Sequence[Any], tangents: Sequence[Any], *,
                      implementation: str, **params: Any) -> tuple[Any, Any]:
        del implementation
        tangents = [ad.instantiate_zeros(t) for t in tangents]  # type: ignore[no-untyped-call]  # unannotated in JAX
        reference = cast("Callable[..., Any]", self.spec.reference)
        return jax.jvp(functools.partial(reference, **params), tuple(primals), tuple(tangents))
