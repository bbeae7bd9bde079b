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
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp8 import _compat, _registration
from jax_fp8._primitives import axis_types

IMPLEMENTATIONS = ("auto", "jnp")
# The one switch that runs the reference everywhere: JAX_FP8_IMPLEMENTATION=jnp in the
# environment (read at import) is the implementation of every primitive bound without one.
ENV = "JAX_FP8_IMPLEMENTATION"
DEFAULT = os.environ.get(ENV, "auto")
if DEFAULT not in IMPLEMENTATIONS:
    raise ValueError(f"{ENV} must be one of {IMPLEMENTATIONS}, got {DEFAULT!r}")
# Inside a partitioned lowering: the kernel on one device's shards, never partitioned again.
PER_DEVICE = "per_device"
REFERENCE, KERNEL, PARTITIONED = "reference", "kernel", "partitioned"


def _always(*avals, **params) -> bool:
    del avals, params
    return True


def _no_reason(*avals, **params) -> None:
    del avals, params
    return None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A custom-call lowering on one platform: ``lower(ctx, *operands, **params)`` emits
    it; ``supports(*avals, **params)`` says whether it applies (else the reference runs);
    ``refuses(*avals, **params)``: None where it may run, else why not, in words (the
    reason `decide` gives: a kernel switched off, or the operands it does not take)."""
    lower: Callable
    supports: Callable = _always
    refuses: Callable = _no_reason


@dataclasses.dataclass(frozen=True)
class Partitioning:
    """custom_partitioning rules for a jit over several devices: each device binds the
    primitive (``PER_DEVICE``) on the shards it holds, then ``combine(results, mesh)``.

    ``shardings(params, mesh, arg_shapes)`` -> (operand shardings, result shardings);
    ``rule(params, operand_types)`` -> (Shardy rule, its keyword arguments);
    ``combine(results, mesh)``: applied to each device's results (e.g. a collective);
    ``local(bind, operands, *, mesh, shardings, params)``: instead of bind + combine,
    each device's whole computation, given ``bind(*operands, **params)`` (the primitive
    on one device) and the operand shardings `shardings` returned;
    ``supports(*avals, **params)``: whether to partition these operands; ``needs_kernel``:
    partition only on platforms with the kernel (elsewhere XLA shards the reference);
    ``explicit``: on meshes with Explicit axes run per device under shard_map with the
    same shardings (else the primitive sees the Explicit-typed operands itself).
    """
    shardings: Callable
    rule: Callable
    combine: Callable | None = None
    supports: Callable = _always
    needs_kernel: bool = True
    local: Callable | None = None
    explicit: bool = False


@dataclasses.dataclass(frozen=True)
class Spec:
    """A primitive's declaration.

    name: the primitive's name, also its FFI target's (ffi/module.cc).
    abstract_eval(*avals, **params): the result avals (checks the operands).
    reference(*operands, **params): the jax.numpy reference.
    reference_lowering(ctx, *operands, **params): an MLIR rule standing for the reference
      where there is none in jax.numpy.
    kernels: {platform ("cpu", "cuda"): Kernel}.
    batch: "leading_axes" (move the batched axis of every operand to the front and bind once:
      for primitives whose leading axes are independent tensors), "reference" (vmap the
      reference) or a batching rule ``(args, dims, **params)``.
    jvp: "zero" (results are not differentiated), "reference" (differentiate the
      reference) or "linear" (with ``transpose(cts, *operands, **params)``).
    partitioning: how it partitions under a jit over several devices, or None.
    same_varying: align the operands' varying manual axes (inside shard_map) at bind,
      and check them in abstract evaluation.
    cache_reference: lower the reference through one jit per parameters, so that many
      same-shaped calls trace it once.
    reference_where(*avals, **params): None, or why these operands get the reference on
      every platform and under any jit (asked by `decide` before kernels and partitioning).
    """
    name: str
    abstract_eval: Callable
    reference: Callable | None = None
    reference_lowering: Callable | None = None
    kernels: Mapping[str, Kernel] = dataclasses.field(default_factory=dict)
    multiple_results: bool = False
    batch: str | Callable = "leading_axes"
    jvp: str = "zero"
    transpose: Callable | None = None
    partitioning: Partitioning | None = None
    same_varying: bool = False
    cache_reference: bool = False
    reference_where: Callable = _no_reason


SPECS: dict[str, Spec] = {}


def kernels_on(platform: str) -> tuple[str, ...]:
    """The primitives whose kernel this process can emit on `platform` ("cpu", "cuda")."""
    return tuple(name for name, spec in SPECS.items()
                 if platform in spec.kernels and _registration.has_kernel(name, platform))


def partition_devices(ctx) -> int:
    """The devices a jit being lowered runs over (1 inside shard_map or pmap, and when
    lowering for ``jax.export``: custom_partitioning runs a Python callback inside XLA's
    partitioner, which a serialized program cannot carry; there the bare custom call is
    emitted and XLA's partitioner gathers its (small) operands instead: same bits)."""
    params = getattr(ctx.module_context, "lowering_parameters", None)
    if getattr(params, "for_export", False):
        return 1
    return getattr(ctx.module_context.axis_context, "num_devices", 1)


def needs_partitioning(ctx) -> bool:
    """True under a jit over several devices (`partition_devices`)."""
    return partition_devices(ctx) > 1


def decide(spec: Spec, platform: str | None, avals, implementation: str, params: dict,
           num_devices: int = 1) -> tuple[str, str]:
    """Which lowering of `spec` runs on `platform` (None: one without a kernel) for
    operands `avals` under a jit over `num_devices` devices, and why: (`KERNEL`,
    `PARTITIONED` or `REFERENCE`, the reason in words)."""
    if implementation == "jnp":
        return REFERENCE, _jnp_reason()
    forced = spec.reference_where(*avals, **params)
    if forced:
        return REFERENCE, forced
    kernel = None if platform is None else spec.kernels.get(platform)
    if kernel is None:
        no_kernel = f"no {platform or 'such'} kernel"
    elif not _registration.has_kernel(spec.name, platform):
        kernel, no_kernel = None, f"the {platform} kernel is not built in this process"
    if implementation != PER_DEVICE and num_devices > 1:
        part = spec.partitioning
        if part is None:
            return REFERENCE, (f"a jit over {num_devices} devices and no partitioning rule: "
                               "XLA partitions the reference")
        if kernel is None and part.needs_kernel:
            return REFERENCE, (f"a jit over {num_devices} devices and {no_kernel}: XLA "
                               "partitions the reference")
        if not part.supports(*avals, **params):
            return REFERENCE, (f"a jit over {num_devices} devices; the partitioning rule "
                               "does not take these operands: XLA partitions the reference")
        what = "the kernel" if kernel is not None else "the reference"
        return PARTITIONED, f"a jit over {num_devices} devices: each runs {what} on its shards"
    if kernel is None:
        return REFERENCE, no_kernel
    refused = kernel.refuses(*avals, **params)
    if refused:
        return REFERENCE, refused
    if not kernel.supports(*avals, **params):
        return REFERENCE, f"the {platform} kernel does not take these operands"
    return KERNEL, f"the {platform} kernel"


def _jnp_reason() -> str:
    return "implementation='jnp'" + (f" ({ENV}=jnp)" if DEFAULT == "jnp" else "")


def choose(spec: Spec, platform: str | None, ctx, implementation: str, params: dict) -> str:
    """Which lowering of `spec` runs on `platform` in lowering context `ctx` (`decide`)."""
    return decide(spec, platform, ctx.avals_in, implementation, params,
                  partition_devices(ctx))[0]


class _Primitive(Primitive):
    """A primitive whose ``implementation`` parameter defaults to `DEFAULT`, with the frame's
    rules for shard_map's varying axes and Explicit meshes (see the module docstring)."""

    def bind(self, *args, **params):
        if params.get("implementation", "auto") == "auto":
            params["implementation"] = DEFAULT   # "auto" unless the environment says "jnp"
        spec = SPECS[self.name]
        if spec.same_varying:
            args = tuple(axis_types.vary_like(args))
        part = spec.partitioning
        if (part is not None and part.explicit and params["implementation"] in IMPLEMENTATIONS
                and any(axis_types.on_explicit_mesh(a) for a in args)):
            return _explicit_mesh_bind(spec, self, args, params)
        return super().bind(*args, **params)


def _spec_of(aval, mesh) -> NamedSharding:
    """aval's sharding on `mesh` (replicated where its type names no mesh)."""
    sharding: Any = getattr(aval, "sharding", None)
    if getattr(getattr(sharding, "mesh", None), "empty", True):
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, sharding.spec)


def _explicit_mesh_bind(spec: Spec, prim, args, params):
    """`prim` on operands typed on a mesh with Explicit axes: resharded to the shardings
    its Partitioning asks for, then each device's computation (as under
    custom_partitioning) under shard_map, whose results carry the result shardings."""
    part = spec.partitioning
    assert part is not None, "bound here only for a partitioned spec"
    params = dict(params)
    local = PER_DEVICE if params.pop("implementation") == "auto" else "jnp"
    avals = [jax.typeof(a) for a in args]
    mesh = next(a.sharding.mesh for a in avals if axis_types.on_explicit_mesh(a))
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_spec_of(a, mesh)) for a in avals]
    arg_shardings, result_shardings = part.shardings(params, mesh, shapes)
    args = [jax.sharding.reshard(a, s) for a, s in zip(args, arg_shardings)]

    def per_device(*operands):
        return _per_device(spec, prim, params, mesh, arg_shardings, operands, local)

    specs = lambda shardings: tuple(s.spec for s in shardings)  # noqa: E731
    out_specs = specs(result_shardings) if spec.multiple_results else result_shardings.spec
    with jax.named_scope(per_device_scope(spec.name)):
        return jax.shard_map(per_device, mesh=mesh, in_specs=specs(arg_shardings),
                             out_specs=out_specs)(*args)


def per_device_scope(name: str) -> str:
    """The name scope of a partitioned primitive's per-device computation: its ops carry
    it in their HLO metadata (op_name), whichever lowering they got."""
    return f"{name}_per_device"


def _per_device(spec: Spec, prim, params, mesh, arg_shardings, operands,
                implementation=PER_DEVICE):
    """One device's computation of a partitioned `prim` on the shards it holds (with
    ``implementation="jnp"``: the reference on them)."""
    part = spec.partitioning
    assert part is not None, "called only for a partitioned spec"

    def bind(*ops, **kw):
        outs = prim.bind(*ops, implementation=implementation, **kw)
        return tuple(outs) if spec.multiple_results else outs

    if part.local is not None:
        return part.local(bind, operands, mesh=mesh, shardings=arg_shardings, params=params)
    outs = bind(*operands, **params)
    return part.combine(outs, mesh) if part.combine else outs


def register(spec: Spec) -> Primitive:
    """The JAX primitive of `spec`, with all its rules registered."""
    if spec.name in SPECS:
        raise ValueError(f"primitive {spec.name} is already registered")
    SPECS[spec.name] = spec
    prim = _Primitive(spec.name)
    prim.multiple_results = spec.multiple_results
    rules = _Rules(spec, prim)
    prim.def_abstract_eval(rules.abstract_eval)
    prim.def_impl(eager_impl(prim))
    mlir.register_lowering(prim, functools.partial(rules.lowering, platform=None))
    for platform in spec.kernels:
        if _registration.has_kernel(spec.name, platform):
            mlir.register_lowering(prim, functools.partial(rules.lowering, platform=platform),
                                   platform=platform)
    batch = {"leading_axes": rules.batch_leading_axes, "reference": rules.batch_reference}
    batching.primitive_batchers[prim] = (batch[spec.batch] if isinstance(spec.batch, str)
                                         else spec.batch)
    if spec.jvp == "linear":
        ad.deflinear2(prim, spec.transpose)
    else:
        ad.primitive_jvps[prim] = {"zero": rules.jvp_zero,
                                   "reference": rules.jvp_reference}[spec.jvp]
    if spec.partitioning is not None:
        _compat.require_devices_during_lowering(prim)
    return prim


def eager_impl(prim):
    """An impl rule that runs `prim` as a compiled one-primitive program (`compiled_call`)."""
    return functools.partial(compiled_call, prim.bind)


def compiled_call(fn: Callable, *operands, **params):
    """``fn(*operands, **params)`` run as one compiled program, also eagerly and under
    ``jax.disable_jit()`` (which would otherwise run it op by op, or turn a primitive's
    jit back into its impl): one jit per `fn` and static (hashable) `params`, kept for the
    life of the process. The one cache of eager compiled programs."""
    with jax.disable_jit(False):
        return _compiled(fn, _static(params))(*operands)


@functools.cache
def _compiled(fn: Callable, static: tuple):
    return jax.jit(functools.partial(fn, **dict(static)))


def _static(params: dict) -> tuple:
    return tuple(sorted(params.items()))


@dataclasses.dataclass(frozen=True, eq=False)
class _Rules:
    """The rules `register` generates for one Spec."""
    spec: Spec
    prim: Primitive

    def _results(self, outs, value):
        return [value] * len(outs) if self.spec.multiple_results else value

    def abstract_eval(self, *avals, implementation, **params):
        if implementation not in IMPLEMENTATIONS + (PER_DEVICE,):
            raise ValueError(f"{self.spec.name}: implementation must be one of "
                             f"{IMPLEMENTATIONS}, got {implementation!r}")
        if self.spec.same_varying:
            axis_types.check_same_varying(self.spec.name, avals)
        return self.spec.abstract_eval(*avals, **params)

    # ----------------------------------------------------------------------- lowering

    def lowering(self, ctx, *operands, platform, implementation, **params):
        how = choose(self.spec, platform, ctx, implementation, params)
        if how == KERNEL:
            return self.spec.kernels[platform].lower(ctx, *operands, **params)
        if how == PARTITIONED:
            partitioned = functools.partial(self._partitioned(), _static(params))

            def fn(*ops):
                with jax.named_scope(per_device_scope(self.spec.name)):
                    return partitioned(*ops)

            return self._lower_fun(fn)(ctx, *operands)
        if self.spec.reference_lowering is not None:
            return self.spec.reference_lowering(ctx, *operands, **params)
        return self._lower_fun(self._reference(_static(params)))(ctx, *operands)

    def _lower_fun(self, fn):
        if self.spec.multiple_results:
            return mlir.lower_fun(lambda *ops: list(fn(*ops)), multiple_results=True)
        return mlir.lower_fun(fn, multiple_results=False)

    @functools.cache  # noqa: B019 (one _Rules per primitive, alive as long as the process)
    def _reference(self, static):
        fn = functools.partial(cast(Callable, self.spec.reference), **dict(static))
        return jax.jit(fn) if self.spec.cache_reference else fn

    @functools.cache  # noqa: B019
    def _partitioned(self):
        part = cast(Partitioning, self.spec.partitioning)   # made only for a spec with one

        def per_device(static, *operands):
            outs = self.prim.bind(*operands, implementation=PER_DEVICE, **dict(static))
            return tuple(outs) if self.spec.multiple_results else outs

        def partition(static, mesh, arg_shapes, result_shape):
            del result_shape
            args, results = part.shardings(dict(static), mesh, arg_shapes)

            def lower(*operands):
                return _per_device(self.spec, self.prim, dict(static), mesh, args, operands)

            return mesh, lower, results, args

        def infer(static, mesh, arg_shapes, result_shape):
            del result_shape
            return part.shardings(dict(static), mesh, arg_shapes)[1]

        def rule(static, mesh, operand_types, result_types):
            del mesh, result_types
            return part.rule(dict(static), operand_types)

        fn = custom_partitioning(per_device, static_argnums=(0,))
        fn.def_partition(partition=partition, infer_sharding_from_operands=infer,
                         sharding_rule=rule)
        return fn

    # ----------------------------------------------------------------------- batching

    def batch_leading_axes(self, args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
        outs = self.prim.bind(*args, **params)
        return outs, self._results(outs, 0)

    def batch_reference(self, args, dims, *, implementation, **params):
        del implementation
        outs = jax.vmap(functools.partial(cast(Callable, self.spec.reference), **params),
                        in_axes=tuple(dims))(*args)
        return outs, self._results(outs, 0)

    # ---------------------------------------------------------------------------- JVP

    def jvp_zero(self, primals, tangents, **params):
        del tangents
        outs = self.prim.bind(*primals, **params)
        if self.spec.multiple_results:
            return outs, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]
        return outs, ad.Zero(jax.typeof(outs).to_tangent_aval())

    def jvp_reference(self, primals, tangents, *, implementation, **params):
        del implementation
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        reference = cast(Callable, self.spec.reference)
        return jax.jvp(functools.partial(reference, **params), tuple(primals), tuple(tangents))


# ------------------------------------------------------------------------ platform versions

VARIANT = "variant"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One platform's version of a `ByPlatform` computation: ``fn(*operands, **params)``,
    with the same results (shapes, types) as the reference, and what it does differently,
    in words."""
    fn: Callable
    what: str


@dataclasses.dataclass(frozen=True)
class ByPlatform:
    """A computation in XLA ops (no kernel, so XLA partitions it under any jit) with a
    version per platform.

    name: its name, also that of the jit it runs in (explain finds it by that name).
    reference(*operands, **params): the version of every platform not in `variants`, and
      of every platform under ``JAX_FP8_IMPLEMENTATION=jnp``.
    variants: {platform ("cuda", ...): Variant}.
    """
    name: str
    reference: Callable
    variants: Mapping[str, Variant] = dataclasses.field(default_factory=dict)


BY_PLATFORM: dict[str, ByPlatform] = {}


def decide_platform(choice: ByPlatform, platform: str | None,
                    implementation: str | None = None) -> tuple[str, str]:
    """Which version of `choice` runs on `platform` (None: one of no variant) with
    `implementation` (default `DEFAULT`), and why: (`VARIANT` or `REFERENCE`, the reason
    in words)."""
    if (implementation or DEFAULT) == "jnp":
        return REFERENCE, _jnp_reason()
    variant = None if platform is None else choice.variants.get(platform)
    if variant is None:
        return REFERENCE, f"no {platform or 'such'} variant"
    return VARIANT, f"the {platform} variant: {variant.what}"


def device_platform(device) -> str:
    """The platform name lowering uses for `device`: "cuda" or "rocm" for a GPU, else
    its platform ("cpu", "tpu")."""
    if device.platform == "gpu":
        version = str(getattr(device.client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return device.platform


def _concrete_platform(x) -> str | None:
    """The platform of a concrete array's device (as code run with jit disabled has);
    None for a tracer or a non-array."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return None
    return device_platform(next(iter(x.devices())))


def by_platform(choice: ByPlatform) -> Callable:
    """`choice` as a function ``run(*operands, **params)``: the version `decide_platform`
    picks for the platform it runs on. `params` are static (hashable); operands may be
    pytrees of arrays.

    Traced operands (in a jit, or under vmap or grad) go through one jit named
    ``choice.name`` whose version is picked where it is lowered (``lax.platform_dependent``):
    in a jit, for the platform that jit is lowered for (each of several, lowered for
    several); for operands outside a jit, their device's. Concrete operands (jit disabled,
    which would run that jit op by op on the default backend) take their device's version
    directly, decided by the first operand.

    Raises:
      ValueError: where a primitive or another ByPlatform has that name.
    """
    if choice.name in BY_PLATFORM or choice.name in SPECS:
        raise ValueError(f"{choice.name} is already registered")
    BY_PLATFORM[choice.name] = choice

    @functools.cache
    def staged(static):
        params = dict(static)
        reference = functools.partial(choice.reference, **params)
        variants = {p: functools.partial(v.fn, **params) for p, v in choice.variants.items()}

        def run(*operands):
            if DEFAULT == "jnp":
                return reference(*operands)
            return lax.platform_dependent(*operands, default=reference, **variants)

        run.__name__ = run.__qualname__ = choice.name
        return jax.jit(run)

    def call(*operands, **params):
        platform = _concrete_platform(operands[0])
        if platform is None:
            return staged(_static(params))(*operands)
        how, _ = decide_platform(choice, platform)
        fn = choice.variants[platform].fn if how == VARIANT else choice.reference
        return fn(*operands, **params)

    return call
