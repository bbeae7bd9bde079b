"""Fp8Rule's default, min_fp8_flops="measured" (jax_fp8.fp8_pays): the committed H100 table,
its interpolation, the decisions it gives the GEMMs of real models, the rule where no table
exists, and the decisions a converted model reports (explain, Fp8ConversionWarning)."""

import json
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8
from jax_fp8 import fp8_pays
from jax_fp8.devtools.explain import explain
from jax_fp8.flax import fp8_model
from jax_fp8.gemm.dot_general import MEASURED_REASON

DELAYED, BLOCK = jax_fp8.DelayedScaling(), jax_fp8.Float8BlockScaling()


def test_table_is_complete_and_says_how_it_was_made():
    table = fp8_pays.table_for("sm_90")
    for key in ("device", "arch", "date", "commit", "command", "what", "m", "k", "n"):
        assert table[key], key
    assert set(table["speedup"]) == {"DelayedScaling", "Float8CurrentScaling",
                                     "Float8BlockScaling"}
    for values in table["speedup"].values():
        assert np.asarray(values).shape == (len(table["m"]), len(table["k"]), len(table["n"]))
        assert np.all(np.asarray(values) > 0)
    assert fp8_pays.table_for("sm_80") is None


def test_interpolation_gives_the_grid_and_clamps_past_it():
    table = fp8_pays.table_for("sm_90")
    values = np.asarray(table["speedup"]["DelayedScaling"])
    for i, m in enumerate(table["m"]):
        for j, k in enumerate(table["k"]):
            for q, n in enumerate(table["n"]):
                assert fp8_pays.speedup(table, DELAYED, m, k, n) == pytest.approx(values[i, j, q])
    # between two grid points: between their values; past the largest sizes: the largest's
    m, k = table["m"][-1], table["k"][-1]
    lo, hi = values[-1, -1, -2], values[-1, -1, -1]
    mid = fp8_pays.speedup(table, DELAYED, m, k, int(np.sqrt(table["n"][-2] * table["n"][-1])))
    assert min(lo, hi) <= mid <= max(lo, hi)
    assert fp8_pays.speedup(table, DELAYED, 4 * m, 4 * k, 4 * table["n"][-1]) == \
        pytest.approx(hi)
    # below the grid nothing was measured
    assert fp8_pays.speedup(table, DELAYED, table["m"][0] // 2, k, k) is None
    assert fp8_pays.speedup(table, jax_fp8.MXFP8BlockScaling(), m, k, k) is None


# (M, K, N) of real models' GEMMs at 8192 tokens, and whether delayed scaling converts them on
# an H100 by the committed table (FP8 is slower for narrow outputs and small inputs).
GEMMS = {
    "gemma3_1b kv projection (1152 -> 256)": ((8192, 1152, 256), False),
    "gemma3_1b q projection (1152 -> 1024)": ((8192, 1152, 1024), False),
    "gemma3_1b mlp up (1152 -> 6912)": ((8192, 1152, 6912), True),
    "gemma3_1b lm head (1152 -> 262144)": ((8192, 1152, 262144), True),
    "llama 8b qkv (4096 -> 6144)": ((8192, 4096, 6144), True),
    "llama 8b mlp down (14336 -> 4096)": ((8192, 14336, 4096), True),
    "few tokens (512 rows)": ((512, 4096, 4096), False),
}


@pytest.mark.parametrize("name", sorted(GEMMS))
def test_decisions_on_sm90(name):
    (m, k, n), converts = GEMMS[name]
    ok, why = fp8_pays.decide_on("sm_90", DELAYED, m, k, n)
    assert ok is converts, why
    assert "H100" in why and str(m) in why


def test_mxfp8_never_converts_on_hopper_and_conservative_rule_elsewhere():
    ok, why = fp8_pays.decide_on("sm_90", jax_fp8.MXFP8BlockScaling(), 8192, 4096, 4096)
    assert not ok and "not faster" in why
    ok, why = fp8_pays.decide_on("sm_100", DELAYED, 8192, 4096, 4096)
    assert ok and "no measured table for sm_100" in why and "holds" in why
    ok, _ = fp8_pays.decide_on("sm_100", DELAYED, 8192, 4096, 256)
    assert not ok


def test_cpu_converts_every_gemm():
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's decision")
    ok, why = fp8_pays.decide(DELAYED, 16, 8, 8)
    assert ok and "CPU" in why


def test_deciding_for_checks_its_argument():
    with pytest.raises(ValueError, match="sm_90"):
        with fp8_pays.deciding_for("hopper"):
            pass


def test_rule_default_and_spellings():
    assert jax_fp8.Fp8Rule().min_fp8_flops == "measured"
    assert jax_fp8.Fp8Rule(min_fp8_flops=0).min_fp8_flops == 0.0
    assert jax_fp8.Fp8Rule(min_fp8_flops="auto").min_fp8_flops == DELAYED.auto_min_fp8_flops
    with pytest.raises(ValueError, match="'measured' or 'auto'"):
        jax_fp8.Fp8Rule(min_fp8_flops="fast")


class _Block(nn.Module):
    """A transformer-like block: a wide MLP (FP8 pays on an H100 at 8192 tokens) and a
    narrow projection (it does not)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(6912, use_bias=False, name="up")(x)
        return nn.Dense(256, use_bias=False, name="narrow")(h[..., :1152])


def test_converted_model_reports_each_decision_once():
    """Decided as on an H100: explain names each GEMM's lowering and why, and one
    Fp8ConversionWarning names the kept module; Fp8Rule(min_fp8_flops=0) converts both."""
    model = _Block()
    x = jax.ShapeDtypeStruct((8192, 1152), jnp.bfloat16)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    with fp8_pays.deciding_for("sm_90"):
        converted = fp8_model(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fp8_vars = jax.eval_shape(converted.init, jax.random.key(0), x)
            rows = explain(lambda v, x: converted.apply(v, x), fp8_vars, x)
    gemms = [r for r in rows if r.kind == "gemm"]
    (up,) = [r for r in gemms if "/up/" in r.where]
    (narrow,) = [r for r in gemms if "/narrow/" in r.where]
    assert up.lowering == "fp8", up
    # kept in its operands' dtype: float32 parameters promote the bf16 input
    assert narrow.lowering == "float32" and narrow.why == MEASURED_REASON, narrow
    texts = [str(w.message) for w in caught if issubclass(w.category,
                                                          jax_fp8.Fp8ConversionWarning)]
    assert len(texts) == 1 and "'narrow'" in texts[0] and "0.50x" in texts[0], texts
    assert "min_fp8_flops=0" in texts[0]
    del variables
    with fp8_pays.deciding_for("sm_90"):
        everything = fp8_model(model, jax_fp8.Fp8Rule(min_fp8_flops=0))
        fp8_vars = jax.eval_shape(everything.init, jax.random.key(0), x)
        rows = explain(lambda v, x: everything.apply(v, x), fp8_vars, x)
    assert {r.lowering for r in rows if r.kind == "gemm"} == {"fp8"}


def test_table_file_is_json_the_docs_can_cite():
    text = (fp8_pays.importlib.resources.files("jax_fp8") / "tables" /
            "gemm_speedup_sm90.json").read_text()
    assert json.loads(text)["arch"] == "sm_90"
