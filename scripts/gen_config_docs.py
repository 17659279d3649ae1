"""Writes docs/configs.md: every field of the run config, from the typed dataclasses.

Fields, types and nesting come from `jaxrl_llm/config/_schema.py`; defaults from
`base_config()` (`_defaults.py`); each field's description from `DESCRIPTIONS` below or, failing
that, the field's inline `# comment` in the schema. A field with neither is an error, so the doc
cannot silently miss one. `tests/launch/test_launch_config_docs.py` checks that the file on disk
equals this script's output.

  python scripts/gen_config_docs.py            # rewrite docs/configs.md
  python scripts/gen_config_docs.py --check    # exit 1 if docs/configs.md is stale
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import json
import re
import sys
import tokenize
import typing
from pathlib import Path

from jaxrl_llm.config import RunConfig, base_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configs.md"

# "<DataclassName>.<field>": description. Shared classes (OptimConfig, MeshSection, ...) once.
DESCRIPTIONS = {
    "DataConfig.train_files": "Training prompt files (parquet or jsonl, verl schema), only ever read; comma-separated on the command line; empty = the built-in task's generated split.",
    "DataConfig.val_files": "Validation prompt files; empty = the built-in task's validation split (if `data.builtin_task` is set and `builtin_val_size > 0`), else no validation.",
    "DataConfig.builtin_task": "`arithmetic`, `arithmetic_tools` (multiplication with the calculator tool, for `rollout.multi_turn`), `countdown` or `reasoning_gym:<dataset>` (e.g. `reasoning_gym:chain_sum`; needs the `gym` extra): generates the train split when `train_files` is empty and the val split when `val_files` is empty, under `<trainer.default_local_dir>/data/builtin/<task>-<hash of the settings>/`; given files are never written; `\"\"` = use your files only.",
    "DataConfig.builtin_task_config": "`reasoning_gym:<dataset>` only: a JSON object of the dataset's config options (e.g. `{\"min_terms\": 2, \"max_digits\": 2}`) plus `answer_extraction` (`answer_tag` or `last_number`, see docs/quickstart.md) and `system_prompt` (a system message before each question); size and seed come from `builtin_*_size` and `data.seed`.",
    "DataConfig.builtin_train_size": "Rows generated for the built-in task's training file.",
    "DataConfig.builtin_val_size": "Rows generated for the built-in task's validation file; 0 = no generated validation split.",
    "DataConfig.builtin_max_operand": "Arithmetic task: operands drawn from [0, builtin_max_operand].",
    "DataConfig.prompt_key": "Column holding the chat-message prompt.",
    "DataConfig.max_prompt_length": "Prompt tokens (after the chat template); longer prompts are dropped or truncated.",
    "DataConfig.max_response_length": "Generated tokens per response (the rollout budget).",
    "DataConfig.train_batch_size": "Prompts per RL step (each sampled `rollout.n` times).",
    "DataConfig.val_batch_size": "Prompts per validation generate call.",
    "DataConfig.filter_overlong_prompts": "Drop prompts longer than `max_prompt_length` when loading.",
    "DataConfig.truncation": "Over-long prompts that are kept: `error`, `left` or `right` truncation.",
    "DataConfig.shuffle": "Shuffle the training prompts every epoch.",
    "DataConfig.seed": "Seed of the data order (and of built-in task generation).",
    "ModelSection.path": "Hugging Face model folder (safetensors); `\"\"` = initialise from `model.init`.",
    "ModelSection.tokenizer": "`char` (built-in character tokenizer) or a tokenizer folder; `\"\"` = `model.path`.",
    "ModelSection.dtype": "Compute dtype of forward/backward passes (`bfloat16` or `float32`).",
    "ModelSection.param_dtype": "Stored dtype of parameters and optimizer moments.",
    "ModelSection.remat": "Activation rematerialisation policy of the decoder layers (`none` = keep activations).",
    "ModelSection.train_attention": "Attention kernel of the full forward (training, log-probs, prefill): `auto` (Pallas splash on TPU when head_dim is a multiple of 128, cuDNN flash on GPU in bf16, else `xla`), `xla`, `cudnn`, `rolled`, `splash`.",
    "ModelSection.decode_attention": "Attention kernel of one-token decode steps: `auto` (the Pallas decode kernel on TPU when head_dim is a multiple of 128; on GPU in bf16 the Pallas Triton decode kernel when head_dim is a power of two in 16..256 and the cache length a multiple of 16, else cuDNN; else `einsum`), `einsum`, `reduce`, `cudnn`, `pallas`, `triton`.",
    "ModelInitConfig.model_type": "Architecture family for a from-scratch model: `llama`, `qwen2` or `qwen3`.",
    "ModelInitConfig.hidden_size": "Model width.",
    "ModelInitConfig.intermediate_size": "MLP width.",
    "ModelInitConfig.num_hidden_layers": "Decoder layers.",
    "ModelInitConfig.num_attention_heads": "Query heads.",
    "ModelInitConfig.num_key_value_heads": "Key/value heads (GQA); must divide `num_attention_heads` and the tensor axis.",
    "ModelInitConfig.head_dim": "Width of one attention head.",
    "ModelInitConfig.rope_theta": "RoPE base frequency.",
    "ModelInitConfig.max_position_embeddings": "Longest sequence the positions cover.",
    "ModelInitConfig.tie_word_embeddings": "Share the input embedding with the output projection.",
    "ModelInitConfig.seed": "Parameter initialisation seed (the critic uses seed + 1).",
    "LoraConfig.rank": "LoRA rank r (verl's `lora_rank`). 0 = full fine-tuning; > 0 trains only low-rank adapters on the frozen base, their AdamW state is the only optimizer state, the reference log-probs come from the base with adapters off (no reference copy), and the engine is synced with merged W + (alpha/r)·A·B. Checkpoints hold adapters + optimizer state and a reference to the base; the end of the run also writes `lora_adapter/` in PEFT's format. See docs/concepts.md (LoRA).",
    "LoraConfig.alpha": "LoRA alpha (verl's `lora_alpha`): the adapter update is scaled by alpha / rank.",
    "LoraConfig.dropout": "Dropout on the adapters' input. Only 0.0 is implemented (anything else is a config error).",
    "LoraConfig.target_modules": "Projections that get adapters: `all-linear` (q/k/v/o and gate/up/down of every layer; not the LM head) or a list such as `q_proj,v_proj`.",
    "OptimConfig.lr": "Peak learning rate (AdamW).",
    "OptimConfig.weight_decay": "AdamW decoupled weight decay (on parameters with 2+ dimensions unless `weight_decay_1d`).",
    "OptimConfig.weight_decay_1d": "Also decay 1-D parameters (norm scales, biases). Off by default: the usual AdamW mask, which verl's plain torch AdamW does not apply.",
    "OptimConfig.betas": "AdamW (beta1, beta2).",
    "OptimConfig.eps": "AdamW epsilon.",
    "OptimConfig.warmup_steps": "Linear warm-up optimizer steps.",
    "OptimConfig.lr_schedule": "`constant` or `cosine` (decays to `lr * min_lr_ratio` over the run).",
    "OptimConfig.min_lr_ratio": "Cosine schedule floor as a fraction of `lr`.",
    "OptimConfig.clip_grad": "Global gradient-norm clip; 0 disables it.",
    "ActorConfig.optim": "Actor optimizer.",
    "ActorConfig.ppo_mini_batch_size": "Prompts per optimizer step (times `rollout.n` sequences); must divide `data.train_batch_size`.",
    "ActorConfig.ppo_micro_batch_size_per_device": "Sequences per device per forward/backward (gradient accumulation inside the step).",
    "ActorConfig.ppo_epochs": "Passes over each RL batch.",
    "ActorConfig.shuffle": "Shuffle rows between mini-batches.",
    "ActorConfig.policy_loss": "Policy loss: `vanilla` (PPO clip), `gspo`, `gpg`, `cispo`, `geo_mean`, `sapo`.",
    "ActorConfig.loss_agg_mode": "How token losses are averaged: `token-mean`, `seq-mean-token-sum`, `seq-mean-token-mean`, `seq-mean-token-sum-norm`, `token-sum` (no normaliser).",
    "ActorConfig.clip_ratio": "PPO clip epsilon (used when low/high are not set apart).",
    "ActorConfig.clip_ratio_low": "Lower clip epsilon (DAPO's clip-higher keeps it at 0.2).",
    "ActorConfig.clip_ratio_high": "Upper clip epsilon (DAPO: 0.28).",
    "ActorConfig.clip_ratio_c": "Dual-clip constant for negative advantages.",
    "ActorConfig.entropy_coeff": "Entropy bonus coefficient.",
    "ActorConfig.use_kl_loss": "Add a KL-to-reference loss term (GRPO style); builds the reference model.",
    "ActorConfig.kl_loss_coef": "Weight of the KL loss.",
    "ActorConfig.kl_loss_type": "KL estimator of the loss: `kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`; a `+` suffix (e.g. `low_var_kl+`) keeps the value and takes k2's unbiased gradient.",
    "CriticConfig.optim": "Critic optimizer.",
    "CriticConfig.ppo_mini_batch_size": "Prompts per critic optimizer step.",
    "CriticConfig.ppo_micro_batch_size_per_device": "Sequences per device per critic forward/backward.",
    "CriticConfig.ppo_epochs": "Critic passes over each RL batch.",
    "CriticConfig.cliprange_value": "Value clipping range.",
    "CriticConfig.loss_agg_mode": "Aggregation of the value loss (as `actor.loss_agg_mode`).",
    "CriticConfig.warmup_steps_before_actor": "RL steps that update only the critic (verl's `critic_warmup`).",
    "RolloutConfig.n": "Samples per prompt (the GRPO group size).",
    "RolloutConfig.temperature": "Sampling temperature; 0 = greedy.",
    "RolloutConfig.top_k": "Top-k sampling; -1 = off.",
    "RolloutConfig.top_p": "Nucleus sampling mass; 1 = off.",
    "RolloutConfig.max_concurrent_decodes": "Decode slots of the engine (KV-cache batch); continuous batching refills freed slots.",
    "RolloutConfig.steps_per_sync": "Decode steps run on device between host checks of finished slots.",
    "RolloutConfig.dtype": "Rollout weights/KV dtype; `\"\"` = `model.dtype`. Equal dtype and layout make weight sync zero-copy.",
    "RolloutConfig.use_rollout_log_probs": "Use the engine's sampling log-probs as `old_log_probs` (skips one forward pass).",
    "RolloutConfig.partial_rollout_kv": "At a weight sync with requests held in flight: `recompute` (verl V1) re-prefills each held request's kept prefix with the new weights and drops parked sessions' KV; `keep` decodes on the KV the old weights computed (see rollout.md).",
    "RolloutConfig.val": "Sampling for validation.",
    "RolloutConfig.multi_turn": "Agent rollouts (verl's `multi_turn`): tools, simulated users, multi-turn trajectories; see `docs/agents.md`.",
    "SamplingConfig.temperature": "Validation sampling temperature (0 = greedy).",
    "SamplingConfig.top_k": "Validation top-k; -1 = off.",
    "SamplingConfig.top_p": "Validation nucleus mass.",
    "SamplingConfig.n": "Validation samples per prompt: `mean@n`, and with n > 1 `std@n` and bootstrap `best@k`/`worst@k`/`maj@k` (docs/concepts.md).",
    "AlgorithmConfig.adv_estimator": "Advantage estimator: `gae` (PPO, builds a critic), `grpo`, `grpo_passk`, `rloo`, `opo`, `reinforce_plus_plus`, `reinforce_plus_plus_baseline`, `remax`, `gpg`.",
    "AlgorithmConfig.gamma": "Discount (GAE / REINFORCE++).",
    "AlgorithmConfig.lam": "GAE lambda.",
    "AlgorithmConfig.norm_adv_by_std_in_grpo": "Divide GRPO advantages by the group std (False = Dr. GRPO).",
    "AlgorithmConfig.use_kl_in_reward": "Subtract a KL-to-reference penalty from the token rewards (PPO style).",
    "AlgorithmConfig.kl_penalty": "KL estimator of the in-reward penalty (as `actor.kl_loss_type`).",
    "AlgorithmConfig.kl_ctrl": "In-reward KL coefficient controller.",
    "KLControlConfig.type": "`fixed` or `adaptive` (targets `target_kl` over `horizon`).",
    "KLControlConfig.kl_coef": "Initial KL coefficient.",
    "KLControlConfig.target_kl": "Adaptive controller: KL it steers towards.",
    "KLControlConfig.horizon": "Adaptive controller: samples over which it adapts.",
    "AlgorithmConfig.rollout_correction": "Correct for the engine's policy differing from the trainer's (stale weights under `placement.one_step_off_policy`, bf16 serving); needs `rollout.use_rollout_log_probs=False`.",
    "RolloutCorrectionConfig.rollout_is": "Truncated importance weights `min(pi_old / pi_rollout, threshold)` on the policy loss: `token`, `sequence` (product over the row), or `\"\"` = off.",
    "RolloutCorrectionConfig.rollout_is_threshold": "Upper truncation of the IS weights.",
    "RolloutCorrectionConfig.rollout_is_batch_normalize": "Rescale the truncated IS weights to mean 1 over the batch.",
    "RolloutCorrectionConfig.rollout_rs": "Rejection sampling: drop tokens (`token`) or rows (`sequence`, `geometric` mean) whose ratio leaves `[lower, upper]` from the loss mask; `\"\"` = off.",
    "RolloutCorrectionConfig.rollout_rs_threshold": "Rejection: upper bound of the ratio.",
    "RolloutCorrectionConfig.rollout_rs_threshold_lower": "Rejection: lower bound of the ratio; 0 = `1 / rollout_rs_threshold`.",
    "RolloutCorrectionConfig.rollout_token_veto_threshold": "Drop a whole row when any token's ratio is below this; 0 = off.",
    "FilterGroupsConfig.enable": "DAPO dynamic sampling (verl's names): generate batches of `data.train_batch_size` prompts and keep only the prompts whose `rollout.n` responses differ in `metric`, until a step's batch is full. Logs `train/num_gen_batches`, `filter_groups/kept_groups`, `filter_groups/filtered_groups`. Needs `rollout.n >= 2`. In `separate_async` / `colocate_async` (and `placement.one_step_off_policy`, an alias of separate_async) the rollouter evicts each finished group the filter rejects and gives its slot to the next fed prompt (metric `acc` or `score`; logs `filter_groups/filtered_groups`).",
    "FilterGroupsConfig.metric": "What must vary within a group: `acc` (the reward function's `acc` extra, else its score), `score` (the score before the overlong penalty), `seq_reward` (the summed `token_level_scores`, penalty included), `seq_final_reward` (the same: the filter runs before any KL penalty, so it cannot be combined with `algorithm.use_kl_in_reward`).",
    "FilterGroupsConfig.max_num_gen_batches": "Generation rounds a step may take before it stops with an error; 0 = unlimited. The surplus groups of the last round are dropped. In `separate_async` / `colocate_async`: a step may evict `(max_num_gen_batches - 1) * data.train_batch_size` filtered groups (the prompts are fed ahead), so there it must be > 0; the one-step-off pipeline (batch driver) refuses the filter.",
    "OverlongBufferConfig.enable": "DAPO soft overlong punishment (verl's `reward_model.overlong_buffer`): a response longer than `data.max_response_length - len` tokens gets `-(length - (max_response_length - len)) / len * penalty_factor` added to its score (at most `-penalty_factor`); logged as `reward_extra/overlong_reward/mean` and `reward_extra/overlong/mean`. ReMax baselines get it too.",
    "OverlongBufferConfig.len": "Tokens before `data.max_response_length` where the penalty starts (0 < len <= max_response_length when enabled).",
    "OverlongBufferConfig.penalty_factor": "The penalty at `data.max_response_length` tokens.",
    "RewardConfig.num_workers": "Reward scoring processes (with per-call timeouts); 0 = built-in scorers in-process (a custom reward function still gets one isolated process).",
    "RewardConfig.timeout_s": "Seconds one scoring call may take before it scores 0.",
    "RewardConfig.custom_reward_function": "Your own scorer: a Python file and function name (verl's signature).",
    "CustomRewardConfig.path": "Python file defining the scorer; `\"\"` = built-in scorers by `data_source`.",
    "CustomRewardConfig.name": "Function name: `f(data_source, solution_str, ground_truth, extra_info) -> float | dict`.",
    "RewardModelConfig.path": "Value-head reward-model folder; its score replaces the rule-based scorers. `\"\"` = none.",
    "PlacementConfig.mode": "`colocated` (rollout engine on the training mesh, verl's hybrid engine) or `separate` (own devices).",
    "PlacementConfig.rollout_mesh": "Rollout engine mesh. `separate`: its own devices (explicit sizes, no -1), on several hosts the mesh of each host's own replica (the same devices on every host). `colocated`: 1x1x1 = the training mesh; another shape re-meshes the training devices (-1 allowed), e.g. `tensor=-1` for tensor-parallel decode.",
    "AsyncTrainingConfig.partial_rollout": "At a sync, running requests keep their tokens and log-probs and continue with the new weights (each token records its policy version) instead of being waited for. Needs `staleness_threshold > 0`.",
    "RewardModelConfig.micro_batch_size_per_device": "Sequences per device per reward-model forward.",
    "MeshSection.data": "Data-parallel (replicated parameters) axis size; -1 = fill with the remaining devices.",
    "MeshSection.fsdp": "Fully-sharded data-parallel axis (parameters, grads and optimizer state sharded); -1 = fill.",
    "MeshSection.tensor": "Tensor-parallel axis (heads, MLP and vocab split); -1 = fill.",
    "SFTConfig.steps": "Supervised warm-start steps before RL; 0 disables SFT.",
    "SFTConfig.batch_size": "SFT sequences per step.",
    "SFTConfig.lr": "SFT peak learning rate (cosine schedule).",
    "SFTConfig.warmup_steps": "SFT warm-up steps.",
    "SFTConfig.max_length": "SFT sequence length (prompt + answer tokens).",
    "SFTConfig.train_files": "Chat-message files for SFT (tool-call traces: docs/quickstart.md, \"SFT data for tool use\"); empty = the built-in task's demonstrations (`arithmetic`, `arithmetic_tools` only; other tasks need files when `sft.steps > 0`).",
    "SFTConfig.messages_key": "Column holding the messages.",
    "SFTConfig.builtin_size": "Built-in SFT rows generated.",
    "SFTConfig.builtin_off_by_one": "Arithmetic demos: fraction answered one too high (imperfect data for RL to fix).",
    "TrainerConfig.backend": "`ray` (one worker actor per host, driver is the controller) or `local` (workers in-process; multi-host: every host runs the command).",
    "TrainerConfig.total_training_steps": "RL steps.",
    "TrainerConfig.save_freq": "Checkpoint every this many steps (and always at the end); 0 = only at the end.",
    "TrainerConfig.test_freq": "Validate every this many steps (and at the end); 0 = only at the end.",
    "TrainerConfig.val_before_train": "Validate once before the first step.",
    "TrainerConfig.val_only": "Validate the current weights (the newest checkpoint if any, else the initial model), log `val-core/*`, `val-aux/*` at that step, and exit without training.",
    "TrainerConfig.log_val_generations": "Validation responses (prompt, response, score, ground truth) written per validation to `<run>/val_generations.jsonl` and TensorBoard text; the same rows every time; 0 = none.",
    "TrainerConfig.default_local_dir": "Run folder: metrics, TensorBoard logs, checkpoints, HF export, curves.",
    "TrainerConfig.resume_mode": "`auto` (latest checkpoint in the run folder), `disable`, or a checkpoint path.",
    "TrainerConfig.max_to_keep": "Checkpoints kept.",
    "TrainerConfig.async_save": "Write checkpoints in the background.",
    "TrainerConfig.export_hf": "Save the final actor as a Hugging Face folder (`<run>/hf_actor`).",
    "TrainerConfig.logger": "Metric sinks: any of `console`, `jsonl`, `tensorboard`.",
    "TrainerConfig.project_name": "Project name: with the experiment name, the TensorBoard text `run/name` (`project/experiment`).",
    "TrainerConfig.experiment_name": "Experiment name: in TensorBoard's `run/name` text and the progress bar's label.",
    "TrainerConfig.seed": "Seed of rollout sampling and mini-batch shuffling.",
    "TrainerConfig.progress_bar": "Show a tqdm bar.",
    "TrainerConfig.plot": "Draw `curves.png` at the end.",
}

SECTION_NOTES = {
    "mesh": "The product data × fsdp × tensor must equal the global device count (all hosts); see docs/scaling.md.",
}


def _inline_comments(cls) -> dict[str, str]:
    """`field: type  # comment` lines of a dataclass's source."""
    out = {}
    src = inspect.getsource(cls)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.line
            m = re.match(r"\s*(\w+)\s*:", line)
            if m:
                out[m.group(1)] = tok.string.lstrip("# ").strip()
    return out


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        args = typing.get_args(tp)
        if args and args[-1] is Ellipsis:
            return f"tuple[{_type_name(args[0])}, ...]"
        return "tuple[" + ", ".join(_type_name(a) for a in args) + "]"
    return getattr(tp, "__name__", str(tp))


def _default(value) -> str:
    if isinstance(value, (tuple, list)):
        value = list(value)
    text = json.dumps(value)
    return f"`{text}`"


def _rows(cls, defaults, prefix: str, missing: list[str]):
    hints = typing.get_type_hints(cls)
    comments = _inline_comments(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _rows(tp, defaults[f.name], path + ".", missing)
            continue
        desc = DESCRIPTIONS.get(f"{cls.__name__}.{f.name}") or comments.get(f.name)
        if not desc:
            missing.append(f"{cls.__name__}.{f.name} ({path})")
            desc = ""
        desc = desc.replace("|", "\\|")
        yield f"| `{path}` | `{_type_name(tp)}` | {_default(defaults[f.name])} | {desc} |"


def render() -> str:
    defaults = base_config().to_dict()
    hints = typing.get_type_hints(RunConfig)
    missing: list[str] = []
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by `python scripts/gen_config_docs.py` from jaxrl_llm/config/_schema.py and",
        "     _defaults.py; do not edit by hand (tests/launch/test_launch_config_docs.py checks it). -->",
        "",
        "Every run is `python -m jaxrl_llm.train --config=configs/X.py[:variant] [--config.<field>=<value> ...]`.",
        "A config file starts from `base_config()` (the defaults below) and changes what it needs; any",
        "field can be overridden on the command line (lists as `a,b`). Unknown or misspelt fields are",
        "rejected by name. The launch flags outside the config (`--coordinator_address`,",
        "`--num_processes`, `--process_id`, `--num_hosts`) are described in docs/scaling.md.",
        "",
    ]
    for f in dataclasses.fields(RunConfig):
        cls = hints[f.name]
        lines.append(f"## `{f.name}`")
        lines.append("")
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(cls.__name__ + "("):
            lines.extend([" ".join(doc.split()), ""])
        if f.name in SECTION_NOTES:
            lines.extend([SECTION_NOTES[f.name], ""])
        lines.extend(["| field | type | default | meaning |", "|---|---|---|---|"])
        lines.extend(_rows(cls, defaults[f.name], f"{f.name}.", missing))
        lines.append("")
    if missing:
        raise SystemExit("gen_config_docs: no description for " + ", ".join(missing)
                         + "; add an inline `# comment` to the field in jaxrl_llm/config/_schema.py "
                           "or an entry to DESCRIPTIONS in scripts/gen_config_docs.py")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/configs.md is out of date")
    p.add_argument("--output", default=str(DOC), help="where to write (default docs/configs.md)")
    args = p.parse_args(argv)
    text = render()
    out = Path(args.output)
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is out of date: run `python scripts/gen_config_docs.py`", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
