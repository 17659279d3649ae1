"""An fp8 KV cache (`rollout.kv_cache_dtype="fp8"`): the saturating cast, the engine's decode
state in e4m3 at half the bytes, its greedy tokens and log-prob mismatch against a bf16-cache
engine on the tiny HF fixtures (both layer layouts), the Triton decode kernel reading fp8 keys
and values (Pallas interpret mode), which decode kernel `auto` picks, and the config field."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rollout
from conftest import trainer_log_probs
from jaxrl_llm import algos
from jaxrl_llm.models import _decoder, _kernels, from_pretrained, kv_cache_dtype, to_cache

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models")
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def test_to_cache_saturates_fp8_and_leaves_other_dtypes_alone():
    x = jnp.asarray([0.0, 1.0, -3.3, 447.0, 600.0, -1e5, 1e-3], jnp.bfloat16)
    y = to_cache(x, FP8)
    assert y.dtype == FP8
    back = np.asarray(y, np.float32)
    assert np.all(np.isfinite(back))  # a plain cast turns 600 into NaN (e4m3fn has no infinity)
    assert back[4] == 448.0 and back[5] == -448.0
    np.testing.assert_allclose(back[:4], [0.0, 1.0, -3.25, 448.0], rtol=0.07)
    assert np.isnan(np.asarray(x.astype(FP8), np.float32)[4])  # why the clip is there
    np.testing.assert_array_equal(np.asarray(to_cache(x, jnp.bfloat16)), np.asarray(x))
    assert kv_cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16 and kv_cache_dtype("fp8", jnp.float32) == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        kv_cache_dtype("int4", jnp.bfloat16)


@pytest.mark.parametrize("plan", [None, {"splits": 3, "block": 16}], ids=["one_split", "three_splits"])
def test_triton_decode_kernel_reads_an_fp8_cache(plan):
    """The Triton decode kernel on e4m3 keys/values (interpret mode) equals the one-query
    attention over the same values upcast to bf16, and returns q's dtype."""
    rng = np.random.default_rng(5)
    b, h, kvh, d, s = 3, 6, 2, 16, 48
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.bfloat16)
    k = to_cache(jnp.asarray(rng.normal(size=(b, s, kvh, d)) * 4, jnp.float32), FP8)
    v = to_cache(jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32), FP8)
    lengths = jnp.asarray([17, 1, s], jnp.int32)
    got = jax.jit(lambda *a: _kernels.triton_decode_attention(*a, plan=plan))(q, k, v, lengths)
    assert got.dtype == jnp.bfloat16
    want = _decoder.attend_one(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), lengths)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=0)


def test_auto_decode_attention_with_an_fp8_cache(monkeypatch):
    """GPU: the Triton kernel takes an fp8 cache (cuDNN does not: it would be einsum); TPU: the
    Pallas decode kernel does not, so the XLA path runs."""
    from jaxrl_llm.models import ModelConfig

    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1)
    monkeypatch.setattr(_kernels, "target_platform", lambda: "gpu")
    assert _decoder._decode_attention_impl(config, 1, FP8, 128, 768) == "triton"
    assert _decoder._decode_attention_impl(config, 1, FP8, 80, 768) == "einsum"
    monkeypatch.setattr(_kernels, "target_platform", lambda: "tpu")
    assert _decoder._decode_attention_impl(config, 1, jnp.bfloat16, 128, 768) == "pallas"
    assert _decoder._decode_attention_impl(config, 1, FP8, 128, 768) == "einsum"


# Measured on the four tiny HF fixtures (8 prompts x 16 greedy tokens, bf16 weights; free-running
# greedy agreement, position by position, with a bf16-cache engine of the same layout):
#   per_layer: qwen2 0.91, llama3 0.63, qwen3 0.88, qwen2_tied 1.0;  stacked: qwen2 0.66, llama3 0.60
# (random tiny models have next-token margins of 0.02-0.2 logits, so one flip changes the rest of
# a row). k3 KL against the fp32 trainer on qwen2 / llama3: bf16 cache 2.8e-5-3.9e-5, fp8 cache
# 2.3e-4-2.9e-4 (fp8 weights: 1.3e-3-1.7e-3, test_rollout_quant.py). The floors keep a margin.
@pytest.mark.parametrize("family", ["qwen2", "llama3"])
@pytest.mark.parametrize("layout", ["per_layer", "stacked"])
def test_fp8_kv_cache_engine_halves_the_cache_and_stays_close_to_bf16(family, layout):
    path = os.path.join(FIXTURES, family)
    trainer = from_pretrained(path)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 96, size=int(s))] for s in rng.integers(3, 12, size=8)]
    kw = dict(n=1, max_new_tokens=16, sampling=rollout.SamplingParams(temperature=0.0), seed=0)
    out = {}
    for kv in ("auto", "fp8"):
        engine = rollout.Engine.from_pretrained(path, max_concurrent_decodes=8, max_prefill_length=16,
                                                max_target_length=32, dtype="bfloat16", temperature=0.0,
                                                layer_layout=layout, kv_cache_dtype=kv)
        state = engine.init_decode_state()
        assert {x.dtype for x in jax.tree.leaves(state.cache)} == {FP8 if kv == "fp8" else jnp.dtype(jnp.bfloat16)}
        batch = rollout.RolloutDriver(engine, steps_per_sync=16).generate(prompts, **kw)
        old = np.stack([trainer_log_probs(trainer, p, r, 0.0) for p, r in zip(prompts, batch.responses)])
        metrics = algos.rollout_offpolicy_metrics(jnp.asarray(old), jnp.asarray(batch.rollout_log_probs),
                                                  jnp.ones(old.shape, jnp.float32))
        assert all(np.isfinite(float(v)) for v in metrics.values())
        out[kv] = (batch.responses, float(metrics["k3_kl"]), engine.kv_cache_bytes())
    assert out["fp8"][2] * 2 == out["auto"][2]
    free = float(np.mean(out["fp8"][0] == out["auto"][0]))
    print(f"{family} {layout}: fp8 KV greedy agreement {free:.3f}, k3_kl bf16 {out['auto'][1]:.2e} fp8 {out['fp8'][1]:.2e}")
    assert free >= 0.5
    assert out["auto"][1] < out["fp8"][1] < 0.01  # fp8 moved the log-probs (it is in use), a little


def test_bench_rollout_times_an_fp8_kv_cache_against_the_default_in_one_run(capsys, load_script):
    """scripts/bench_rollout.py --tiny --kv-cache-dtype auto fp8 (CPU): one record per cache
    dtype; the fp8 one counts its real cache bytes (the tiny model is fp32: 4 -> 1 byte) and
    gets its ratio to the default."""
    records = load_script("bench_rollout").main(["--tiny", "--kv-cache-dtype", "auto", "fp8"])
    capsys.readouterr()
    by = {r["kv_cache_dtype"]: r for r in records}
    assert sorted(by) == ["auto", "fp8"] and all("error" not in r for r in records)
    fp8, auto = by["fp8"], by["auto"]
    assert fp8["generated_tokens"] == 4 * 8 and fp8["ms_per_step"] > 0
    assert fp8["kv_cache_bytes"] * 4 == auto["kv_cache_bytes"]
    assert fp8["kv_read_bytes"] * 4 == auto["kv_read_bytes"] and fp8["weight_bytes"] == auto["weight_bytes"]
    assert fp8["vs_unquantized"]["decode_only"] == pytest.approx(auto["ms_per_step"] / fp8["ms_per_step"])
    assert "vs_unquantized" not in auto


def test_server_sessions_reuse_a_parked_fp8_cache(tiny_model, prompts):
    """A multi-turn session on an fp8-cache engine: turn 2 extends the parked e4m3 KV (the
    multi-token append reads it upcast) and computes only its new tokens; its log-probs stay
    finite and within fp8's rounding of a server that prefills every turn in full."""
    engine = rollout.Engine.from_model(tiny_model, max_concurrent_decodes=4, max_prefill_length=16,
                                       max_target_length=32, dtype="bfloat16", temperature=0.0,
                                       kv_cache_dtype="fp8")
    kw = dict(sampling=rollout.SamplingParams(0.0), max_new_tokens=5, session_id="chat")
    outs = {}
    for reuse in (True, False):
        with rollout.RolloutServer(engine, steps_per_sync=4, reuse_prefix=reuse) as srv:
            one = srv.generate("t1", prompts[1], **kw)
            turn2 = prompts[1] + one.token_ids + [11, 12, 13]
            two = srv.generate("t2", turn2, **kw)
            outs[reuse] = (one, two, turn2)
    one, two, turn2 = outs[True]
    assert two.num_cached_tokens == len(prompts[1]) + len(one.token_ids) - 1
    assert np.all(np.isfinite(two.log_probs)) and len(two.token_ids) >= 1
    ref = outs[False][1]
    assert outs[False][2] == turn2 and ref.num_cached_tokens == 0
    n = next((i for i, (a, b) in enumerate(zip(two.token_ids, ref.token_ids)) if a != b),
             min(len(two.token_ids), len(ref.token_ids)))
    assert n >= 1  # the first token of turn 2 agrees
    # measured: all 5 tokens equal, max |log-prob difference| 6.9e-4 (the extend reads the
    # prompt's KV in e4m3 where a full prefill attends to it in bf16)
    np.testing.assert_allclose(two.log_probs[:n], ref.log_probs[:n], atol=1e-2)


def test_fp8_kv_cache_decode_compiles_for_a_tpu_slice():
    """v5e:2x2 (libtpu's compiler on this machine, `scripts/tpu/aot_compile.py`): the decode step
    with an e4m3 cache compiles on the XLA path (the Pallas decode kernel does not take fp8),
    with half the cache bytes. Skipped only when libtpu is not installed."""
    pytest.importorskip("libtpu")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "tpu" / "aot_compile.py"
    spec = importlib.util.spec_from_file_location("aot_compile", path)
    aot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot)
    tiny = ("--config.model.init.head_dim=128", "--config.model.init.num_attention_heads=2",
            "--config.model.init.num_key_value_heads=2", "--config.model.dtype=bfloat16")
    out = {kv: aot.run_aot("v5e:2x2", "configs/quickstart.py:tiny", tiny + (f"--config.rollout.kv_cache_dtype={kv}",),
                           programs=("generate",), cost=False) for kv in ("auto", "fp8")}
    assert out["fp8"]["engine"]["kv_cache_bytes_global"] * 2 == out["auto"]["engine"]["kv_cache_bytes_global"]
    assert out["auto"]["programs"]["generate"]["pallas_kernels"] == ["jaxrl_decode_attention"]
    assert out["fp8"]["programs"]["generate"]["pallas_kernels"] == []
    assert out["fp8"]["programs"]["generate"]["argument_bytes"] < out["auto"]["programs"]["generate"]["argument_bytes"]
