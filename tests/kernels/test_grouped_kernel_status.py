"""On a GPU with the CUDA module built with CUTLASS, each grouped kernel can run: the
grouped FP8 GEMM's, the grouped FP8 weight gradient's and the bf16 ragged dot's
kernel_status() is (True, ...), else the test fails with the reason it gives."""

import pytest

from jax_fp8._primitives import grouped_gemm as gg, grouped_wgrad as gw, ragged_dot as rd


@pytest.mark.gpu
@pytest.mark.parametrize("module", [gg, gw, rd], ids=["grouped_gemm", "grouped_wgrad",
                                                      "ragged_dot"])
def test_gpu_kernel_status(module):
    ok, why = module.kernel_status()
    assert ok, why
