"""The JAX primitives of jax_fp8 and their lowerings to the FFI kernels in ``ffi/``.

``update``: the fused scaling update (``jax_fp8_update``); ``amax``: a tensor's amax
with one all-reduce per step under sharding; ``layout``: FP8 byte transposes and the
gradient's quantize + transpose; ``partition``: sharded updates; ``split``: a packed
state's scale vectors cut into one buffer per state (``jax_fp8_split_rows``);
``block_quantize`` / ``block_gemm``: block scaling; ``quotient``: correctly rounded
float32 division through float64 (the exact scales of current and block scaling);
``jnp_update``: the same update in
jax.numpy; ``common``: shared helpers (eager execution, manual axes).
"""
