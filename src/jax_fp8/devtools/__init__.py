"""Checks of programs, compiled programs and profiler traces: ``explain``, ``hlo``, ``compilation``,
``trace``.

For verifying what a jitted program really runs, e.g. that a train step updates its
FP8 state in ONE custom call, that its GEMMs are FP8, which collectives it issues, and
where its GPU time goes::

    from jax_fp8.devtools import hlo, trace

    compiled = jax.jit(train_step, donate_argnums=0).lower(state, batch).compile()
    assert hlo.count_custom_calls(compiled, "jax_fp8_update") == 1
    print(hlo.fp8_gemms(compiled))          # {'__cublas$lt$matmul$f8': 72}
    print(hlo.collectives(compiled))        # [Collective('all-reduce', ...), ...]

    state, events = trace.capture(lambda s: compiled(s, batch)[0], state, steps=5)
    kernels = trace.device_events(events)
    print(trace.total_us(kernels) / 5)      # device time per step, µs
    print(trace.by_family(kernels, hlo.op_families(compiled)))

``explain`` lists, for a function and its arguments, the lowering each jax_fp8 primitive
got (kernel, partitioned or reference) and which GEMMs are FP8, each with its reason::

    from jax_fp8.devtools import explain
    print(explain.table(explain.explain(train_step, state, batch)))

``compilation`` reads what a compile reports besides its text (memory, aliased bytes)
and the program right after XLA's SPMD partitioner. The modules are plain functions (no
benchmark logic); hlo and trace work on any backend (on CPU the trace's "kernels" are
XLA's op events).
"""

from jax_fp8.devtools import compilation, explain, hlo, trace

__all__ = ["compilation", "explain", "hlo", "trace"]
