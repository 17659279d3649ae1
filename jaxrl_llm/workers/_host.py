"""One host's share of the run: every role's state on this host's devices.

With the Ray backend there is one `HostWorker` actor per host and the controller calls each
method on all of them (JAX multi-controller: every host runs the same jitted programs). With the
local backend the controller holds one `HostWorker` in-process. Arguments and results are host
numpy and plain Python only; global `jax.Array`s never leave this object. Batches arrive as
`data.Batch` (verl's fields, checked), sampling settings as `rollout.SamplingParams`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import pickle
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import rollout
import sharding
from jaxrl_llm import agent, models, rewards
from jaxrl_llm.data import Batch, RolloutResult
from jaxrl_llm.checkpoint import Checkpointer, checkpoint_root
from jaxrl_llm.config import ConfigError, RunConfig

from ._common import build_model, data_parallel_size, model_config_for
from ._replica_process import build_server, spec_for
from ._replica_process import host_params as _host_copy
from ._roles import ActorWorker, CriticWorker, ReferenceWorker, RewardModelWorker, SFTWorker, token_budget

log = logging.getLogger(__name__)
_RESTART_WAIT_S = 300.0  # sync_weights (process replicas): how long it waits for a replica's restart


class HostWorker:
    """All roles of one host. Phases: optional SFT (`sft_step`), then `start_rl`, then RL calls."""

    def __init__(self, config: RunConfig, *, vocab_size: int, pad_token_id: int,
                 stop_token_ids: tuple[int, ...], distributed: dict | None = None):
        if distributed:
            sharding.initialize_distributed(**distributed)
        self.config = c = config
        self.vocab_size, self.pad_token_id, self.stop_token_ids = vocab_size, pad_token_id, stop_token_ids
        self.mesh, self.rollout_mesh = _meshes(c)
        # several hosts: one rollout replica per host, stacked into one mesh that the weights
        # move onto (each host keeping its own). Separate placement: the host's rollout devices;
        # colocated with the request-level server (agent loops, the async modes): the host's
        # own devices (the training mesh spans the hosts, a server's engine cannot). None on one
        # host and for a colocated batch rollout (its engine runs on the training mesh, SPMD).
        # rollout.replicas_per_host = k > 1: every host's replica split into k along its data
        # axis, each an engine + server behind one router (`rollout.ReplicaRouter`), on one host too
        k = c.rollout.replicas_per_host
        replicas = _rollout_replicas(c) if jax.process_count() > 1 or k > 1 else None
        if replicas and k > 1:
            replicas = [part for mesh in replicas for part in _split_replica(mesh, k)]
        me = jax.process_index()
        # this host's replica meshes (one engine each); the first is `rollout_mesh`
        self.rollout_meshes = replicas[me * k:(me + 1) * k] if replicas else [self.rollout_mesh]
        self.rollout_mesh = self.rollout_meshes[0]
        self.replica_mesh = sharding.replica_mesh(replicas) if replicas else None
        # colocated replicas share devices with the training mesh: resharded, not transferred
        self._shared_replicas = bool(replicas) and c.placement.mode == "colocated"
        self._deferred = None  # this host's share of a rollout generated in the background
        self._model = build_model(c.model, vocab_size=vocab_size, mesh=self.mesh)
        self._sft = None
        self.actor = self.ref = self.critic = self.engine = self.driver = self.reward_model = None
        self.engines: list = []  # one per replica of this host; `engine` is the first
        # the request-level server (a `ReplicaRouter` over several replicas) and agent loops
        self.server = self._agents = None
        self._judge_server = None  # reward.judge's own server (a judge checkpoint), built with the agents
        self._batch_judge = None  # reward.judge for the batch rollout (`compute_judge_scores`)
        self._rollouter = None  # the asynchronous modes' background producer
        self.checkpointer = Checkpointer(
            checkpoint_root(c.trainer.default_local_dir), max_to_keep=c.trainer.max_to_keep,
            async_save=c.trainer.async_save, enable=True)

    # -- info -------------------------------------------------------------------------------
    def info(self) -> dict:
        cfg = self._model_config()
        params = nnx.state(self._model) if self._model is not None else self.actor.params
        return {
            "num_params": models.count_params(params), "num_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size, "num_devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind, "process_count": jax.process_count(),
        }

    def _model_config(self):
        if self._model is not None:
            return self._model.config
        return self.actor.model().config

    # -- SFT warm start --------------------------------------------------------------------------
    def sft_step(self, batch: Batch) -> dict[str, float]:
        _check_batch(batch, "sft_step")
        if self._sft is None:
            s = self.config.sft
            optim = self.config.actor.optim.__class__(
                lr=s.lr, weight_decay=0.0, weight_decay_1d=False, betas=(0.9, 0.98), eps=1e-8,
                warmup_steps=s.warmup_steps, lr_schedule="cosine", min_lr_ratio=0.1, clip_grad=1.0)
            self._sft = SFTWorker(self._model, optim, mesh=self.mesh, total_steps=s.steps,
                                  micro_per_device=max(s.batch_size, 1))
        return self._sft.step(batch)

    # -- RL set-up -----------------------------------------------------------------------------
    def start_rl(self, total_steps: int) -> dict:
        """Builds actor (from the SFT result if any), reference, critic and the rollout engine."""
        c = self.config
        multi_turn = c.rollout.multi_turn.enable
        rollouter = c.rollout_source in ("buffer", "colocated_buffer")
        _check_rollouter_split(c, jax.process_count())
        self._sft_ran = self._sft is not None
        if self._sft is not None:
            self._model = self._sft.model()
            self._sft = None
        lora = c.actor.lora
        if lora.enabled:  # adapters on the (possibly SFT-tuned) model; it becomes the frozen base
            self._lora_base = self._base_reference()
            models.add_lora(self._model, models.LoraSpec(lora.rank, lora.alpha, lora.target_modules),
                            seed=c.trainer.seed, mesh=self.mesh)
        graphdef, params = nnx.split(self._model)
        self.actor = ActorWorker(self._model, c.actor, mesh=self.mesh, total_steps=total_steps,
                                 temperature=c.rollout.temperature,
                                 log_prob_max_tokens=c.rollout.log_prob_max_token_len_per_device,
                                 ref_log_prob_max_tokens=c.ref.log_prob_max_token_len_per_device,
                                 remove_padding=c.model.use_remove_padding, moe=c.model.moe)
        if c.use_reference and not lora.enabled:  # under LoRA the actor's base is the reference
            self.ref = ReferenceWorker(graphdef, params, mesh=self.mesh, temperature=c.rollout.temperature,
                                       micro_per_device=c.actor.ppo_micro_batch_size_per_device,
                                       budget=self.actor.ref_log_prob_budget,
                                       remove_padding=c.model.use_remove_padding)
        if c.use_critic:
            critic_model = build_model(c.model, vocab_size=self.vocab_size, mesh=self.mesh, value_head=True)
            self.critic = CriticWorker(critic_model, c.critic, mesh=self.mesh, total_steps=total_steps,
                                       remove_padding=c.model.use_remove_padding)
        if c.reward.model.path:
            rm = models.from_pretrained(c.reward.model.path, dtype=c.model.dtype, param_dtype=c.model.param_dtype,
                                        value_head=True, mesh=self.mesh)
            rm_budget = token_budget(c.reward.model.use_dynamic_bsz, c.reward.model.forward_max_token_len_per_device,
                                     "reward.model.forward_max_token_len_per_device")
            self.reward_model = RewardModelWorker(rm, mesh=self.mesh,
                                                  micro_per_device=c.reward.model.micro_batch_size_per_device,
                                                  budget=rm_budget, remove_padding=c.model.use_remove_padding)
        self._model = None
        # agent rollouts prefill whole conversations (prompt + every turn so far) and then
        # generate what is left of the response budget
        prefill = rollout.prefill_bucket(c.data.max_prompt_length + (c.data.max_response_length if multi_turn else 0))
        source = ((self.actor.graphdef, self.actor.params) if not lora.enabled
                  else models.merged_model(self.actor.model()))
        slots = c.rollout.max_concurrent_decodes // len(self.rollout_meshes)  # the host's, split evenly
        engine_kw = dict(max_concurrent_decodes=slots, max_prefill_length=prefill,
                         max_target_length=prefill + c.data.max_response_length,
                         dtype=c.rollout.dtype or c.model.dtype, temperature=c.rollout.temperature,
                         top_k=c.rollout.top_k, top_p=c.rollout.top_p, seed=c.trainer.seed,
                         stop_token_ids=self.stop_token_ids, pad_token_id=self.pad_token_id,
                         batch_invariant=c.rollout.batch_invariant,
                         quantization=c.rollout.quantization, kv_cache_dtype=c.rollout.kv_cache_dtype)
        if c.rollout.replica_backend == "process":  # each replica a child process (no engine here)
            self._start_process_replicas(engine_kw)
            return self.sync_weights()  # the children start on zero weights
        layout, sources = "auto", [source]
        if self.replica_mesh is not None:  # this host's replicas, the weights moved onto each
            sources = []
            for tree in self._to_replicas(self.actor.rollout_params(self._rollout_dtype())):
                graphdef, abstract = nnx.split(models.abstract_model(self._model_config_for_rollout()), nnx.Param)
                nnx.replace_by_pure_dict(abstract, tree)
                sources.append((graphdef, abstract))
            # the layout auto picks on one host for weights on other devices (no sharing there)
            layout = "per_layer"
        # actor.router_replay: the batch driver's engines record every token's experts
        self.engines = [rollout.Engine.from_model(src, mesh=mesh, layer_layout=layout,
                                                  record_experts=c.actor.router_replay.record, **engine_kw)
                        for src, mesh in zip(sources, self.rollout_meshes)]
        self.engine = self.engines[0]
        self.driver = rollout.RolloutDriver(self.engine, steps_per_sync=c.rollout.steps_per_sync)
        if multi_turn or rollouter:
            servers = [rollout.RolloutServer(e, steps_per_sync=c.rollout.steps_per_sync,
                                             partial_rollout_kv=c.rollout.partial_rollout_kv)
                       for e in self.engines]
            self.server = servers[0] if len(servers) == 1 else rollout.ReplicaRouter(
                servers, max_inflight_per_replica=c.rollout.max_inflight_per_replica or None)
        return self.sync_weights()

    def _start_process_replicas(self, engine_kw: dict) -> None:
        """rollout.replica_backend="process": this host's replicas, each a `rollout.ProcessReplica`
        whose child builds the engine + server on the devices of the in-process replica it stands
        for (`_replica_process`; zero weights until the first sync), behind a `ReplicaRouter` that
        restarts a dead one (a new child, synced by the router with the tree of the last sync
        before it takes requests) up to rollout.replica_max_restarts times. No engine in this
        process (`engine`, `driver`: None)."""
        c = self.config
        if jax.process_count() > 1 or jax.default_backend() != "cpu":
            raise ConfigError(
                f"rollout.replica_backend='process' runs on one process on CPU for now (this run: "
                f"{jax.process_count()} process(es) on {jax.default_backend()}): a replica's child needs "
                "devices that the trainer's process does not hold, and on GPU/TPU the trainer claims every "
                "visible device; use rollout.replica_backend='local'")
        model_config = self._model_config_for_rollout()
        server_kw = dict(steps_per_sync=c.rollout.steps_per_sync, partial_rollout_kv=c.rollout.partial_rollout_kv)

        def start(i: int) -> rollout.ProcessReplica:  # also the router's restart (it then syncs it)
            spec = spec_for(self.rollout_meshes[i], model_config=model_config, engine=engine_kw, server=server_kw)
            return rollout.ProcessReplica(functools.partial(build_server, spec), name=f"rollout-replica-{i}")

        with concurrent.futures.ThreadPoolExecutor(len(self.rollout_meshes)) as pool:  # children start together
            started = [pool.submit(start, i) for i in range(len(self.rollout_meshes))]
        if any(f.exception() is not None for f in started):
            for f in started:
                if f.exception() is None:
                    f.result().close()
            raise next(f.exception() for f in started if f.exception() is not None)
        self.server = rollout.ReplicaRouter(
            [f.result() for f in started], max_inflight_per_replica=c.rollout.max_inflight_per_replica or None,
            restart=start, max_restarts=c.rollout.replica_max_restarts,
            restart_backoff_s=c.rollout.replica_restart_backoff_s)

    # -- the RL step's calls -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], *, n: int, max_new_tokens: int, sampling: rollout.SamplingParams,
                 seed: int, gather: bool = True) -> RolloutResult | None:
        """`n` samples of each prompt (prompt i's are rows i*n .. i*n+n-1). With a rollout
        replica per host each host generates its share of the prompts (row r samples as row r
        of one engine would); `gather=False` (a rollout in the background: no collectives there)
        keeps the share until `collect_rollout` gathers every host's, and returns None."""
        t0 = time.perf_counter()
        width = max(len(p) for p in prompts)  # routed_experts' prompt columns, the same on every host
        if self.replica_mesh is None:
            out = self.driver.generate(prompts, n=n, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)
            result = RolloutResult(
                responses=out.responses, response_mask=out.response_mask,
                rollout_log_probs=out.rollout_log_probs, response_lengths=out.response_lengths,
                finish_reasons=tuple(out.finish_reasons), prompt_index=out.prompt_index,
                routed_experts=out.routed_experts, time_s=time.perf_counter() - t0)
            if not gather:
                self._deferred = result
                return None
            return result
        per = -(-len(prompts) // jax.process_count())  # prompts per host (the last ones padded)
        lo = jax.process_index() * per
        share = (list(prompts[lo:lo + per]) + [prompts[0]] * per)[:per]
        out = self.driver.generate(share, n=n, max_new_tokens=max_new_tokens, sampling=sampling,
                                   seed=seed, row_offset=lo * n, prompt_width=width)
        if not gather:
            self._deferred = (out, len(prompts), n, time.perf_counter() - t0)
            return None
        return _gather_shares(out, len(prompts), n).replace(time_s=time.perf_counter() - t0)

    def collect_rollout(self) -> RolloutResult:
        """The last `generate(gather=False)`'s rollout, with every host's share (an all-gather
        over the hosts: call it when that generate has returned); `time_s` is its duration."""
        deferred, self._deferred = self._deferred, None
        if isinstance(deferred, RolloutResult):
            return deferred
        out, num_prompts, n, took = deferred
        return _gather_shares(out, num_prompts, n).replace(time_s=took)

    def agent_generate(self, samples: list[dict], *, sampling: rollout.SamplingParams, seed: int) -> RolloutResult:
        """Agent rollouts of `samples` (`agent.AgentSample` fields) on the request-level server,
        each trajectory scored as it finishes (`scores`, `reward_extra`, `metrics` set)."""
        t0 = time.perf_counter()
        runner = self._agent_runner()
        samples = [agent.AgentSample(**s) for s in samples]
        if jax.process_count() == 1:
            out = runner.run(samples, sampling=sampling, seed=seed)
            return _agent_result(out, self._replica_metrics(), time_s=time.perf_counter() - t0)
        # a replica per host: this host runs its block of rows (as `generate` splits prompts; a
        # row samples by (seed, row), wherever it runs), then every host collates all rows
        per = -(-len(samples) // jax.process_count())
        lo = jax.process_index() * per
        mine = asyncio.run(runner.arun_results(samples[lo:lo + per], sampling=sampling, seed=seed))
        results = [r for share in _allgather_objects(mine) for r in share]
        return _agent_result(runner.collate(samples, results), self._replica_metrics(),
                             time_s=time.perf_counter() - t0)

    def _replica_metrics(self) -> dict[str, float]:
        """The router's per-replica and balance metrics since the last call (`ReplicaRouter.metrics`;
        none with one replica a host). Several hosts: every host's, replica i of host h numbered
        h x replicas_per_host + i, the router's counts added, stickiness the hosts' mean and the
        imbalances over all replicas (call it on every host: an all-gather)."""
        if not isinstance(self.server, rollout.ReplicaRouter):
            return {}
        mine = self.server.metrics()
        if jax.process_count() == 1:
            return mine
        return _merge_replica_metrics(_allgather_objects(mine), self.config.rollout.replicas_per_host)

    def _agent_runner(self) -> "agent.AgentRunner":
        if self._agents is None:
            c = self.config
            custom = c.reward.custom_reward_function
            custom_fn = rewards.load_custom_reward_fn(custom.path, custom.name) if custom.path else None
            r = c.reward
            # one row per call: the error-fraction breaker is the runner's, over the whole batch
            manager = rewards.RewardManager(num_workers=r.num_workers, timeout_s=r.timeout_s,
                                            custom_fn=custom_fn, max_error_fraction=1.0,
                                            max_consecutive_timeouts=r.max_consecutive_timeouts,
                                            max_consecutive_worker_deaths=r.max_consecutive_worker_deaths,
                                            memory_limit_gb=r.memory_limit_gb, sandbox=r.sandbox)
            self._agents = agent.AgentRunner(
                self.server, models.load_tokenizer(c.model.tokenizer or c.model.path),
                c.rollout.multi_turn, max_prompt_length=c.data.max_prompt_length,
                max_response_length=c.data.max_response_length, pad_token_id=self.pad_token_id,
                reward_loop=self._reward_loop(manager), max_error_fraction=r.max_error_fraction)
        return self._agents

    def _reward_loop(self, manager: "rewards.RewardManager") -> "rewards.RewardLoop":
        """The streaming reward loop: the rule scorers (`manager`), the reward model as a
        scoring service over this host's `RewardModelWorker` (one forward per set of trajectories
        that finished together) and the judge, combined by reward.rule_weight / model.weight /
        judge.weight."""
        r = self.config.reward
        weights = rewards.RewardWeights(
            rule=rewards.resolve_rule_weight(r.rule_weight, has_model=bool(r.model.path),
                                             has_judge=r.judge.enable),
            model=r.model.weight, judge=r.judge.weight)
        model = judge = None
        if r.model.path:
            if jax.process_count() > 1:
                raise ConfigError(
                    "reward.model.path with agent or asynchronous rollouts scores each trajectory as it "
                    f"finishes, on one process for now (this run: {jax.process_count()}): the reward "
                    "model's forward spans the training mesh of every host; use the batch rollout "
                    "(rollout.multi_turn.enable=False, trainer.v1.trainer_mode='sync')")
            rm = self.reward_model
            model = rewards.RewardModelService(
                lambda batch: rm.compute_rm_score(batch)["rm_scores"].sum(-1),
                max_prompt_length=self.config.data.max_prompt_length,
                max_response_length=self.config.data.max_response_length, pad_token_id=self.pad_token_id,
                row_multiple=data_parallel_size(rm.mesh) * rm.micro_per_device)
        if r.judge.enable:
            judge = self._judge()
        return rewards.RewardLoop(manager, model=model, judge=judge, weights=weights)

    def _judge(self) -> "rewards.Judge":
        """reward.judge: requests to the policy's server (model_path 'policy') or to a server of
        its own over the judge checkpoint on this host's rollout devices (never synced)."""
        c, j = self.config, self.config.reward.judge
        if j.model_path == "policy":
            server = self.server
            tokenizer = models.load_tokenizer(c.model.tokenizer or c.model.path)
        else:
            bucket = rollout.prefill_bucket(j.max_prompt_length)
            try:
                engine = rollout.Engine.from_pretrained(
                    j.model_path, max_concurrent_decodes=j.max_concurrent_decodes, max_prefill_length=bucket,
                    max_target_length=bucket + j.max_tokens, dtype=c.rollout.dtype or c.model.dtype,
                    temperature=j.temperature, top_p=j.top_p, seed=c.trainer.seed, mesh=self.rollout_mesh)
            except ValueError as e:  # e.g. heads that the rollout mesh's tensor axis does not divide
                raise ConfigError(f"reward.judge.model_path={j.model_path!r} cannot be served on the rollout "
                                  f"devices ({e})") from None
            server = self._judge_server = rollout.RolloutServer(engine, steps_per_sync=c.rollout.steps_per_sync)
            tokenizer = models.load_tokenizer(j.model_path)
        return rewards.Judge(
            server, tokenizer, template=j.prompt_template, parser=rewards.make_score_parser(j.score_parser),
            sampling=rollout.SamplingParams(temperature=j.temperature, top_p=j.top_p),
            max_new_tokens=j.max_tokens, max_prompt_length=j.max_prompt_length, seed=c.trainer.seed,
            failure_score=j.parse_failure_score, log_every=j.log_every,
            log_path=os.path.join(c.trainer.default_local_dir, "judge_generations.jsonl"))

    # -- fully asynchronous training (async_training) --------------------------------------------
    def _async(self) -> "agent.Rollouter":
        if self._rollouter is None:
            c, v1 = self.config, self.config.trainer.v1
            lag = v1.sampler.max_off_policy_threshold  # the largest lag K in versions; -1 = none
            hosts = jax.process_count()  # each host's rollouter: its share of a step's groups
            fg = c.algorithm.filter_groups  # DAPO dynamic sampling: evict a group whose rewards all agree
            dapo = dict(group_filter=agent.dapo_group_filter(fg.metric),
                        max_filtered_groups=((fg.max_num_gen_batches - 1) * c.data.train_batch_size // hosts
                                             if fg.max_num_gen_batches > 0 else None),
                        filter_budget_source="algorithm.filter_groups.max_num_gen_batches="
                                             f"{fg.max_num_gen_batches}: (this - 1) x data.train_batch_size"
                                             + (f" / {hosts} processes, per host" if hosts > 1 else "")
                        ) if fg.enable else {}
            self._rollouter = agent.Rollouter(
                self._agent_runner(),
                sampling=rollout.SamplingParams.from_config(c.rollout),
                groups_per_sync=c.data.train_batch_size // hosts,  # a step is one sync interval
                staleness_threshold=v1.colocate_async.num_warmup_batches,
                # colocate_async holds the unfinished requests over every update and sync
                partial_rollout=c.async_training.partial_rollout or c.rollout_source == "colocated_buffer",
                version=self.server.policy_version,
                # the Rollouter counts verl's way: the versions a group spans, both ends (K + 1)
                max_off_policy_threshold=None if lag < 0 else lag + 1,
                max_off_policy_strategy=v1.sampler.max_off_policy_strategy,
                # failed agent loops / rewards: evicted and replaced by a fed prompt, within a budget
                # (each host's share: ceil; a share of 0 would turn eviction off)
                max_failed_groups=-(-v1.sampler.max_failed_groups // hosts),
                max_failed_fraction=v1.sampler.max_failed_fraction,
                config_prefix="trainer.v1.sampler.", **dapo,
                # counter-based schedule; each host's share is every hosts-th group index
                deterministic=v1.deterministic_schedule, index_stride=hosts)
        return self._rollouter

    def async_feed(self, groups: list[dict]) -> None:
        """Prompts for the rollouter (`agent.PromptGroup` fields), generated in the background.
        With several hosts each host's rollouter gets the groups of index = its process index
        modulo the process count (a row samples by (seed, row) wherever it runs)."""
        hosts, me = jax.process_count(), jax.process_index()
        self._async().feed([agent.PromptGroup(**g) for g in groups if g["index"] % hosts == me])

    def async_take(self, k: int, *, max_staleness: int | None) -> RolloutResult:
        """Blocks until `k` groups are finished and returns them (rows by prompt index) with
        the group bookkeeping (`samples`, `group_index`, `group_min_version` /
        `group_max_version`), the server's `policy_version`, `wait_s` and the rollouter's
        counters (`producer`)."""
        r, hosts = self._async(), jax.process_count()  # k: a step's groups (start_rl checked k % hosts)
        t0 = time.perf_counter()
        taken = r.take_batch(k // hosts, max_staleness=max_staleness)  # + verl's off-policy metrics
        groups, metrics, producer = taken.groups, taken.metrics, r.stats()
        wait = time.perf_counter() - t0
        if hosts > 1:  # every host's share, and the take's metrics over all of them
            shares = _allgather_objects((groups, taken.window, producer, wait))
            groups = [g for share in shares for g in share[0]]
            metrics = agent.take_metrics(groups, int(r.version), agent.merge_windows(s[1] for s in shares))
            producer = _merge_producer_stats([s[2] for s in shares])
            wait = max(s[3] for s in shares)
        groups = sorted(groups, key=lambda g: g.prompt.index)
        samples = [agent.AgentSample(**g.prompt.sample, row=g.prompt.first_row + j)
                   for g in groups for j in range(g.prompt.n)]
        out = self._agent_runner().collate(samples, [res for g in groups for res in g.results])
        return _agent_result(
            out, samples=tuple(g.prompt.sample for g in groups),
            group_index=np.asarray([g.prompt.index for g in groups], np.int32),
            group_min_version=np.asarray([g.min_version for g in groups], np.int32),
            group_max_version=np.asarray([g.max_version for g in groups], np.int32),
            policy_version=int(r.version), wait_s=wait, producer=producer, time_s=wait,
            extra_metrics={**metrics, **self._replica_metrics()})

    def async_sync(self) -> dict:
        """A weight sync under the rollouter: pause it (without partial rollout: until its
        running groups end), sync the server, resume the server (after `async_hold`) and the
        rollouter with the new policy version."""
        r = self._async()
        wait = r.pause()
        stats = self.sync_weights()
        self._resume_server()
        r.resume(self.server.policy_version)
        return {**stats, "pause_wait_s": wait}

    def async_hold(self) -> dict:
        """colocate_async, before the actor trains on the engine's devices: the rollouter admits
        no group (its running requests stay in their slots with their tokens and log-probs:
        partial rollout) and the server stops decoding until `async_sync` / `async_release`:
        with `rollout.free_cache_engine` it sleeps (KV cache, and the engine's own weight copy
        where it has one, released for the update; `kv_bytes_released`), else it is suspended."""
        r = self._async()
        r.pause()  # partial rollout: returns at once
        released = 0
        if self.config.rollout.free_cache_engine:
            released = int(self.server.sleep().get("kv_bytes", 0))
        else:
            self.server.suspend()
        held = int(r.stats()["running"])
        if jax.process_count() > 1:  # every host's rollouter holds its own; kv_bytes: this replica's
            held = sum(_allgather_objects(held))
        return {"held_groups": held, "suspended": True, "kv_bytes_released": released}

    def async_release(self) -> None:
        """Ends an `async_hold` without a weight sync (a step without an actor update): a server
        that released its weights while asleep gets the same weights (same version) back."""
        if self.server.asleep:
            self.sync_weights(version=self.server.policy_version)
        self._resume_server()
        self._async().resume(self.server.policy_version)

    def _resume_server(self) -> None:
        """Ends an `async_hold`'s sleep or suspension (the server's own state says which)."""
        if self.server.asleep:
            self.server.wake()  # re-prefills the held requests with the current weights
        elif self.server.suspended:
            self.server.resume()

    def async_state(self) -> dict:
        """The rollouter's checkpoint state plus the policy version (see `agent.Rollouter.state`).
        Several hosts: every host's state merged (`queued` / `pending` / counters of all of them,
        what the trainer reads) plus each host's own under `hosts` (what a resume restores)."""
        state = {**self._async().state(), "policy_version": int(self.server.policy_version)}
        if jax.process_count() == 1:
            return state
        return _merge_async_states(_allgather_objects(state))

    def async_restore(self, state: dict) -> None:
        """After `restore_checkpoint`: the saved policy version (to every host's replica), queue
        and unfinished prompts. A state saved with another number of hosts is split again by
        group index (as `async_feed` splits)."""
        self.sync_weights(version=int(state["policy_version"]))
        hosts, me = jax.process_count(), jax.process_index()
        saved = state.get("hosts")
        if saved is not None and len(saved) == hosts:
            mine = saved[me]
        else:
            mine = _split_async_state(state, me, hosts)
        self._async().restore(mine)

    def compute_old_log_prob(self, batch: Batch) -> dict[str, np.ndarray]:
        """{"old_log_probs", "entropys"} [B, t]."""
        _check_batch(batch, "compute_old_log_prob")
        return self.actor.compute_log_prob(batch)

    def compute_engine_log_prob(self, batch: Batch) -> dict[str, np.ndarray]:
        """{"old_log_probs"} [B, t] from the rollout engine (actor.old_log_prob_pass='engine'): each
        row's prompt prefilled and its response fed through the decode loop, in the programs the
        rollout ran (`RolloutDriver.teacher_force`), with the weights of the last sync (the ones
        the update starts from in the sync trainer mode). With several hosts every host scores
        every row on its own replica (the same numbers: batch-invariant programs)."""
        _check_batch(batch, "compute_engine_log_prob")
        if self.driver is None:
            raise RuntimeError("compute_engine_log_prob needs this process's rollout engine "
                               "(rollout.replica_backend='local')")
        c = self.config
        p = batch.prompts.shape[1]
        real = batch.attention_mask[:, :p] > 0
        prompts = [row[keep].tolist() for row, keep in zip(batch.prompts, real)]
        mask = batch.response_mask
        lengths = mask.sum(axis=1)
        holes = np.flatnonzero(np.any(mask != (np.arange(mask.shape[1])[None, :] < lengths[:, None]), axis=1))
        if holes.size:  # response_mask must be one run from column 0
            raise ValueError(f"actor.old_log_prob_pass='engine' replays single-turn responses only; row "
                             f"{holes[0]}'s response_mask is not one run of model tokens from its start")
        logp = self.driver.teacher_force(prompts, batch.responses, lengths,
                                         max_new_tokens=c.data.max_response_length,
                                         sampling=rollout.SamplingParams.from_config(c.rollout))
        return {"old_log_probs": logp}

    def compute_ref_log_prob(self, batch: Batch) -> dict[str, np.ndarray]:
        """{"ref_log_prob"} [B, t]."""
        _check_batch(batch, "compute_ref_log_prob")
        # LoRA: the actor's base weights with the adapters off (no reference copy in memory)
        return (self.ref if self.ref is not None else self.actor).compute_ref_log_prob(batch)

    def compute_rm_score(self, batch: Batch) -> dict[str, np.ndarray]:
        """{"rm_scores"} [B, t]: the reward model's score on each row's last model token. B need
        not divide over the data-parallel devices (a validation chunk): the pass then scores
        copies of row 0 in the missing rows and drops them."""
        _check_batch(batch, "compute_rm_score")
        rm, b = self.reward_model, batch.input_ids.shape[0]
        dp = data_parallel_size(rm.mesh)
        if b % dp == 0:
            return rm.compute_rm_score(batch)
        keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
        pad = -b % dp
        fields = {k: np.concatenate([batch[k], np.repeat(batch[k][:1], pad, axis=0)]) for k in keys}
        return {"rm_scores": rm.compute_rm_score(fields)["rm_scores"][:b]}

    def compute_judge_scores(self, questions: list[str], responses: list[str],
                             ground_truths: list) -> dict:
        """reward.judge on the batch rollout: every row's judgement requested at once from the
        judge's own server (which batches them). {"judge_score": f32[b], "metrics": reward/judge/*}.
        Several hosts: each host judges every row on its own judge server (the same requests, so
        the same judgements: greedy, or sampled by (seed, row))."""
        if self._batch_judge is None:
            self._batch_judge = self._judge()
        judge = self._batch_judge

        async def run():
            return await asyncio.gather(*(judge.judge(q, r, t)
                                          for q, r, t in zip(questions, responses, ground_truths)))

        judged = asyncio.run(run())
        return {"judge_score": np.asarray([j.score for j in judged], np.float32),
                "metrics": rewards.judgement_metrics(judged)}

    def compute_values(self, batch: Batch) -> dict[str, np.ndarray]:
        """{"values"} [B, t]."""
        _check_batch(batch, "compute_values")
        return self.critic.compute_values(batch)

    def update_actor(self, batch: Batch, *, mini_rows: int, seed: int, on_policy: bool = False) -> dict[str, float]:
        _check_batch(batch, "update_actor")
        return self.actor.update(batch, mini_rows=mini_rows, seed=seed, on_policy=on_policy)

    def update_critic(self, batch: Batch, *, mini_rows: int, seed: int) -> dict[str, float]:
        _check_batch(batch, "update_critic")
        return self.critic.update(batch, mini_rows=mini_rows, seed=seed)

    def sync_weights(self, version: int | None = None) -> dict:
        """The actor's weights into the rollout engine (through the server when there is one,
        which then stamps `version` on new tokens, default: one more than before)."""
        t0 = time.perf_counter()
        if self.config.rollout.replica_backend == "process":
            return self._sync_process_replicas(version, t0)
        # through the server when there is one: it pauses its scheduler and drops the sessions'
        # KV (computed with the old weights)
        target = self.server if self.server is not None else self.engine
        # LoRA: the merged W + (α/r)·A·B of the current adapters, computed now on device
        params = self.actor.rollout_params(self.engine.config.param_dtype)
        if self.replica_mesh is not None:  # to every replica of every host first (a collective)
            trees = self._to_replicas(params)
            if isinstance(self.server, rollout.ReplicaRouter):  # each replica its own copy
                stats = self.server.update_params(replica_params=trees, version=version)
            else:
                params = trees[0]
        if self.server is None:
            stats = target.update_params(params)
        elif not isinstance(self.server, rollout.ReplicaRouter):
            stats = target.update_params(params, version=version)
        stats = {k: v for k, v in stats.items() if isinstance(v, (int, float, bool))}
        stats.setdefault("time_s", time.perf_counter() - t0)
        return stats

    def _sync_process_replicas(self, version: int | None, t0: float) -> dict:
        """One host copy of the rollout weights, sent to every replica's child through the router
        (each child puts it on its devices; the router keeps the tree for a restart). A replica still restarting after a death is waited
        for first (up to _RESTART_WAIT_S), so the next rollout starts with every replica at the
        new weights; the router brings a late one to them itself."""
        if not self.server.wait_restarts(timeout=_RESTART_WAIT_S):
            log.warning("a rollout replica is still restarting after %.0f s; syncing the others", _RESTART_WAIT_S)
        host = _host_copy(self.actor.rollout_params(self._rollout_dtype()))
        stats = self.server.update_params(host, version=version)
        stats = {k: v for k, v in stats.items() if isinstance(v, (int, float, bool))}
        stats.setdefault("time_s", time.perf_counter() - t0)
        return stats

    def _model_config_for_rollout(self):
        dtype = self._rollout_dtype()
        return self._model_config().replace(dtype=dtype, param_dtype=dtype)

    def _rollout_dtype(self):
        c = self.config
        return models.to_dtype(c.rollout.dtype or c.model.dtype)

    def _to_replicas(self, params) -> list[dict]:
        """The rollout weights (a pure dict or Param state on the training mesh, stacked layers)
        on each of this host's replicas, with the rollout's stacked shardings and dtype: one
        `sharding.transfer` (or reshard, colocated) onto the mesh that stacks every replica of
        every host, of which this host keeps its own replicas' shards (the same buffers)."""
        pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
        _, abstract = nnx.split(models.abstract_model(self._model_config_for_rollout()), nnx.Param)
        locals_ = [nnx.to_pure_dict(sharding.state_shardings(abstract, mesh, sharding.ROLLOUT_RULES))
                   for mesh in self.rollout_meshes]
        targets = jax.tree.map(lambda s: jax.sharding.NamedSharding(self.replica_mesh, s.spec), locals_[0])
        if self._shared_replicas:  # colocated: the same devices, one resharding program
            moved = sharding.reshard(pure, targets, dtype=self._rollout_dtype())
        else:
            moved = sharding.transfer(pure, targets, dtype=self._rollout_dtype())
        return [jax.tree.map(sharding.local_replica, moved, local) for local in locals_]

    # -- checkpoints ---------------------------------------------------------------------------------
    def _ckpt_state(self):
        state = {"actor": self.actor.state}
        if self.critic is not None:
            state["critic"] = self.critic.state
        if self.ref is not None:
            state["ref"] = self.ref.params
        return state

    def save_checkpoint(self, step: int, meta: dict) -> bool:
        state = self._ckpt_state()  # under LoRA: adapters + their optimizer state only
        _check_finite(state, f"checkpoint step {step}")
        if self.actor.lora_spec is not None:
            meta = {**meta, "lora_base": self._lora_base}
        if self.server is not None:  # the version stamped on tokens: a resume continues it
            meta = {**meta, "policy_version": int(self.server.policy_version)}
        return self.checkpointer.save(step, state, meta, force=True)

    def restore_checkpoint(self, directory: str, step: int) -> dict:
        ckpt = self.checkpointer
        if os.path.abspath(directory) != os.path.abspath(checkpoint_root(self.config.trainer.default_local_dir)):
            ckpt = Checkpointer(directory, max_to_keep=None, async_save=False, enable=True)
        state, meta = ckpt.restore(step, target=self._ckpt_state())
        if self.actor.lora_spec is not None:
            self._restore_lora_base(meta.get("lora_base"), f"{directory}/{step}")
        self.actor.state = state["actor"]
        if self.critic is not None:
            self.critic.state = state["critic"]
        if self.ref is not None:
            self.ref.params = state["ref"]
        self.sync_weights(version=meta.get("policy_version"))
        return meta

    def wait_checkpoints(self) -> None:
        self.checkpointer.wait()

    def check_checkpoints(self) -> None:
        """Raises if a background (async) save failed since the last call."""
        self.checkpointer.check_errors()

    def reload_checkpoints(self) -> None:
        """The controller moved step directories aside: forget them."""
        self.checkpointer.reload()

    def export_hf(self, path: str, tokenizer=None) -> str:
        # every process takes part (the gathers are collective); save_pretrained writes on process 0
        _check_finite({"actor": self.actor.params}, f"Hugging Face export to {path}")
        models.save_pretrained(self.actor.model(), path, tokenizer=tokenizer)  # merged under LoRA
        return path

    def export_peft(self, path: str) -> str:
        """LoRA only: the adapters alone in PEFT's format (adapter_config.json +
        adapter_model.safetensors), to load with `peft` onto the base model."""
        models.save_peft_adapter(self.actor.model(), path,
                                 base_model_name_or_path=self._lora_base.get("path", ""))
        return path

    # -- LoRA base reference ---------------------------------------------------------------------
    def _base_reference(self) -> dict:
        """What a LoRA checkpoint records about its frozen base (it does not hold the base): the
        Hugging Face folder it came from, or for a from-scratch model its init seed; a base tuned
        by the SFT warm start is written once to `<run>/lora_base/` and referenced there. Plus a
        fingerprint (on-device sums) that a resume checks."""
        c = self.config
        ref = {"fingerprint": _fingerprint(nnx.state(self._model, nnx.Param))}
        if self._sft_ran:
            folder = f"{c.trainer.default_local_dir}/lora_base"
            models.save_pretrained(self._model, folder)
            ref["path"] = folder
        elif c.model.path:
            ref["path"] = c.model.path
        else:
            ref["init_seed"] = c.model.init.seed
        return ref

    def _restore_lora_base(self, ref: dict | None, where: str) -> None:
        """Makes the actor's frozen base the one the checkpoint was trained on: reloads a base
        that the SFT warm start made (the resumed run skipped SFT), then checks the fingerprint."""
        if ref is None:
            raise ValueError(f"{where}: a full fine-tuning checkpoint cannot resume a LoRA run "
                             "(actor.lora.rank > 0); set actor.lora.rank=0 or start a new run")
        if ref.get("path") and ref["path"] != self._lora_base.get("path"):
            if not os.path.isdir(ref["path"]):
                raise FileNotFoundError(f"{where}: the LoRA base {ref['path']} is missing; the "
                                        "checkpoint holds only the adapters")
            base = models.from_pretrained(ref["path"], dtype=self.config.model.dtype,
                                          param_dtype=self.config.model.param_dtype, mesh=self.mesh,
                                          rules=sharding.TRAIN_RULES, remat=self.config.model.remat)
            self.actor.set_base(nnx.state(base, nnx.Param))
            self._lora_base = {**self._lora_base, "path": ref["path"]}
        got = _fingerprint(self.actor.frozen[0])
        if not np.allclose(got, ref["fingerprint"], rtol=1e-5, atol=0):
            raise ValueError(f"{where}: the base weights differ from the checkpoint's LoRA base "
                             f"(fingerprint {got} vs {ref['fingerprint']}); resume with the same "
                             "model.path / model.init")
        self._lora_base["fingerprint"] = ref["fingerprint"]

    def export_sft(self, path: str, tokenizer=None) -> str:
        models.save_pretrained(self._sft.model(), path, tokenizer=tokenizer)
        return path

    def close(self) -> None:
        if self._rollouter is not None:
            self._rollouter.close()
        if self._agents is not None:
            self._agents.close()
            if self._agents.reward_loop is not None:
                self._agents.reward_loop.manager.close()
        if self._judge_server is not None:
            self._judge_server.close()
        if self.server is not None:
            self.server.close()
        self.checkpointer.wait()
        self.checkpointer.close()


def _check_batch(batch, method: str) -> None:
    if not isinstance(batch, Batch):
        raise TypeError(f"HostWorker.{method} takes a jaxrl_llm.data.Batch (verl's fields, checked "
                        f"when set), got {type(batch).__name__}: wrap the arrays as Batch(**fields)")


def _meshes(c: RunConfig, devices=None):
    """(training mesh, rollout mesh).

    Colocated: the training mesh itself when `placement.rollout_mesh` is 1x1x1, else the same
    devices re-meshed to that shape (e.g. fsdp for training, tensor-parallel decode). Separate:
    on every host the last `rollout_mesh` devices for that host's rollout replica, the rest of
    every host for the one training mesh (disjoint; see `_split_separate`); the rollout mesh is
    this process's replica. `devices`: all of them (default: this run's; an ahead-of-time
    compile passes a topology's).
    """
    m = c.mesh
    train_cfg = sharding.MeshConfig(m.data, m.fsdp, m.tensor, m.context)
    r = c.placement.rollout_mesh
    if c.placement.mode == "colocated":
        mesh = sharding.make_mesh(train_cfg, devices=devices)
        if (r.data, r.fsdp, r.tensor) == (1, 1, 1):
            return mesh, mesh
        devices = list(mesh.devices.flat)
        try:
            rollout_mesh = sharding.make_mesh(sharding.MeshConfig(r.data, r.fsdp, r.tensor), devices=devices)
        except ValueError as e:
            raise ValueError(f"placement.rollout_mesh (colocated) must cover the {len(devices)} training "
                             f"devices: {e}") from None
        return mesh, rollout_mesh
    train, replicas = _split_separate(c, devices)
    me = jax.process_index()
    return train, replicas[me if me < len(replicas) else 0]


def _check_rollouter_split(c: RunConfig, hosts: int) -> None:
    """The async modes on several hosts: every host's rollouter hands a step the same share of
    its `data.train_batch_size` groups."""
    if c.rollout_source in ("buffer", "colocated_buffer") and c.data.train_batch_size % hosts:
        raise ConfigError(f"data.train_batch_size={c.data.train_batch_size} must be a multiple of the "
                          f"{hosts} processes in trainer.v1.trainer_mode={c.trainer.v1.trainer_mode!r}: "
                          "each host's rollouter gives a step train_batch_size / processes groups")


def _uses_server(c: RunConfig) -> bool:
    """The run drives the request-level `RolloutServer` (agent loops or a rollouter)."""
    return c.rollout.multi_turn.enable or c.rollout_source in ("buffer", "colocated_buffer")


def _rollout_replicas(c: RunConfig, devices=None) -> list | None:
    """The rollout replica mesh of every host, in process order. Separate placement: each
    host's rollout devices; colocated with the request-level server: each host's own devices
    (`_colocated_replicas`); a colocated batch rollout has none (its engine is SPMD on the
    training mesh)."""
    if c.placement.mode != "colocated":
        return _split_separate(c, devices)[1]
    return _colocated_replicas(c, devices) if _uses_server(c) else None


def _colocated_replicas(c: RunConfig, devices=None) -> list:
    """Colocated, several hosts: every host's devices as that host's replica mesh. Its shape:
    `placement.rollout_mesh` with `data` divided among the hosts, or (1x1x1: the training
    mesh's shape) `tensor` as the training mesh's, `data` the rest of the host."""
    m, r = c.mesh, c.placement.rollout_mesh
    devices = list(jax.devices() if devices is None else devices)
    hosts: dict[int, list] = {}
    for d in devices:
        hosts.setdefault(d.process_index, []).append(d)
    local, n = min(len(v) for v in hosts.values()), len(hosts)
    if (r.data, r.fsdp, r.tensor) == (1, 1, 1):
        t = m.tensor if m.tensor > 0 else 1
        if local % t:
            raise ValueError(f"mesh.tensor={m.tensor} does not divide the {local} devices of a host: "
                             "a colocated rollout replica per host keeps tensor inside one host")
        shape = sharding.MeshConfig(local // t, 1, t)
    else:
        if r.data % n or (r.data // n) * r.fsdp * r.tensor != local:
            raise ValueError(
                f"placement.rollout_mesh (colocated) = data {r.data} x fsdp {r.fsdp} x tensor {r.tensor} "
                f"on {n} hosts of {local} devices: each host holds one replica of data/{n} x fsdp x "
                f"tensor = {local} devices; set data to {n} x {local // max(r.fsdp * r.tensor, 1)} "
                "(or leave rollout_mesh 1x1x1)")
        shape = sharding.MeshConfig(r.data // n, r.fsdp, r.tensor)
    return [sharding.make_mesh(shape, devices=hosts[p][:local]) for p in sorted(hosts)]


def _split_replica(mesh, k: int) -> list:
    """A host's rollout replica mesh cut into `k` replicas along its data axis (consecutive
    devices, the same axis names): `rollout.replicas_per_host`."""
    devices = mesh.devices
    if devices.shape[0] % k:
        raise ValueError(
            f"rollout.replicas_per_host={k} must divide the data axis of a host's rollout mesh "
            f"{dict(mesh.shape)}: the replicas split it (colocated with placement.rollout_mesh 1x1x1 "
            "that axis is the host's devices / mesh.tensor; else placement.rollout_mesh.data)")
    step = devices.shape[0] // k
    return [jax.sharding.Mesh(devices[i * step:(i + 1) * step], mesh.axis_names, axis_types=mesh.axis_types)
            for i in range(k)]


def _split_separate(c: RunConfig, devices=None):
    """(training mesh over every host's first devices, [rollout replica mesh of each host]).

    The same split on every host: `rollout_mesh` is one host's replica, so decoding never
    waits on another host and the trainer keeps the same share of every host (its data and
    fsdp axes span the hosts as in colocated runs). One host: the last devices for the rollout.
    """
    m, r = c.mesh, c.placement.rollout_mesh
    devices = list(jax.devices() if devices is None else devices)
    hosts: dict[int, list] = {}
    for d in devices:
        hosts.setdefault(d.process_index, []).append(d)
    k = r.data * r.fsdp * r.tensor
    local = min(len(v) for v in hosts.values())
    if k >= local:
        per = " per host" if len(hosts) > 1 else ""
        raise ValueError(f"placement.rollout_mesh uses {k} devices{per} but there are {local}: "
                         "leave some for training (placement.mode='separate'; on CPU, "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=N shows JAX N devices)")
    train_devices = [d for p in sorted(hosts) for d in hosts[p][:-k]]
    train = sharding.make_mesh(sharding.MeshConfig(m.data, m.fsdp, m.tensor, m.context), devices=train_devices)
    replicas = [sharding.make_mesh(sharding.MeshConfig(r.data, r.fsdp, r.tensor), devices=hosts[p][-k:])
                for p in sorted(hosts)]
    return train, replicas


def _gather_shares(out, num_prompts: int, n: int) -> RolloutResult:
    """The whole batch's rollout from every host's share (`out`, this host's `RolloutBatch`;
    shares are equal-sized, host order = prompt order, the padding dropped)."""
    local = {"responses": out.responses, "response_mask": out.response_mask,
             "rollout_log_probs": out.rollout_log_probs, "response_lengths": out.response_lengths,
             "stop": np.asarray([r == "stop" for r in out.finish_reasons])}
    if out.routed_experts is not None:  # actor.router_replay (every host records, same prompt width)
        local["routed_experts"] = out.routed_experts
    rows = num_prompts * n
    full = {k: np.asarray(v)[:rows] for k, v in multihost_utils.process_allgather(local, tiled=True).items()}
    stop = full.pop("stop")
    return RolloutResult(**full, finish_reasons=tuple("stop" if s else "length" for s in stop),
                         prompt_index=np.repeat(np.arange(num_prompts, dtype=np.int32), n))


def _allgather_objects(obj) -> list:
    """`obj` (picklable) of every process, in process order: an all-gather of the pickled
    bytes (every process calls it, with its own `obj`)."""
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(rows[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]


def _merge_replica_metrics(hosts: list[dict], k: int) -> dict[str, float]:
    """Every host's `ReplicaRouter.metrics()` as one run's (see `HostWorker._replica_metrics`)."""
    out: dict[str, float] = {}
    for h, m in enumerate(hosts):
        for key, v in m.items():
            if key.startswith("rollout/replica/"):
                i, _, name = key[len("rollout/replica/"):].partition("/")
                out[f"rollout/replica/{h * k + int(i)}/{name}"] = v
    for name in ("queue", "live_replicas", "dead_replicas", "retried_requests"):
        out[f"rollout/router/{name}"] = float(sum(m[f"rollout/router/{name}"] for m in hosts))
    out["rollout/router/stickiness"] = float(np.mean([m["rollout/router/stickiness"] for m in hosts]))
    for name, per in (("requests", "requests"), ("tokens", "tokens_per_s")):
        xs = [v for key, v in out.items() if key.endswith(f"/{per}") and out[key.rsplit("/", 1)[0] + "/alive"]]
        mean = float(np.mean(xs)) if xs else 0.0
        out[f"rollout/router/imbalance_{name}"] = max(xs) / mean if mean > 0 else 1.0
    return out


def _merge_producer_stats(stats: list[dict]) -> dict[str, float]:
    """Every host's rollouter counters as one: counts add up; `idle_s` is the hosts' mean (the
    idle ratio is that of the average replica)."""
    out = {k: float(sum(s[k] for s in stats)) for k in stats[0]}
    out["idle_s"] = float(np.mean([s["idle_s"] for s in stats]))
    return out


def _merge_async_states(states: list[dict]) -> dict:
    """Every host's `async_state` as one: all finished groups and unfinished prompts (by
    index), the counts added (`*_max` the maximum), and each host's own state under `hosts`."""
    counters: dict[str, int] = {}
    for st in states:
        for k, v in st.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + int(v)
    return {"queued": [g for st in states for g in st["queued"]],
            "pending": sorted((p for st in states for p in st["pending"]), key=lambda p: p["index"]),
            "consumed_since_sync": sum(int(st.get("consumed_since_sync", 0)) for st in states),
            "taken": sum(int(st.get("taken", 0)) for st in states),
            "deterministic": all(st.get("deterministic", False) for st in states),
            "counters": counters, "window": agent.merge_windows(st.get("window", {}) for st in states),
            "policy_version": int(states[0]["policy_version"]), "hosts": states}


def _split_async_state(state: dict, me: int, hosts: int) -> dict:
    """Host `me`'s part of a (merged or one-host) `async_state` for a run of `hosts` processes:
    the groups and prompts of index = me modulo hosts; the counters stay with host 0 (so the
    sums are the saved ones), the interval's consumed count and the groups taken so far are
    split evenly."""
    mine = lambda index: index % hosts == me  # noqa: E731
    return {"queued": [g for g in state.get("queued", []) if mine(g["prompt"]["index"])],
            "pending": [p for p in state.get("pending", []) if mine(p["index"])],
            "consumed_since_sync": int(state.get("consumed_since_sync", 0)) // hosts,
            "taken": int(state.get("taken", 0)) // hosts,  # each host took its share of every step
            "deterministic": bool(state.get("deterministic", False)),
            "counters": state.get("counters", {}) if me == 0 else {},
            "window": state.get("window", {}) if me == 0 else {}}


def _agent_result(out: dict, extra_metrics: dict | None = None, **fields) -> RolloutResult:
    """An `agent.AgentRunner.collate` result as a `RolloutResult` (plus `fields`; `extra_metrics`
    join the runner's)."""
    return RolloutResult(
        responses=out["responses"], response_mask=out["response_mask"],
        response_attention_mask=out["response_attention_mask"],
        rollout_log_probs=out["rollout_log_probs"], rollout_versions=out["rollout_versions"],
        prompt_ids=tuple(tuple(int(i) for i in ids) for ids in out["prompt_ids"]),
        scores=out["scores"], reward_extra=dict(out["reward_extra"]),
        metrics={**out["metrics"], **(extra_metrics or {})},
        num_turns=out["num_turns"], finish_reasons=tuple(out["finish_reasons"]),
        turn_texts=tuple(out["turn_texts"]), messages=tuple(out["messages"]),
        routed_experts=out.get("routed_experts"), **fields)


@jax.jit
def _sums(tree):
    leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(tree)]
    return jnp.stack([sum(jnp.abs(x).sum() for x in leaves), sum((x * x).sum() for x in leaves)])


def _fingerprint(tree) -> list[float]:
    """[sum |w|, sum w²] of every weight, reduced on device (no host copy of the weights)."""
    return [float(v) for v in np.asarray(jax.device_get(_sums(tree)), np.float64)]


@jax.jit
def _nonfinite_leaves(tree) -> jax.Array:
    """How many floating-point leaves of `tree` hold a NaN or inf (one device reduction)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum((~jnp.isfinite(x).all()).astype(jnp.int32) for x in leaves) + jnp.int32(0)


def _check_finite(tree, what: str) -> None:
    """Raises FloatingPointError rather than write a NaN/inf state to disk."""
    if int(_nonfinite_leaves(tree)):
        bad = [path for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
               if jnp.issubdtype(x.dtype, jnp.floating) and not bool(jnp.isfinite(x).all())]
        raise FloatingPointError(
            f"refusing to write {what}: {len(bad)} arrays hold NaN/inf (first: "
            f"{jax.tree_util.keystr(bad[0])}); the last finite checkpoint is kept")


__all__ = ["HostWorker", "model_config_for"]
