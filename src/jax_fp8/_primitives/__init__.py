"""The JAX primitives of jax_fp8 and their lowerings to the FFI kernels in ``ffi/``.

``base``: the frame each primitive is declared in (registration, eager impl, batching,
JVP, partitioning, shard_map's varying axes, Explicit meshes), re-exporting its parts:
``spec`` (the declaration), ``decision`` (the one choice of lowering per platform, which
``jax_fp8.devtools.explain`` reports) and ``platforms`` (computations in XLA ops with a
version per platform, ``ByPlatform``); ``kernel_types`` declares the element types the
kernels read and write.
The primitives, each with its partitioning rule: ``update`` (the fused scaling update,
partitioned per device along its states' leading axes), ``amax`` (a tensor's amax with
one all-reduce per step under sharding), ``layout`` (FP8 byte transposes and the
gradient's quantize + transpose), ``split`` (a packed state's scale vectors cut into one
buffer per state), ``block_quantize`` / ``block_gemm`` (block scaling), ``quotient``
(correctly rounded float32 division through float64). Below them: ``exact`` (the
bit-exact float32 arithmetic of current and block scaling), ``jnp_update`` (the update in
jax.numpy), ``axis_types`` (the Manual axes an array varies over inside shard_map, and
Explicit meshes) and ``partition_specs`` (PartitionSpecs as the partitioning rules read
them).
"""
