"""Router replay (R3, `actor.router_replay`) on the tiny Qwen3-MoE fixture, one CPU device, fp32:
the engine records every fed token's experts, the trainer batch carries them column for column,
and the actor's passes replay them (padded and packed rows)."""
import collections
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rollout
import sharding
from jaxrl_llm import models
from jaxrl_llm.config import ConfigError, RouterReplayConfig, load_config
from jaxrl_llm.data import RolloutResult
from jaxrl_llm.trainer._batch import rollout_batch
from jaxrl_llm.trainer._old_log_prob import router_replay_metrics
from jaxrl_llm.workers._roles import ActorWorker

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.py")
FIXTURE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "qwen3_moe"))
MIXED = FIXTURE + "_mixed"  # 4 layers: dense, sparse, dense, dense (decoder_sparse_step 2, mlp_only_layers [3])
REWARD_FN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "rewards", "length_parity.py")
L, K = 2, 2  # the fixture's layers and experts per token (4 experts, norm_topk_prob False)
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14], [20, 21, 22, 23]]
N, T, P = 2, 8, 12  # samples per prompt, new tokens, max_prompt_length (under 80 % real: packing packs)
Example = collections.namedtuple("Example", "prompt_ids index")


@pytest.fixture(scope="module")
def tiny():
    return load_config(f"{QUICKSTART}:tiny,local")


def _rolled(fixture, **engine_kw):
    """(the engine's RolloutBatch, the trainer Batch built from it) with experts recorded."""
    engine = rollout.Engine.from_model(models.from_pretrained(fixture), max_concurrent_decodes=4,
                                       max_prefill_length=16, max_target_length=32, record_experts=True,
                                       **engine_kw)
    out = rollout.RolloutDriver(engine, steps_per_sync=4).generate(PROMPTS, n=N, max_new_tokens=T, seed=0)
    gen = RolloutResult(responses=out.responses, response_mask=out.response_mask,
                        rollout_log_probs=out.rollout_log_probs, finish_reasons=tuple(out.finish_reasons),
                        response_lengths=out.response_lengths, prompt_index=out.prompt_index,
                        routed_experts=out.routed_experts)
    batch = rollout_batch([Example(p, i) for i, p in enumerate(PROMPTS)], gen, n=N, pad_token_id=0,
                          max_prompt_length=P)
    return out, batch


@pytest.fixture(scope="module")
def rolled():
    return _rolled(FIXTURE)


def _actor(tiny, mode, *, perturb=0.0, remove_padding=False, fixture=FIXTURE):
    cfg = dataclasses.replace(tiny.actor, ppo_micro_batch_size_per_device=3, use_dynamic_bsz=False,
                              router_replay=RouterReplayConfig(mode=mode),
                              optim=dataclasses.replace(tiny.actor.optim, lr=1e-3, warmup_steps=0))
    model = models.from_pretrained(fixture)
    if perturb:  # a small change to the trainer's router (its weights have std ~0.19): a few top-k choices flip
        gate = model.model.layers.mlp.gate
        noise = jax.random.normal(jax.random.key(3), gate["kernel"][...].shape)
        gate["kernel"][...] = gate["kernel"][...] + perturb * noise
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    return ActorWorker(model, cfg, mesh=mesh, total_steps=2, temperature=1.0, remove_padding=remove_padding)


def _abs_diff(log_probs, batch):
    return float((np.abs(log_probs - batch.rollout_log_probs) * batch.response_mask).max())


def test_replay_route_uses_the_given_experts_and_recomputes_gate_weights_with_gradient():
    logits = jax.random.normal(jax.random.key(0), (5, 4))
    weights, own = models.route(logits, 2, True)
    given = np.asarray(own).copy()
    given[1] = [3, 0] if set(given[1]) != {3, 0} else [1, 2]  # another choice
    given[4] = -1  # not recorded: its own top-k
    w, chosen = models.replay_route(logits, given, 2, True)
    want = np.where(given[:, :1] >= 0, given, np.asarray(own))
    np.testing.assert_array_equal(chosen, want)
    probs = np.asarray(jax.nn.softmax(logits, -1))
    picked = np.take_along_axis(probs, want, -1)
    np.testing.assert_allclose(w, picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(w)[[0, 2, 3, 4]], np.asarray(weights)[[0, 2, 3, 4]])
    grad = jax.grad(lambda x: models.replay_route(x, given, 2, False)[0][1, 0])(logits)
    assert np.abs(np.asarray(grad)).max() > 1e-3  # the router logits still get gradients


def test_engine_records_every_fed_token_and_nothing_else(rolled):
    out, batch = rolled
    ex = batch.routed_experts
    assert ex.shape == (len(PROMPTS) * N, P + T, L, K) and ex.dtype == np.int8
    for r in range(len(ex)):
        n_prompt, n_resp = len(PROMPTS[r // N]), int(out.response_lengths[r])
        fed = np.zeros(P + T, bool)
        fed[P - n_prompt:P + n_resp - 1] = True  # the prompt, the response but its last token
        assert (ex[r, fed] >= 0).all() and (ex[r, ~fed] == -1).all()
        assert (ex[r, fed] < 4).all()
        assert (np.sort(ex[r, fed], -1)[..., 0] != np.sort(ex[r, fed], -1)[..., 1]).all()  # k distinct ids


def test_replay_routes_like_the_engine_and_the_on_policy_ratio_is_one(tiny, rolled):
    _, batch = rolled
    actor = _actor(tiny, "replay")
    got = actor.compute_log_prob(batch)
    assert got["router_compared"].sum() > 0 and got["router_mismatched"].sum() == 0
    assert _abs_diff(got["old_log_probs"], batch) < 1e-4  # the engine's log-probs (fp32)
    metrics = router_replay_metrics(got, batch)
    assert metrics["rollout/router_replay/mismatch_frac"] == 0.0
    batch.old_log_probs = got["old_log_probs"]
    batch.advantages = np.where(batch.response_mask > 0, 1.0, 0.0).astype(np.float32)
    m = actor.update(batch, mini_rows=len(batch.responses), seed=0)
    assert m["actor/router_replay/mismatch_frac"] == 0.0
    assert abs(m["actor/ppo_kl"]) <= 1e-7 and m["actor/pg_clipfrac"] == 0.0  # ratio 1 (fp32)


def test_dense_and_sparse_layers_record_and_replay_the_sparse_layers_experts(tiny):
    """Qwen3-MoE with dense layers (only layer 1 of 4 sparse): the engine (stacked layout: the
    segment scans) records one layer's experts per token and the replaying actor routes like it,
    with the on-policy ratio 1."""
    out, batch = _rolled(MIXED, layer_layout="stacked")
    assert batch.routed_experts.shape == (len(PROMPTS) * N, P + T, 1, K)
    actor = _actor(tiny, "replay", fixture=MIXED)
    got = actor.compute_log_prob(batch)
    assert got["router_compared"].sum() > 0 and got["router_mismatched"].sum() == 0
    assert _abs_diff(got["old_log_probs"], batch) < 1e-4
    batch.old_log_probs = got["old_log_probs"]
    batch.advantages = np.where(batch.response_mask > 0, 1.0, 0.0).astype(np.float32)
    m = actor.update(batch, mini_rows=len(batch.responses), seed=0)
    assert m["actor/router_replay/mismatch_frac"] == 0.0
    assert abs(m["actor/ppo_kl"]) <= 1e-7 and m["actor/pg_clipfrac"] == 0.0
    assert {"moe/expert_load/min", "moe/expert_load/layer_1/cv"} <= set(m)  # named by the model's layer
    assert not any(k.startswith(("moe/expert_load/layer_0", "moe/expert_load/layer_2")) for k in m)


def test_perturbed_router_record_reports_mismatch_and_replay_restores_engine_log_probs(tiny, rolled):
    _, batch = rolled
    record = _actor(tiny, "record", perturb=0.005).compute_log_prob(batch)
    replay = _actor(tiny, "replay", perturb=0.005).compute_log_prob(batch)
    frac = router_replay_metrics(record, batch)["rollout/router_replay/mismatch_frac"]
    assert 0.0 < frac < 0.5
    without, with_ = _abs_diff(record["old_log_probs"], batch), _abs_diff(replay["old_log_probs"], batch)
    assert without > 0.1 and with_ < without / 10  # flipped experts: large; replayed: the gate weights only
    # the replaying pass also measures itself without replay: the record pass's numbers
    np.testing.assert_allclose(replay["log_probs_without_replay"], record["old_log_probs"], atol=1e-6)
    np.testing.assert_array_equal(replay["router_mismatched"] > 0, record["router_mismatched"] > 0)
    # packed rows (model.use_remove_padding) carry the experts with their tokens
    packed = _actor(tiny, "replay", perturb=0.005, remove_padding=True).compute_log_prob(batch)
    np.testing.assert_allclose(packed["old_log_probs"], replay["old_log_probs"], atol=1e-5)
    np.testing.assert_array_equal(packed["router_mismatched"], replay["router_mismatched"])
    np.testing.assert_array_equal(packed["router_compared"], replay["router_compared"])


def test_router_replay_on_a_dense_model_or_process_replicas_is_a_config_error(tiny):
    with pytest.raises(ConfigError, match="actor.router_replay.mode='replay' needs a mixture-of-experts"):
        load_config(f"{QUICKSTART}:tiny,local", ["actor.router_replay.mode=replay"])
    moe = ["actor.router_replay.mode=record", "model.init.model_type=qwen3_moe", "model.init.num_experts=4",
           "model.init.num_experts_per_tok=2", "model.init.moe_intermediate_size=32", "rollout.multi_turn.enable=True"]
    load_config(f"{QUICKSTART}:tiny,local", moe)  # the request-level server records
    with pytest.raises(ConfigError, match="replica_backend='process' replicas do not record"):
        load_config(f"{QUICKSTART}:tiny,local", moe + ["rollout.replica_backend=process"])
    with pytest.raises(ConfigError, match="is not one of"):
        load_config(f"{QUICKSTART}:tiny,local", ["actor.router_replay.mode=R2"])
    cfg = dataclasses.replace(tiny.actor, router_replay=RouterReplayConfig(mode="record"))
    dense = models.init_model(models.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 num_key_value_heads=1, head_dim=16))
    with pytest.raises(ConfigError, match="has no router"):
        ActorWorker(dense, cfg, mesh=sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1]), total_steps=1,
                    temperature=1.0)


def test_one_rl_step_carries_the_experts_from_the_engine_to_the_replaying_update(tmp_path):
    """The whole host path (HostWorker's engine records, RolloutResult -> Batch, the pass and the
    update replay), fp32: the engine's routing is matched on every recorded token."""
    from jaxrl_llm.trainer import RLTrainer
    from jaxrl_llm.workers import HostWorker

    # the fixture's 4 experts split over fsdp=4 (expert parallelism), the other 2 devices on data
    o = {"model.path": FIXTURE, "model.tokenizer": "char", "model.dtype": "float32",
         "mesh.data": 2, "mesh.fsdp": 4, "actor.router_replay.mode": "replay", "actor.skip_redundant_old_log_prob": False,
         "trainer.default_local_dir": tmp_path / "run", "trainer.progress_bar": False, "trainer.plot": False,
         "trainer.logger": "jsonl", "trainer.async_save": False, "trainer.val_before_train": False,
         "reward.custom_reward_function.path": REWARD_FN, "reward.custom_reward_function.name": "compute_score"}
    run = load_config(f"{QUICKSTART}:tiny,local", [f"{k}={v}" for k, v in o.items()])
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, run.trainer.total_training_steps)
        m = trainer.train_step()
    finally:
        trainer.close()
    assert m["rollout/router_replay/mismatch_frac"] == 0.0
    assert m["rollout/logprob_abs_diff/max"] < 1e-4
    assert m["rollout/router_replay/logprob_abs_diff_without_replay/max"] < 1e-4  # fp32: no flips here
    assert 0.0 <= m["actor/router_replay/mismatch_frac"] < 0.05  # later mini-batches: updated weights
