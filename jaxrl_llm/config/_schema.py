"""The typed run configuration: frozen dataclasses, one per section of a config file.

Config files (`configs/*.py`) build an `ml_collections.ConfigDict` with exactly these sections and
fields; `_load.py` checks it once and converts it to `RunConfig`. Library code takes these typed
sections (or plain arguments), never the ConfigDict. Field names follow verl where verl has one.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    builtin_task: str  # "", "arithmetic", "arithmetic_tools", "countdown" or "reasoning_gym:<dataset>": generates each split whose files above are empty, under <run>/data/builtin/
    builtin_task_config: str  # reasoning_gym tasks: JSON object of the dataset's config options (+ answer_extraction, system_prompt)
    builtin_train_size: int
    builtin_val_size: int  # 0 = no generated validation split
    builtin_max_operand: int  # arithmetic task: operands in [0, builtin_max_operand]
    prompt_key: str
    max_prompt_length: int
    max_response_length: int
    train_batch_size: int  # prompts per step
    val_batch_size: int
    filter_overlong_prompts: bool
    truncation: str  # error | left | right
    shuffle: bool
    seed: int


@dataclasses.dataclass(frozen=True)
class ModelInitConfig:
    """Architecture of a model trained from scratch (when `model.path` is empty)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    seed: int
    num_experts: int  # model_type qwen3_moe / mixtral: sparse MLP experts per layer (every layer); 0 = a dense model (any other model_type)
    num_experts_per_tok: int  # MoE: experts each token is routed to (top-k of the softmax router), 1..num_experts
    moe_intermediate_size: int  # MoE: each expert's SwiGLU width (intermediate_size is unused then)
    norm_topk_prob: bool  # MoE: renormalise the chosen experts' router probabilities to sum to 1 (Qwen3-MoE's option; Mixtral always does)
    mlp_only_layers: tuple[int, ...]  # qwen3_moe: layers with a dense MLP (width intermediate_size) instead of experts, as transformers' Qwen3-MoE; [] = none
    decoder_sparse_step: int  # qwen3_moe: layer i has experts only when (i + 1) % decoder_sparse_step == 0 (and i is not in mlp_only_layers); 1 = every layer


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Router losses of a mixture-of-experts model (Qwen3-MoE, Mixtral), added to the actor loss."""

    aux_loss_coef: float  # the router load-balancing loss (Switch/Mixtral, transformers' load_balancing_loss_func over all layers and real tokens of each micro-batch, weighted by its share of response tokens: docs/concepts.md) times this, added to the actor loss and logged as actor/moe_aux_loss; the issue's / transformers' "coef" spelling (verl's Megatron path: moe_aux_loss_coeff); 0 = off (the default, as verl's FSDP actor; the checkpoint's router_aux_loss_coef, 0.001 for Qwen3-MoE and Mixtral, is not applied unless set here); > 0 needs a MoE model
    z_loss_coef: float  # the ST-MoE router z-loss (mean over layers and real tokens of logsumexp(router logits)^2) times this, added to the actor loss and logged as actor/moe_z_loss; 0 = off; > 0 needs a MoE model


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str  # Hugging Face folder; "" = initialise from `init`
    tokenizer: str  # "char" (built-in) or a folder; "" = model.path
    init: ModelInitConfig
    dtype: str  # compute dtype
    param_dtype: str
    remat: str
    train_attention: str  # kernel of the full forward: auto | xla | cudnn | rolled | splash
    decode_attention: str  # kernel of one-token decode: auto | einsum | reduce | cudnn | pallas | triton
    moe: MoeConfig
    use_remove_padding: bool  # verl's: every training pass (old/reference log-probs, values, reward-model scores, actor and critic updates) packs each micro-batch's rows into sequences with segment ids instead of padded [p + t] rows; exact, same micro-batches (rows, or a token budget with *.use_dynamic_bsz); a batch with >= 80% real tokens stays padded (faster there, docs/concepts.md)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float
    weight_decay: float
    weight_decay_1d: bool  # also decay 1-D params (norm scales, biases); False = the usual mask
    betas: tuple[float, float]
    eps: float
    warmup_steps: int
    lr_schedule: str  # constant | cosine
    min_lr_ratio: float
    clip_grad: float


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """verl's `lora_rank` / `lora_alpha` / `target_modules`: train low-rank adapters on the
    frozen base (`rank == 0`: full fine-tuning). The update is scaled by alpha / rank."""

    rank: int  # 0 = off
    alpha: float
    dropout: float  # adapter-input dropout; only 0.0 is implemented
    target_modules: tuple[str, ...]  # ("all-linear",) or names: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj

    @property
    def enabled(self) -> bool:
        return self.rank > 0


ROUTER_REPLAY_MODES = ("disabled", "record", "replay", "R3")
OLD_LOG_PROB_PASSES = ("trainer", "engine")


@dataclasses.dataclass(frozen=True)
class RouterReplayConfig:
    """Router replay (R3) of a mixture-of-experts actor (docs/algorithms.md, "Router replay")."""

    mode: str  # disabled | record (the engine records every token's experts per layer; the trainer routes by its own top-k and logs actor/router_replay/mismatch_frac) | replay (as record, and the actor's old-log-prob pass and update use the recorded experts, gate weights recomputed from the trainer's router logits; verl's name R3 is accepted for it); needs a MoE model; works with the batch driver, the agent loops (openai_agent included) and every trainer mode; refused with rollout.replica_backend='process'

    @property
    def record(self) -> bool:
        return self.mode != "disabled"

    @property
    def replay(self) -> bool:
        return self.mode in ("replay", "R3")


@dataclasses.dataclass(frozen=True)
class ActorConfig:
    optim: OptimConfig
    lora: LoraConfig
    router_replay: RouterReplayConfig
    ppo_mini_batch_size: int  # prompts per optimizer step (times rollout.n sequences)
    ppo_micro_batch_size_per_device: int  # sequences per device per forward/backward
    use_dynamic_bsz: bool  # verl's: micro-batches up to a token budget (real prompt + response tokens) instead of ppo_micro_batch_size_per_device rows: the update, the old- and reference-log-prob passes; padded rows unless model.use_remove_padding packs them
    ppo_max_token_len_per_device: int  # use_dynamic_bsz: tokens (prompt + response) per device per micro-batch of the update; every row must fit (verl's ppo_max_token_len_per_gpu)
    ppo_epochs: int
    shuffle: bool
    policy_loss: str
    loss_agg_mode: str
    clip_ratio: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    skip_redundant_old_log_prob: bool  # skip the old-log-prob pass when nothing reads its result but one on-policy optimizer step (ppo_epochs 1, one mini-batch, no KL in reward, no rollout correction), which takes them from its own forward: same weights and metrics, less the engine/trainer mismatch diagnostics (rollout/logprob_abs_diff/*, rollout/probs_diff/*, actor/entropy_rollout); False = always run the pass (docs/algorithms.md)
    old_log_prob_pass: str  # trainer | engine: what computes the old-log-prob pass. trainer: the actor's forward (the fast path). engine: the rollout engine's own programs, each row's prompt prefilled and its response fed through the decode loop (rollout.RolloutDriver.teacher_force), so pi_old is, bit for bit, what the engine computes for those tokens with the weights the update starts from: rollout/logprob_abs_diff/max == 0 in the sync mode, bf16 and MoE included; the update then reads pi_old in every mini-batch (no on-policy shortcut). Needs rollout.batch_invariant, trainer.v1.trainer_mode='sync', single-turn rollouts, an unquantized rollout and rollout.replica_backend='local'; costs a decode-loop pass (docs/reliability.md)


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    optim: OptimConfig
    ppo_mini_batch_size: int
    ppo_micro_batch_size_per_device: int
    use_dynamic_bsz: bool  # token-budget micro-batches (as actor.use_dynamic_bsz) for the values pass and the critic update
    ppo_max_token_len_per_device: int  # use_dynamic_bsz: tokens per device per micro-batch (verl's ppo_max_token_len_per_gpu)
    ppo_epochs: int
    cliprange_value: float
    loss_agg_mode: str
    warmup_steps_before_actor: int  # critic_warmup in verl


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float
    top_k: int
    top_p: float
    n: int


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """verl's `rollout.multi_turn`: agent rollouts (tools, simulated users) instead of one
    completion per prompt. Turn limits of 0 mean unlimited (verl's null); the whole response,
    all turns together, is capped at `data.max_response_length`."""

    enable: bool  # rollouts through agent loops on the request-level server
    default_agent_loop: str  # for rows without an `agent_name` column
    max_assistant_turns: int  # model turns per trajectory; 0 = unlimited
    max_user_turns: int  # simulated-user (interaction) turns; 0 = unlimited
    max_parallel_calls: int  # tool calls executed per assistant turn
    max_tool_response_length: int  # characters of one tool response kept
    tool_response_truncate_side: str  # left | middle | right
    tool_timeout_s: float  # one tool call's wall-clock limit
    tool_memory_limit_gb: float  # address-space limit of the processes that run user tools
    tool_workers: int  # processes that run the function tools (function_tool_path)
    sandbox: str  # auto | bwrap | process: how tool code runs (docs/agents.md says what each contains)
    tool_config_path: str  # verl tool config (yaml/json): tools by class name
    function_tool_path: str  # a Python file whose @function_tool functions become tools
    interaction_config_path: str  # verl interaction config (simulated users)
    format: str  # tool-call format: hermes | llama3_json | qwen3_coder (docs/agents.md)
    tokenization_sanity_check_mode: str  # strict | ignore_strippable | disable
    openai_agent_path: str = ""  # the openai_agent loop's user agent: a .py file or a dotted module (docs/agents.md)
    openai_agent_name: str = "agent"  # the function in openai_agent_path: agent(base_url, session_id, row)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    n: int
    temperature: float
    top_k: int
    top_p: float
    max_concurrent_decodes: int  # engine slots
    steps_per_sync: int  # decode steps on device between host checks
    dtype: str  # "" = same as the actor's compute dtype
    quantization: str  # none | fp8 | int8: the engine's attention and dense-MLP weights, quantized per output channel inside each weight sync (fp8: e4m3 weights and per-token e4m3 activations, an FP8 GEMM on Hopper; int8: weight-only); embeddings, LM head, norms and MoE experts stay in rollout.dtype. Turns algorithm.rollout_correction.rollout_is='auto' into token-level TIS (docs/rollout.md "Low-precision rollout")
    kv_cache_dtype: str  # auto | fp8 (vLLM/verl's name): auto = rollout.dtype; fp8 = the decode KV cache in e4m3 (unscaled, saturated at +-448), half of bf16's bytes, read back in rollout.dtype by attention. Turns algorithm.rollout_correction.rollout_is='auto' into token-level TIS like rollout.quantization (docs/rollout.md "Low-precision rollout")
    use_rollout_log_probs: bool  # reuse the engine's log-probs as old_log_probs (no old-log-prob pass); alias algorithm.rollout_correction.bypass_mode
    log_prob_max_token_len_per_device: int  # actor.use_dynamic_bsz: tokens per device per micro-batch of the old-log-prob pass; 0 = actor.ppo_max_token_len_per_device (verl's log_prob_max_token_len_per_gpu)
    free_cache_engine: bool  # colocate_async: the engine sleeps while the actor trains (its KV cache, and its own weight copy where the layouts differ, are released; held requests are re-prefilled at wake), verl's name; False: it is only suspended
    partial_rollout_kv: str  # recompute | keep: at a weight sync, re-prefill held requests' KV with the new weights (verl) or decode on the old KV
    batch_invariant: bool  # the engine's per-token results (logits, log-probs, sampled tokens) do not depend on which requests share a prefill or decode call or on a request's slot: prefill and chunked-prefill calls always compute a fixed number of rows (rollout.BATCH_INVARIANT_ROWS, padded) and the request-level server prefills every turn in full (no reuse of a session's parked KV, whose survival depends on arrival timing); decode already runs every slot at one shape; the reported log-prob is the trainer's log_softmax(logits / T)[token] formula on the step's logits. Costs padded prefill rows, more prefill calls and multi-turn re-prefill (docs/rollout.md "Batch-invariant decoding")
    replicas_per_host: int  # rollout replicas (an engine + request-level server each) on every host, behind one load balancer (rollout.ReplicaRouter): the host's rollout devices split along the rollout mesh's data axis, its max_concurrent_decodes split evenly among them; > 1 needs the request-level server (rollout.multi_turn or an async trainer.v1.trainer_mode)
    max_inflight_per_replica: int  # the router's bound on requests in flight per replica (more wait in its queue); 0 = the replica's decode slots
    replica_backend: str  # local | process: where each rollout replica (engine + request-level server) runs. local: in the trainer's process, on its devices (weights shared or resharded, no copy through the host). process: each in a child process of its own (rollout.ProcessReplica), so a replica that crashes or is killed does not take the run down: its in-flight requests re-run on the others (same tokens: sampling is keyed by seed, row and step) and it is restarted at the current weights (rollout.replica_max_restarts) or dropped with a warning. Costs: a child start per replica (a fresh interpreter + the engine's compile) and, per weight sync, a device-to-host copy of the rollout weights plus a pipe copy and a host-to-device copy per replica. Needs the request-level server (rollout.multi_turn or an async trainer.v1.trainer_mode) and, for now, one process on CPU (a child needs devices the trainer does not hold)
    replica_max_restarts: int  # rollout.replica_backend=process: how many times each replica is restarted after its process dies (then dropped with a warning; the run goes on while one is left); 0 = dropped at once
    replica_restart_backoff_s: float  # rollout.replica_backend=process: seconds to wait before retrying a replica restart that failed (its child never reported ready, the sync raised), doubled with each failure in a row, at most 60; the first restart after a death starts at once; 0 = retry at once
    val: SamplingConfig
    multi_turn: MultiTurnConfig


@dataclasses.dataclass(frozen=True)
class RefConfig:
    """The reference policy's pass (verl's `actor_rollout_ref.ref`)."""

    log_prob_max_token_len_per_device: int  # actor.use_dynamic_bsz: tokens per device per micro-batch of the reference-log-prob pass; 0 = actor.ppo_max_token_len_per_device (verl's log_prob_max_token_len_per_gpu)


@dataclasses.dataclass(frozen=True)
class KLControlConfig:
    type: str  # fixed | adaptive
    kl_coef: float
    target_kl: float
    horizon: int


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """verl's `algorithm.rollout_correction`: the gap between the engine's policy (stale weights
    under one-step-off-policy, bf16 serving) and the trainer's old log-probs."""

    rollout_is: str  # "" (off) | token | sequence | auto (the default: token when rollout.quantization is fp8/int8 or rollout.kv_cache_dtype is fp8, and rollout.use_rollout_log_probs is off, else off; resolved at load)
    rollout_is_threshold: float
    rollout_is_batch_normalize: bool
    rollout_rs: str  # "" (off) | token | sequence | geometric
    rollout_rs_threshold: float
    rollout_rs_threshold_lower: float  # 0 = 1 / rollout_rs_threshold
    rollout_token_veto_threshold: float  # 0 = off
    bypass_mode: bool  # alias: rollout.use_rollout_log_probs=True (verl's name): the engine's log-probs are pi_old and no old-log-prob pass runs; the engine/trainer mismatch then enters the PPO ratio

    @property
    def enabled(self) -> bool:
        """Whether any correction (IS weights, rejection or veto) is switched on."""
        return bool(self.rollout_is or self.rollout_rs or self.rollout_token_veto_threshold)


@dataclasses.dataclass(frozen=True)
class FilterGroupsConfig:
    """verl's `algorithm.filter_groups` (DAPO dynamic sampling): keep generating batches and keep
    only the prompts whose `rollout.n` responses differ in `metric`, until a step's batch is full."""

    enable: bool
    metric: str  # acc | score | seq_reward | seq_final_reward
    max_num_gen_batches: int  # generation rounds a step may take; 0 = unlimited; async modes: a step may evict (max_num_gen_batches - 1) * data.train_batch_size filtered groups (> 0 there)


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl: KLControlConfig
    rollout_correction: RolloutCorrectionConfig
    filter_groups: FilterGroupsConfig


@dataclasses.dataclass(frozen=True)
class CustomRewardConfig:
    path: str
    name: str


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    """A learned reward model (value-head checkpoint), verl's discriminative RM. Its score is the
    value at each response's last token; it combines with the rule and judge scores by
    reward.rule_weight / reward.model.weight / reward.judge.weight (by default it replaces the rule
    scorers, as verl's `rm_scores` do). It must share the actor's tokenizer. Agent and async
    rollouts score each trajectory in the streaming reward loop as it finishes (one forward over
    the trajectories that finished together); the batch rollout scores the batch after generation."""

    path: str  # "" = no reward model
    weight: float  # the reward model's weight in the combined score (reward.rule_weight's docs)
    micro_batch_size_per_device: int
    use_dynamic_bsz: bool  # verl's: scoring micro-batches up to forward_max_token_len_per_device tokens instead of micro_batch_size_per_device rows (packed under model.use_remove_padding)
    forward_max_token_len_per_device: int  # use_dynamic_bsz: tokens (prompt + response) per device per scoring micro-batch; every row must fit (verl's forward_max_token_len_per_gpu)


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """A generative judge (LLM-as-judge, verl's GenRM): each finished trajectory's question,
    response and ground truth are put into `prompt_template`, sent as one user message (the judge
    tokenizer's chat template) to a rollout server, and `score_parser` reads a score from the reply.
    Agent and async rollouts judge each trajectory as it finishes; the batch rollout judges the
    batch after generation (every row's request at once)."""

    enable: bool  # score each finished trajectory with the judge too (the combination: reward.rule_weight)
    model_path: str  # a checkpoint folder: the judge's own engine and server on the rollout devices, its weights never synced ("frozen"; give model.path's folder to judge with the initial policy); "policy": the policy's rollout server with its current weights (each judgement logs the policy version that wrote it)
    prompt_template: str  # str.format template with {question} (the prompt's last user message), {response} (the whole decoded response, every turn) and {ground_truth}; {response} is required, a literal brace is {{ or }}
    score_parser: str  # last_number | regex:PATTERN (the last match's first group, or the whole match) | a function 'path/to/file.py:name' or 'package.module:name' taking the reply text, returning a float or None
    parse_failure_score: float  # the judge score of a reply the parser reads no number from (counted in reward/judge/parse_failures)
    temperature: float  # the judge's sampling temperature (0 = greedy)
    top_p: float  # the judge's nucleus sampling (1.0 = off)
    max_tokens: int  # the judge reply's token budget
    max_prompt_length: int  # judge prompt tokens; a longer prompt keeps its last tokens (reward/judge/truncated_prompts)
    max_concurrent_decodes: int  # decode slots of the judge's own engine (model_path a checkpoint)
    weight: float  # the judge's weight in the combined score (reward.rule_weight's docs)
    log_every: int  # every N-th judgement (prompt, reply, score, policy version) appended to <trainer.default_local_dir>/judge_generations.jsonl; 0 = none


@dataclasses.dataclass(frozen=True)
class OverlongBufferConfig:
    """verl's `reward_model.overlong_buffer` (DAPO): a response longer than
    `data.max_response_length - len` tokens loses up to `penalty_factor` of score, linearly."""

    enable: bool
    len: int  # tokens before data.max_response_length where the penalty starts
    penalty_factor: float  # the penalty at data.max_response_length


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    num_workers: int  # 0 = score in-process (no timeout protection)
    timeout_s: float
    max_error_fraction: float  # stop when more of a batch's scores fail (error/timeout/non-finite)
    max_consecutive_timeouts: int  # stop after this many scoring calls in a row time out; 0 = never
    max_consecutive_worker_deaths: int  # stop after this many scoring processes in a row die; 0 = never
    memory_limit_gb: float  # address-space limit of each scoring process; 0 = none
    sandbox: str  # auto | bwrap | process: contains the scoring processes (num_workers=0: built-ins in-process, uncontained)
    custom_reward_function: CustomRewardConfig
    rule_weight: float  # the rule scorers' / custom function's weight: score = rule_weight x rule + model.weight x reward model + judge.weight x judge (the sources that are on); 0 = the rule scorers are not called; -1 = auto: 1 without a reward model or judge, else 0 (they replace the rule, as verl's rm_scores do)
    model: RewardModelConfig
    judge: JudgeConfig
    overlong_buffer: OverlongBufferConfig


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int
    fsdp: int
    tensor: int
    context: int  # context-parallel axis (training passes only): each sequence's tokens split over this many devices, attention all-to-all under shard_map (docs/scaling.md §2, "Long sequences"); parameters FSDP-sharded over fsdp x context; 1 = off; must be 1 in placement.rollout_mesh


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Where the rollout engine lives. `colocated` (default, verl's hybrid engine): on the training
    devices, weights synced in place; `rollout_mesh` 1x1x1 means the training mesh itself, another
    shape re-meshes the same devices (e.g. fsdp for training, tensor-parallel decode). `separate`:
    on its own devices, the last `rollout_mesh` devices (no -1) of every host (one engine replica
    per host on several hosts); the training roles get the rest of every host; sync copies across
    meshes. `one_step_off_policy` is an alias of `trainer.v1.trainer_mode='separate_async'` with
    `num_warmup_batches=1`, `max_off_policy_threshold=1` (resolved when the config loads)."""

    mode: str  # colocated | separate
    rollout_mesh: MeshSection
    one_step_off_policy: bool  # alias: trainer.v1.trainer_mode=separate_async, colocate_async.num_warmup_batches=1, sampler.max_off_policy_threshold=1


@dataclasses.dataclass(frozen=True)
class AsyncTrainingConfig:
    """Fully asynchronous training (verl's fully_async_policy), today's names for
    `trainer.v1.trainer_mode='separate_async'` with the rollouter: it keeps generating groups on
    the rollout server while the trainer trains on finished ones. All but `partial_rollout` are
    aliases of `trainer.v1` fields, resolved when the config loads (only the `trainer.v1` fields
    drive the run; an alias and its field set to different values is an error naming both); see
    each field. `partial_rollout`: at a sync, running requests keep their tokens and continue with
    the new weights instead of being waited for (needs a run-ahead > 0)."""

    enable: bool  # alias: trainer.v1.trainer_mode=separate_async
    staleness_threshold: float  # alias: trainer.v1.colocate_async.num_warmup_batches=s and trainer.v1.sampler.max_off_policy_threshold=ceil(s)
    trigger_parameter_sync_step: int  # alias: must be 1 (a trainer.v1 step is one sync interval: raise data.train_batch_size instead)
    require_batches: int  # alias: trainer.v1.separate_async.parameter_sync_step (require_batches x actor.ppo_mini_batch_size must equal data.train_batch_size)
    partial_rollout: bool


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start before RL (`steps == 0` disables it)."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    max_length: int
    train_files: tuple[str, ...]  # "" = built-in task rows (data.builtin_task)
    messages_key: str
    builtin_size: int
    builtin_off_by_one: float  # arithmetic demos: fraction whose answer is off by one (imperfect data)
    builtin_trailing_junk: float  # arithmetic demos: fraction whose answer ends with a stray "."
    builtin_no_tool: float  # arithmetic_tools demos: fraction answered directly, without the calculator


@dataclasses.dataclass(frozen=True)
class ColocateAsyncConfig:
    """verl V1's `colocate_async` section."""

    num_warmup_batches: float  # training batches whose generation may start before training needs them (fractional, as verl: 1.5 = one and a half); the async modes' run-ahead (separate_async too: verl fully async's staleness_threshold)


@dataclasses.dataclass(frozen=True)
class SeparateAsyncConfig:
    """verl V1's `separate_async` section."""

    parameter_sync_step: int  # actor mini-batch updates between two weight syncs: data.train_batch_size = parameter_sync_step x actor.ppo_mini_batch_size (verl's invariant; a trainer step is one sync interval); 0 = data.train_batch_size / actor.ppo_mini_batch_size


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """verl V1's replay-buffer sampler: how old a trained token may be, and how many failed
    groups the replay buffer may replace per step."""

    max_off_policy_threshold: int  # model versions (weight syncs) a trained token may lag the trainer's policy; -1 (None in a config file or on the command line) = no bound (the largest lag K; the replay buffer counts it as verl's span of K + 1 versions, both ends included)
    max_off_policy_strategy: str  # drop (regenerate a group that is too old) | wait (train no such group: wait for in-flight groups to finish within the bound)
    max_failed_groups: int  # groups whose agent loop raised or whose reward failed (error / timeout) the rollouter may evict and replace with a new prompt per step (the groups finished between two takes); one more fails the step naming this field; 0 = no eviction: a failed agent loop fails the step, failed rewards are left to reward.max_error_fraction. Rollouter modes only (colocate_async, separate_async with the rollouter). On several processes each host's rollouter allows ceil(this / processes)
    max_failed_fraction: float  # with max_failed_groups > 0: at most floor(this x data.train_batch_size) such groups per step as well, in [0, 1]


@dataclasses.dataclass(frozen=True)
class TrainerV1Config:
    """verl V1's trainer modes (docs/concepts.md, 'Trainer modes'). `sync`: generate, train, sync
    weights, in turn. `colocate_async`: on the training devices (placement.mode='colocated'),
    generation of the next batches starts before training needs them; when a batch is ready the
    unfinished requests are suspended over the update and the weight sync and resume with their
    tokens kept (partial rollout). `separate_async`: generation on its own devices
    (placement.mode='separate') runs while the actor trains. Aliases: `async_training.*`,
    `placement.one_step_off_policy`."""

    trainer_mode: str  # sync | colocate_async | separate_async
    colocate_async: ColocateAsyncConfig
    separate_async: SeparateAsyncConfig
    sampler: SamplerConfig
    deterministic_schedule: bool  # colocate_async / separate_async with the rollouter: which groups train at which step and which policy version generates each follow from counters, not timing (take t trains feed positions t*k .. t*k+k-1, waiting for them; a group starts only in the sync interval its position allows; a sync waits for running groups to finish, so partial rollout does not apply): with rollout.batch_invariant, two runs and a kill -9 + resume give bit-identical weights and metrics (docs/reliability.md). No group eviction: needs algorithm.filter_groups.enable=False and sampler.max_failed_groups=0. sync and the one-step-off pipeline are deterministic without it


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    backend: str  # ray | local
    total_training_steps: int
    save_freq: int  # 0 = only at the end
    test_freq: int  # 0 = only at the end
    val_before_train: bool
    val_only: bool  # validate (no training) and exit
    log_val_generations: int  # validation samples written per validation (0 = none)
    default_local_dir: str
    resume_mode: str  # auto | disable | <checkpoint path>
    max_to_keep: int
    max_nonfinite_steps: int  # stop after this many consecutive steps with a skipped NaN/inf update
    async_save: bool
    export_hf: bool  # save the actor as a Hugging Face folder at the end
    keep_best_val_metric: str  # a validation metric (e.g. "val-core/<source>/reward/mean@1"): after each validation that raises it (higher is better), the actor goes to <run>/hf_best/ with best.json (step, value); "" = off
    logger: tuple[str, ...]
    project_name: str
    experiment_name: str
    seed: int
    progress_bar: bool
    plot: bool
    v1: TrainerV1Config


@dataclasses.dataclass(frozen=True)
class RunConfig:
    data: DataConfig
    model: ModelSection
    actor: ActorConfig
    critic: CriticConfig
    ref: RefConfig
    rollout: RolloutConfig
    algorithm: AlgorithmConfig
    reward: RewardConfig
    mesh: MeshSection
    placement: PlacementConfig
    async_training: AsyncTrainingConfig
    sft: SFTConfig
    trainer: TrainerConfig

    @property
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def rollout_source(self) -> str:
        """Which rollout source runs `trainer.v1.trainer_mode` (jaxrl_llm/trainer/_sources.py):
        `sync`; `colocated_buffer` (colocate_async: the rollouter on the training devices);
        `one_step_off` (separate_async one batch ahead with a bound of one version, batch driver,
        no agent loop or partial rollout: also on several hosts); `buffer` (any other
        separate_async: the rollouter and its trajectory queue, one per host on several hosts)."""
        v1 = self.trainer.v1
        if v1.trainer_mode == "sync":
            return "sync"
        if v1.trainer_mode == "colocate_async":
            return "colocated_buffer"
        if (not self.rollout.multi_turn.enable and not self.async_training.partial_rollout
                and v1.colocate_async.num_warmup_batches == 1 and v1.sampler.max_off_policy_threshold == 1):
            return "one_step_off"
        return "buffer"

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
