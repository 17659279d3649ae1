"""The base ConfigDict every file in `configs/` starts from: every field, with verl-like defaults.

A config file changes what it needs and returns the dict; `_load.py` validates it. Keeping every
field here means a misspelt override (`--config.actor.optim.lrr=1`) is rejected by name.
"""
from __future__ import annotations

from ml_collections import ConfigDict

# reward.judge.prompt_template's default: a 0-10 grade read by the "last_number" parser
JUDGE_TEMPLATE = ("Grade the response to the question below against the reference answer.\n\n"
                  "Question: {question}\n\nReference answer: {ground_truth}\n\nResponse: {response}\n\n"
                  "Reply with a short reason, then end with the grade: an integer from 0 (wrong) "
                  "to 10 (fully correct).")


def _optim(lr: float) -> dict:
    return dict(lr=lr, weight_decay=0.01, weight_decay_1d=False, betas=(0.9, 0.999), eps=1e-8,
                warmup_steps=0, lr_schedule="constant", min_lr_ratio=0.0, clip_grad=1.0)


def base_config() -> ConfigDict:
    c = ConfigDict()
    c.data = dict(
        train_files=(), val_files=(), builtin_task="", builtin_task_config="", builtin_train_size=2000,
        builtin_val_size=200, builtin_max_operand=99, prompt_key="prompt", max_prompt_length=512,
        max_response_length=512, train_batch_size=64, val_batch_size=256,
        filter_overlong_prompts=True, truncation="error", shuffle=True, seed=1)
    c.model = dict(
        path="", tokenizer="", dtype="bfloat16", param_dtype="float32", remat="none",
        train_attention="auto", decode_attention="auto", use_remove_padding=False,
        moe=dict(aux_loss_coef=0.0, z_loss_coef=0.0),
        init=dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0,
                  max_position_embeddings=1024, tie_word_embeddings=True, seed=0,
                  num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, norm_topk_prob=True,
                  mlp_only_layers=(), decoder_sparse_step=1))
    c.actor = dict(
        optim=_optim(1e-6), lora=dict(rank=0, alpha=16.0, dropout=0.0, target_modules=("all-linear",)),
        router_replay=dict(mode="disabled"),
        ppo_mini_batch_size=16, ppo_micro_batch_size_per_device=8,
        use_dynamic_bsz=False, ppo_max_token_len_per_device=16384,
        ppo_epochs=1, shuffle=False, policy_loss="vanilla", loss_agg_mode="token-mean",
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
        entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.001, kl_loss_type="low_var_kl",
        skip_redundant_old_log_prob=True, old_log_prob_pass="trainer")
    c.critic = dict(
        optim=_optim(1e-5), ppo_mini_batch_size=16, ppo_micro_batch_size_per_device=8,
        use_dynamic_bsz=False, ppo_max_token_len_per_device=32768, ppo_epochs=1, cliprange_value=0.5, loss_agg_mode="token-mean", warmup_steps_before_actor=0)
    c.ref = dict(log_prob_max_token_len_per_device=0)
    c.rollout = dict(
        n=8, temperature=1.0, top_k=-1, top_p=1.0, max_concurrent_decodes=256,
        steps_per_sync=16, dtype="", quantization="none", kv_cache_dtype="auto", use_rollout_log_probs=False,
        log_prob_max_token_len_per_device=0, partial_rollout_kv="recompute", free_cache_engine=True,
        batch_invariant=False,
        replicas_per_host=1, max_inflight_per_replica=0, replica_backend="local", replica_max_restarts=1,
        replica_restart_backoff_s=1.0,
        val=dict(temperature=0.0, top_k=-1, top_p=1.0, n=1),
        multi_turn=dict(
            enable=False, default_agent_loop="single_turn_agent", max_assistant_turns=0,
            max_user_turns=0, max_parallel_calls=1, max_tool_response_length=256,
            tool_response_truncate_side="middle", tool_timeout_s=10.0, tool_memory_limit_gb=4.0,
            tool_workers=2, sandbox="auto", tool_config_path="",
            function_tool_path="", interaction_config_path="", format="hermes",
            tokenization_sanity_check_mode="strict", openai_agent_path="",
            openai_agent_name="agent"))
    c.algorithm = dict(
        adv_estimator="grpo", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
        use_kl_in_reward=False, kl_penalty="kl",
        kl_ctrl=dict(type="fixed", kl_coef=0.001, target_kl=0.1, horizon=10000),
        rollout_correction=dict(
            rollout_is="auto", rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
            rollout_rs="", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.0,
            rollout_token_veto_threshold=0.0, bypass_mode=False),
        filter_groups=dict(enable=False, metric="acc", max_num_gen_batches=0))
    c.reward = dict(num_workers=2, timeout_s=10.0, max_error_fraction=0.5,
                    max_consecutive_timeouts=8, max_consecutive_worker_deaths=5,
                    memory_limit_gb=8.0, sandbox="auto",
                    custom_reward_function=dict(path="", name="compute_score"),
                    rule_weight=-1.0,
                    model=dict(path="", weight=1.0, micro_batch_size_per_device=8, use_dynamic_bsz=False,
                               forward_max_token_len_per_device=32768),
                    judge=dict(enable=False, model_path="policy", prompt_template=JUDGE_TEMPLATE,
                               score_parser="last_number", parse_failure_score=0.0, temperature=0.0,
                               top_p=1.0, max_tokens=256, max_prompt_length=2048,
                               max_concurrent_decodes=16, weight=1.0, log_every=16),
                    overlong_buffer=dict(enable=False, len=0, penalty_factor=1.0))
    c.mesh = dict(data=1, fsdp=-1, tensor=1, context=1)
    c.placement = dict(mode="colocated", rollout_mesh=dict(data=1, fsdp=1, tensor=1, context=1),
                       one_step_off_policy=False)
    c.async_training = dict(enable=False, staleness_threshold=0.0, trigger_parameter_sync_step=1,
                            require_batches=1, partial_rollout=False)
    c.sft = dict(steps=0, batch_size=32, lr=1e-4, warmup_steps=0, max_length=512, train_files=(),
                 messages_key="messages", builtin_size=2000, builtin_off_by_one=0.0,
                 builtin_trailing_junk=0.0, builtin_no_tool=0.0)
    c.trainer = dict(
        backend="ray", total_training_steps=100, save_freq=0, test_freq=0, val_before_train=True,
        val_only=False, log_val_generations=10,
        default_local_dir="runs/default", resume_mode="auto", max_to_keep=2, max_nonfinite_steps=3,
        async_save=True,
        export_hf=True, keep_best_val_metric="", logger=("console", "jsonl", "tensorboard"), project_name="jaxrl_llm",
        experiment_name="default", seed=0, progress_bar=True, plot=True,
        v1=dict(trainer_mode="sync", colocate_async=dict(num_warmup_batches=1.0),
                separate_async=dict(parameter_sync_step=0),
                sampler=dict(max_off_policy_threshold=1, max_off_policy_strategy="drop",
                             max_failed_groups=0, max_failed_fraction=1.0),
                deterministic_schedule=False))
    return c
