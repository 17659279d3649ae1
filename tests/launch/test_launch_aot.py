"""`scripts/tpu/aot_compile.py` compiles the tiny model's programs for a real TPU slice (v5e:2x2)
on this CPU machine with the TPU compiler from libtpu: memory analysis per chip, the Pallas
kernels in the compiled programs, the config switch that takes them out, the fit check and the
layer extrapolation of XLA's cost analysis. Skipped only when libtpu is not installed."""
import json

import pytest

pytest.importorskip("libtpu")

# the quickstart's tiny model with TPU-shaped heads (the Pallas kernels want head_dim % 128 == 0)
TINY = ("--config.model.init.head_dim=128", "--config.model.init.num_attention_heads=2",
        "--config.model.init.num_key_value_heads=2", "--config.model.dtype=bfloat16")
CONFIG = "configs/quickstart.py:tiny"


@pytest.fixture(scope="module")
def aot():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "tpu" / "aot_compile.py"
    spec = importlib.util.spec_from_file_location("aot_compile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ppo(aot):
    """One compile of the tiny PPO run's (GAE: a critic) update, critic update, decode step and
    weight sync for v5e:2x2, shared by the tests below."""
    gae = TINY + ("--config.algorithm.adv_estimator=gae",)
    return aot.run_aot("v5e:2x2", CONFIG, gae, programs=("actor_update", "critic_update", "generate", "weight_sync"),
                       cost=False)


def test_tiny_update_and_decode_compile_for_v5e_with_the_pallas_kernels(ppo):
    out = ppo
    assert out["chips"] == 4 and out["chip"]["name"] == "v5e" and out["device_kind"] == "TPU v5 lite"
    assert out["mesh"] == {"data": 1, "fsdp": 4, "context": 1, "tensor": 1} and out["fits"]
    update, generate = out["programs"]["actor_update"], out["programs"]["generate"]
    residents = out["resident_bytes"]
    for p in (update, generate):
        assert p["argument_bytes"] > 0 and p["code_bytes"] > 0
        assert p["peak_bytes"] == p["program_bytes"] + p["other_resident_bytes"] <= p["hbm_bytes"] == 16 << 30
    # the train state is donated (aliased into the output) and is the update's argument
    assert update["alias_bytes"] > 0
    assert update["argument_bytes"] > residents["actor_params"] + residents["actor_opt"] > 0
    # beside the update, the engine's KV cache and weights and the critic stay resident (colocated)
    assert update["other_resident_bytes"] == (residents["decode_state"] + residents["engine_params"]
                                              + residents["critic_params"] + residents["critic_opt"])
    assert residents["decode_state"] > 0
    assert {"splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
            "splash_mha_dkv_segmented_no_residuals"} <= set(update["pallas_kernels"])
    assert generate["pallas_kernels"] == ["jaxrl_decode_attention"]


def test_critic_update_and_weight_sync_compile_for_v5e(ppo):
    """The critic update (its state resident beside the actor's) and the trainer -> rollout weight
    sync (fp32 training weights cast into the engine's bf16 copy)."""
    residents = ppo["resident_bytes"]
    critic, sync = ppo["programs"]["critic_update"], ppo["programs"]["weight_sync"]
    assert residents["critic_params"] > 0 and residents["critic_opt"] > residents["critic_params"]
    assert critic["alias_bytes"] > 0 and critic["argument_bytes"] > residents["critic_params"] + residents["critic_opt"]
    assert critic["other_resident_bytes"] == sum(v for k, v in residents.items() if not k.startswith("critic"))
    assert {"splash_mha_fwd_segmented_residuals", "splash_mha_dkv_segmented_no_residuals"} <= set(
        critic["pallas_kernels"])
    assert not ppo["engine"]["zero_copy_sync"] and sync["output_bytes"] >= residents["engine_params"]
    assert sync["peak_bytes"] == sync["program_bytes"] + sync["other_resident_bytes"] <= sync["hbm_bytes"]
    # the engine's sleep frees its decode state and its own weight copy beside each training program
    sleep, freed = ppo["sleep"], residents["decode_state"] + residents["engine_params"]
    assert set(sleep["programs"]) == {"actor_update", "critic_update"}
    for name, e in sleep["programs"].items():
        assert e["saved_bytes"] == freed and e["peak_asleep_bytes"] == ppo["programs"][name]["peak_bytes"] - freed
    assert sleep["kv_cache_bytes"] == ppo["engine"]["kv_cache_bytes_global"] // ppo["chips"]
    assert sleep["kv_cache_bytes"] <= residents["decode_state"]


def test_the_config_switch_takes_the_kernels_out(aot):
    xla = TINY + ("--config.model.train_attention=xla", "--config.model.decode_attention=einsum")
    out = aot.run_aot("v5e:2x2", CONFIG, xla, programs=("generate", "prefill"), cost=False)
    assert out["programs"]["generate"]["pallas_kernels"] == []
    assert out["programs"]["prefill"]["pallas_kernels"] == []


def test_a_batch_invariant_run_compiles_the_engine_it_would_build(aot):
    """rollout.batch_invariant reaches the compiled engine: its prefill runs the fixed 4-row call."""
    out = aot.run_aot("v5e:2x2", CONFIG, TINY + ("--config.rollout.batch_invariant=True",),
                      programs=("prefill",), cost=False)
    assert out["engine"]["batch_invariant"] is True and out["engine"]["prefill_rows"] == 4
    assert out["programs"]["prefill"]["argument_bytes"] > 0


def test_a_program_over_the_hbm_fails_the_check(aot, tmp_path):
    report = tmp_path / "aot.json"
    args = ["--topology=v5e:2x2", f"--config={CONFIG}", *TINY, "--programs=generate", "--no-cost",
            "--hbm-gib=0.0001", "--check", f"--out={report}"]
    assert aot.main(args) == 1
    gen = json.loads(report.read_text())["programs"]["generate"]
    assert not gen["fits"] and gen["over_by_bytes"] == gen["peak_bytes"] - int(0.0001 * (1 << 30))


def test_extend_adds_the_programs_a_saved_report_lacks(aot, tmp_path):
    """A report compiled with `--programs=generate` gets `insert` later from its own command line
    (and its what-if HBM); a program it has, or a report its command line no longer rebuilds, is
    refused before anything is written."""
    report = tmp_path / "aot.json"
    args = ["--topology=v5e:2x2", f"--config={CONFIG}", *TINY, "--programs=generate", "--no-cost",
            "--hbm-gib=0.0001", f"--out={report}"]
    assert aot.main(args) == 0
    saved = json.loads(report.read_text())
    assert aot.main([f"--extend={report}", "--programs=insert", "--no-cost"]) == 0
    out = json.loads(report.read_text())
    assert list(out["programs"]) == ["insert", "generate"]  # the script's order
    assert out["programs"]["generate"] == saved["programs"]["generate"]
    insert, residents = out["programs"]["insert"], out["resident_bytes"]
    assert residents == saved["resident_bytes"] and insert["hbm_bytes"] == int(0.0001 * (1 << 30))
    assert insert["other_resident_bytes"] == sum(v for k, v in residents.items() if k != "decode_state")
    assert insert["argument_bytes"] >= residents["decode_state"] > 0
    assert not out["fits"] and out["peak_bytes"] == max(insert["peak_bytes"], saved["peak_bytes"])
    assert out["extended"] == [{"programs": ["insert"], "cost": False, "wall_s": out["extended"][0]["wall_s"]}]
    with pytest.raises(ValueError, match=r"already has \['generate'\]"):
        aot.extend_report(json.loads(report.read_text()), ("generate", "prefill"), cost=False)
    stale = dict(saved, mesh={"data": 4, "fsdp": 1, "tensor": 1})
    with pytest.raises(ValueError, match="the report's mesh .* is not what its command line builds"):
        aot.extend_report(stale, ("insert",), cost=False)
    with pytest.raises(SystemExit):
        aot.main([f"--extend={report}", "--programs=prefill", "--topology=v5e:2x2"])
    assert json.loads(report.read_text()) == out


def test_add_cost_extrapolates_a_saved_report_to_what_three_unrolled_layers_cost(aot, monkeypatch, tmp_path):
    """XLA counts a loop body once; `--add-cost` measures a saved `--no-cost` report's programs on
    1- and 2-layer copies and extrapolates: that must give what the report's own program costs when
    its 3 layers are unrolled (and one micro-batch is the whole batch, so nothing is looped)."""
    model_config = aot.model_config
    monkeypatch.setattr(aot, "model_config", lambda run, preset: model_config(run, preset).replace(layer_unroll=0))
    args = TINY + ("--config.model.init.num_hidden_layers=3", "--config.actor.ppo_micro_batch_size_per_device=256")
    report = aot.run_aot("v5e:2x2", CONFIG, args, programs=("log_prob",), cost=False)
    saved = dict(report["programs"]["log_prob"])
    assert "flops" not in saved and "step_roofline" not in report
    path = tmp_path / "aot.json"
    path.write_text(json.dumps(report))
    assert aot.main([f"--add-cost={path}"]) == 0
    added = json.loads(path.read_text())
    log_prob = added["programs"]["log_prob"]
    assert {k: log_prob[k] for k in saved} == saved  # the compiled program's figures are kept
    assert log_prob["flops"] == pytest.approx(saved["compiled_flops"], rel=0.01)  # fusion choices differ a little
    assert log_prob["bytes_accessed"] == pytest.approx(saved["compiled_bytes_accessed"], rel=0.05)
    v5e = aot.CHIPS["TPU v5 lite"]
    assert log_prob["roofline_s"] == max(log_prob["flops"] / v5e.bf16_flops,
                                         log_prob["bytes_accessed"] / v5e.hbm_bandwidth)
    assert added["step_roofline"]["parts_s"] == {"log_probs": log_prob["roofline_s"]}  # no reference model
    # --table now prints the step-time row: no prefill or decode compiled, the log-probs
    steps = aot.markdown_tables([added]).split("\n\n")[1]
    assert f"| config | v5e-4 | - | - | {log_prob['roofline_s']:.2f} | - | - |" in steps


def test_a_program_the_compiler_refuses_for_lack_of_hbm_is_reported_with_the_excess(aot):
    """The TPU compiler refuses a program that cannot fit (its message, as libtpu 0.0.42.1 words it
    for Qwen2.5-1.5B's update at 16 sequences per chip on v5e); the report keeps the message and
    the excess plus the other residents."""
    error = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
                         "HLO temporaries (19.54G) exceeds available HBM (15.75G).")
    entry = aot._out_of_memory(error, 1 << 30, aot.CHIPS["TPU v5 lite"])
    gib = 1 << 30
    assert not entry["fits"] and entry["compile_error"].startswith("RESOURCE_EXHAUSTED")
    assert entry["over_by_bytes"] == int(19.54 * gib - 15.75 * gib + gib)
    assert entry["peak_bytes"] == int(19.54 * gib + gib)



def test_the_qwen3_30b_a3b_preset_is_its_hugging_face_config_with_the_experts_on_fsdp(aot):
    """`--model=qwen3-30b-a3b`: Qwen3-30B-A3B's config.json (every layer sparse, 128 experts, top-8)
    with the run's dtypes and remat, 30.5B parameters; on a v5e:2x2 fsdp=4 mesh the training
    shardings split each expert weight's `expert` dim over fsdp (32 whole experts per chip)."""
    import math

    import jax
    from flax import nnx

    from jaxrl_llm import config as C

    run = C.load_config("configs/grpo_gsm8k.py", [])
    cfg = aot.model_config(run, "qwen3-30b-a3b")
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("qwen3_moe", 48, 2048, 151936)
    moe = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob)
    assert moe == (128, 8, 768, True)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.qk_norm) == (32, 4, 128, True)
    assert (cfg.intermediate_size, cfg.rms_norm_eps) == (6144, 1e-6)
    assert (cfg.tie_word_embeddings, cfg.rope_theta, cfg.max_position_embeddings) == (False, 1e6, 40960)
    assert cfg.remat == run.model.remat == "full"
    mesh = aot.sharding.make_mesh((1, 4, 1), devices=aot.topology_devices("v5e:2x2"))
    _, params = aot.abstract_params(cfg, mesh)
    params = nnx.to_pure_dict(params)
    assert round(sum(math.prod(x.shape) for x in jax.tree.leaves(params)) / 1e9, 1) == 30.5
    for proj in ("gate_proj", "up_proj", "down_proj"):
        kernel = params["model"]["layers"]["mlp"]["experts"][proj]["kernel"]
        assert kernel.shape[:2] == (48, 128) and kernel.sharding.spec[1] == "fsdp"
    with pytest.raises(ValueError, match="qwen3-30b-a3b"):
        aot.model_config(run, "qwen3-31b")


def test_a_tiny_moe_compiles_for_v5e_with_router_replay(aot):
    """The MoE path of the update, the decode step and the weight sync (quickstart's `moe`
    variant: 4 experts, top-2, one per chip on fsdp=4), the update with router replay (its
    micro-batches carry the engine's experts per token): the grouped matmuls compile to the TPU's
    ragged-dot kernels."""
    out = aot.run_aot("v5e:2x2", CONFIG + ",moe", TINY + ("--config.actor.router_replay.mode=replay",),
                      programs=("actor_update", "generate", "weight_sync"), cost=False)
    assert out["model_config"]["num_experts"] == 4 and out["mesh"]["fsdp"] == 4 and out["fits"]
    for name in ("actor_update", "generate"):
        assert {"ragged-dot-metadata", "ragged-dot-none"} <= set(out["programs"][name]["pallas_kernels"])
    assert out["programs"]["weight_sync"]["output_bytes"] >= out["resident_bytes"]["engine_params"] > 0
