"""Router replay (R3) on the request-level path in the trainer: one RL step of the agent quickstart
(`rollout.multi_turn`, tool_agent with a simulated user: sessions of several turns reusing their
parked KV) on a tiny from-scratch Qwen3-MoE (4 experts, top-2; the fixture's 96-token vocabulary is smaller than
the char tokenizer's chat template needs) in fp32, experts sharded over fsdp=4. The server records
every fed token's experts, the agent loop and runner lay them out per trajectory, and the replaying
old-log-prob pass and update route exactly as the engine did; a second step does the same for
openai_agent rows (a user's agent talking to the endpoint over the same server)."""
import dataclasses
import json
import os

import numpy as np

from jaxrl_llm.config import load_config
from jaxrl_llm.trainer import RLTrainer
from jaxrl_llm.workers import HostWorker
from trainer_helpers import REWARD_FN, ROOT

TOOLS = f"{ROOT}/configs/quickstart_tools.py:tiny,local"
# a tiny from-scratch Qwen3-MoE in fp32, its 4 experts over fsdp=4; replay; one mini-batch a step
_MOE = {"model.dtype": "float32", "model.init.model_type": "qwen3_moe", "model.init.num_experts": 4,
        "model.init.num_experts_per_tok": 2, "model.init.moe_intermediate_size": 32, "mesh.data": 2,
        "mesh.fsdp": 4, "actor.router_replay.mode": "replay", "actor.skip_redundant_old_log_prob": False,
        "actor.ppo_mini_batch_size": 8, "sft.steps": 0}


def _data(folder) -> dict:
    """Multiplication prompts with a simulated user that answers a wrong reply with "try again"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"data_source": "arithmetic", "agent_name": "tool_agent",
             "prompt": [{"role": "user", "content": f"{a}*{b}="}], "ability": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": str(a * b)},
             "extra_info": {"index": i, "interaction_kwargs": {"name": "answer_check"}}}
            for i, (a, b) in enumerate([(12, 34), (56, 78), (23, 45), (67, 89)] * 2)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    (folder / "interaction.json").write_text(json.dumps({"interaction": [
        {"name": "answer_check", "class_name": "answer_check", "config": {"max_attempts": 3}}]}))
    return {"data.train_files": folder / "train.parquet",
            "rollout.multi_turn.interaction_config_path": folder / "interaction.json"}


def _spy_recorded(monkeypatch) -> list:
    """Each step's batch, as [(attention_mask, routed_experts)] (the old-log-prob metrics' input)."""
    from jaxrl_llm.trainer import _old_log_prob

    seen, real = [], _old_log_prob.router_replay_metrics

    def spy(computed, batch):
        seen.append((np.array(batch.attention_mask), np.array(batch.routed_experts)))
        return real(computed, batch)
    monkeypatch.setattr(_old_log_prob, "router_replay_metrics", spy)
    return seen


def test_agent_rl_step_replays_the_servers_experts(tmp_path, monkeypatch):
    o = {**_data(tmp_path / "data"), **_MOE,
         "rollout.multi_turn.max_assistant_turns": 3,
         "rollout.multi_turn.openai_agent_path": os.path.join(ROOT, "tests", "agent", "openai_agents.py"),
         "rollout.multi_turn.openai_agent_name": "follow_up_agent",
         "trainer.default_local_dir": tmp_path / "run", "trainer.progress_bar": False, "trainer.plot": False,
         "trainer.logger": "jsonl", "trainer.async_save": False, "trainer.val_before_train": False,
         "trainer.test_freq": 0, "trainer.save_freq": 0,
         "reward.custom_reward_function.path": REWARD_FN, "reward.custom_reward_function.name": "compute_score"}
    run = load_config(TOOLS, [f"{k}={v}" for k, v in o.items()])
    seen = _spy_recorded(monkeypatch)
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, run.trainer.total_training_steps)
        m = trainer.train_step()
        trainer.global_step += 1
        # the same rows through openai_agent: three requests each, two user messages between them
        examples = trainer.train_set.examples
        examples[:] = [dataclasses.replace(e, agent_name="openai_agent") for e in examples]
        m_openai = trainer.train_step()
    finally:
        trainer.close()
    assert m["num_turns/max"] > 2  # a session of several turns (the user answered)
    assert m_openai["agent/openai_agent/count"] >= 1 and "agent/tool_agent/count" not in m_openai
    assert m_openai["num_turns/min"] == 1 + 3 + 2
    assert len(seen) == 2
    for attention, experts in seen:  # every real token but each row's last carries the engine's experts
        recorded = (experts >= 0).all(axis=(2, 3))
        assert not (recorded & (attention == 0)).any()
        np.testing.assert_array_equal(recorded.sum(1), np.maximum(attention.sum(1) - 1, 0))
    for step in (m, m_openai):
        assert step["rollout/router_replay/mismatch_frac"] == 0.0
        assert step["actor/router_replay/mismatch_frac"] == 0.0  # one mini-batch: the update is on-policy
        assert step["rollout/logprob_abs_diff/max"] < 1e-4


def test_colocate_async_replays_the_servers_experts_through_the_trajectory_queue(tmp_path):
    """colocate_async: groups go through the rollouter's queue (the warm-up batch's requests are
    held over the update, the engine sleeps and re-prefills them at wake); the first step is
    on-policy: the replaying passes match the engine's routing on every recorded token. The model
    has a dense layer 0 before its sparse layer 1 (`model.init.mlp_only_layers`): only layer 1's
    experts are recorded, replayed and measured."""
    o = {"trainer.v1.trainer_mode": "colocate_async", "trainer.backend": "local", "trainer.export_hf": False,
         "trainer.val_before_train": False, "data.builtin_val_size": 0,
         "trainer.v1.colocate_async.num_warmup_batches": 1.0, **_MOE, "model.init.mlp_only_layers": "[0]",
         "trainer.default_local_dir": tmp_path / "run", "trainer.progress_bar": False, "trainer.plot": False,
         "trainer.logger": "jsonl", "trainer.async_save": False, "trainer.save_freq": 0, "trainer.test_freq": 0,
         "reward.custom_reward_function.path": REWARD_FN, "reward.custom_reward_function.name": "compute_score"}
    run = load_config(f"{ROOT}/configs/quickstart.py:tiny", [f"{k}={v}" for k, v in o.items()])
    trainer = RLTrainer(run)
    try:
        trainer.call0(HostWorker.start_rl, 2)
        steps = []
        for _ in range(2):
            steps.append(trainer.train_step())
            trainer.global_step += 1
    finally:
        trainer.close()
    first, second = steps
    assert first["rollout/router_replay/mismatch_frac"] == 0.0
    assert first["actor/router_replay/mismatch_frac"] == 0.0
    assert first["rollout/logprob_abs_diff/max"] < 1e-4
    assert "moe/expert_load/layer_1/min" in first and "moe/expert_load/layer_0/min" not in first
    assert second["colocate_async/kv_bytes_released"] > 0  # slept: held requests re-prefilled at wake
    assert 0.0 <= second["actor/router_replay/mismatch_frac"] < 1.0  # recorded and replayed
