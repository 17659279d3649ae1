"""The controller: verl's PPO/GRPO loop over workers that live locally or in Ray actors.

One step: prompts -> rollout (n per prompt) -> rewards -> old log-probs (a pass, the engine's, or
the update's own: `_old_log_prob`) -> ref log-probs ->
values -> KL in reward -> advantages -> critic/actor updates -> weight sync -> metrics ->
checkpoint -> validation. The trainer mode's `RolloutSource` (`_sources`) supplies the prompts
and their rollout and owns the weight-sync rule. The controller holds host numpy and Python state only (data iterator,
KL controller, step, seeds); the workers hold every model.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time

import jax
import numpy as np

import rollout
from jaxrl_llm import _chaos, algos, data, metrics as M, models, rewards
from jaxrl_llm._disk import as_disk_full, disk_full_guard
from jaxrl_llm.checkpoint import checkpoint_root, resolve_resume, set_aside_steps
from jaxrl_llm.config import RunConfig, SamplingConfig
from jaxrl_llm.data import RolloutResult
from jaxrl_llm.workers import HostWorker

from . import _batch as B
from ._sources import (ColocatedBufferSource, OneStepOffSource, RolloutBufferSource, RolloutSource, SourceContext,
                       StepTimer, SyncSource)
from ._backend import Method, P, R, WorkerError, make_group
from ._old_log_prob import old_log_prob_source, set_old_log_probs
from ._sft_data import sft_batches, sft_dataset
from ._startup import check_data_files, describe_run, prepare_builtin_data, write_config_json

log = logging.getLogger(__name__)

# the worker call of each old-log-prob source that runs a pass (`_old_log_prob.COMPUTED`)
_OLD_LOG_PROB_PASSES = {"pass": HostWorker.compute_old_log_prob, "engine": HostWorker.compute_engine_log_prob}


class NonFiniteError(FloatingPointError):
    """The run stopped: too many consecutive steps had NaN/inf updates (all of them skipped)."""


def load_tokenizer(config: RunConfig):
    spec = config.model.tokenizer or config.model.path
    if spec == "char":
        return models.CharTokenizer()
    return models.load_tokenizer(spec)


class RLTrainer:
    """`RLTrainer(config).fit()` runs the whole job; see the module docstring for one step."""

    def __init__(self, config: RunConfig, *, num_hosts: int = 1, distributed: dict | None = None):
        self.config = c = config
        self.mode = c.rollout_source
        # agent loops generate (the request-level server) when the rows ask for them or the
        # mode's rollouter drives them; otherwise the batch driver
        self.agent_loop = c.rollout.multi_turn.enable or self.mode in ("buffer", "colocated_buffer")
        self.source: RolloutSource | None = None
        self.timer = StepTimer()
        if c.trainer.backend == "ray":
            # The controller's own JAX work (advantages) is tiny: keep it off the accelerators
            # that the Ray workers own. Workers get the original environment (RayGroup).
            _use_cpu_for_controller()
        self.run_dir = c.trainer.default_local_dir
        check_data_files(c)  # a missing file is an error before anything is written
        os.makedirs(self.run_dir, exist_ok=True)
        write_config_json(c, self.run_dir)
        self.tokenizer = load_tokenizer(c)
        self.data_files = files = prepare_builtin_data(c)  # the config's files are only read
        d = c.data
        self.train_set = data.RLDataset(files.train, self.tokenizer, max_prompt_length=d.max_prompt_length,
                                        filter_overlong_prompts=d.filter_overlong_prompts,
                                        truncation=d.truncation, prompt_key=d.prompt_key, seed=d.seed,
                                        shuffle=d.shuffle)
        self.val_set = (data.RLDataset(files.val, self.tokenizer, max_prompt_length=d.max_prompt_length,
                                       filter_overlong_prompts=d.filter_overlong_prompts,
                                       truncation=d.truncation, prompt_key=d.prompt_key, shuffle=False)
                        if files.val else None)
        agents = {e.agent_name for ds in (self.train_set, self.val_set) if ds is not None for e in ds.examples}
        log.info("%s", describe_run(c, files, agents))
        self.loader = data.PromptLoader(self.train_set, d.train_batch_size, seed=d.seed, shuffle=d.shuffle)
        custom = c.reward.custom_reward_function
        custom_fn = rewards.load_custom_reward_fn(custom.path, custom.name) if custom.path else None
        self.reward = rewards.RewardManager(num_workers=c.reward.num_workers, timeout_s=c.reward.timeout_s,
                                            custom_fn=custom_fn, max_error_fraction=c.reward.max_error_fraction,
                                            max_consecutive_timeouts=c.reward.max_consecutive_timeouts,
                                            max_consecutive_worker_deaths=c.reward.max_consecutive_worker_deaths,
                                            memory_limit_gb=c.reward.memory_limit_gb, sandbox=c.reward.sandbox)
        self.pad_id = self.tokenizer.pad_token_id
        stop_ids = tuple(getattr(self.tokenizer, "eos_token_ids", (self.tokenizer.eos_token_id,)))
        self.group = make_group(c.trainer.backend, HostWorker, c, vocab_size=self.tokenizer.vocab_size,
                                pad_token_id=self.pad_id, stop_token_ids=stop_ids, num_hosts=num_hosts,
                                distributed=distributed, max_concurrency=2 if self.mode == "one_step_off" else 1)
        self.source = self._make_source()
        self.info = self.call0(HostWorker.info)
        # the controller's first JAX computation: only after Ray has started its processes (it
        # starts them with a preexec_fn, and JAX warns of a fork once its backend is running)
        kl = c.algorithm.kl_ctrl
        self.kl_ctrl = algos.get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        # Ray: this driver is the single controller; local multi-host: process 0 writes.
        self.logger_enabled = c.trainer.backend == "ray" or jax.process_index() == 0
        self.logger = M.MetricsLogger(self.run_dir, backends=tuple(c.trainer.logger), enable=self.logger_enabled,
                                      run_name=f"{c.trainer.project_name}/{c.trainer.experiment_name}")
        self.global_step = 0
        self.nonfinite_steps = 0  # steps with a skipped (NaN/inf) optimizer update, in all
        self.nonfinite_streak = 0  # ... in a row, up to now
        self._best_val: float | None = None  # trainer.keep_best_val_metric's best (read lazily)

    @property
    def config(self) -> RunConfig:
        return self._config

    @config.setter
    def config(self, config: RunConfig) -> None:
        """A new config reaches the rollout source too (tests reconfigure a started trainer)."""
        self._config = config
        if getattr(self, "source", None) is not None:
            self.source.ctx = dataclasses.replace(self.source.ctx, config=config)

    def call0(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Calls `method` (a `HostWorker` function) on every host; hosts return identical
        (replicated) results, keep host 0's."""
        return self.group.call(method, *args, **kwargs)[0]

    # -- the job -------------------------------------------------------------------------------
    def fit(self) -> dict:
        c = self.config
        try:
            resume = self._prepare_resume()
            if resume is None and c.sft.steps > 0:
                self.run_sft()
            self.call0(HostWorker.start_rl, c.trainer.total_training_steps)
            if resume is not None:
                self._restore(*resume)
            last_val = {}
            if c.trainer.val_only:  # verl's val_only: the current weights' validation, no training
                last_val = self.validate()
                self.logger.log(last_val, step=self.global_step)
                return last_val
            if c.trainer.val_before_train and self.val_set is not None and self.global_step == 0:
                last_val = self.validate()
                self.logger.log(last_val, step=0)
                self._keep_best(last_val)
            bar = _progress(c, self.global_step)
            while self.global_step < c.trainer.total_training_steps:
                step_metrics = self.train_step()
                self.global_step += 1
                self._count_nonfinite(step_metrics)
                is_last = self.global_step == c.trainer.total_training_steps
                if self.val_set is not None and (is_last or (c.trainer.test_freq > 0
                                                             and self.global_step % c.trainer.test_freq == 0)):
                    self.source.settle(self.global_step)  # the engine idle, with the newest weights
                    last_val = self.validate()
                    step_metrics.update(last_val)
                    self._keep_best(last_val)
                # the row goes in before the checkpoint: a resume rewinds the files to the
                # checkpoint's step, so the row of a saved step is never lost or doubled
                self.logger.log(step_metrics, step=self.global_step)
                if is_last or (c.trainer.save_freq > 0 and self.global_step % c.trainer.save_freq == 0):
                    self.save_checkpoint()
                elif c.trainer.async_save:  # a failed background save stops the run at the next step
                    self.group.call(HostWorker.check_checkpoints)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(score=f"{step_metrics.get('critic/score/mean', 0):.3f}")
            if bar is not None:
                bar.close()
            self.call0(HostWorker.wait_checkpoints)
            self._finish()
            return last_val
        except Exception as e:
            full = as_disk_full(e)
            if full is None and not isinstance(e, WorkerError):
                raise
            log.error("%s; waiting for checkpoints in flight, then stopping",
                      "a worker failed" if full is None else "the disk is full")
            self.source.close(wait=False)
            self._safe_wait()
            if full is None:
                raise
            self._disk_full = True  # closing must not raise (and print) the same error again
            raise full from None  # one line: where, and that the disk is full
        finally:
            self.close()

    def _prepare_resume(self):
        """Where to resume (`resolve_resume`), with the run's files rewound to that step: newer
        or broken step directories are moved aside (so saves do not collide with them) and the
        metric logs drop the rows after it."""
        c = self.config
        root = checkpoint_root(self.run_dir)
        resume = resolve_resume(c.trainer.resume_mode, root)
        step = -1 if resume is None else resume[1]
        if self.logger_enabled:  # one process moves files
            if set_aside_steps(root, keep_up_to=max(step, 0)):
                self.group.call(HostWorker.reload_checkpoints)
            self.logger.rewind(step)
        return resume

    def _count_nonfinite(self, metrics: dict) -> None:
        """Counts a step whose actor or critic update skipped a non-finite optimizer step, and
        stops the run after `trainer.max_nonfinite_steps` such steps in a row."""
        skipped = metrics.get("actor/nonfinite_updates", 0.0) + metrics.get("critic/nonfinite_updates", 0.0)
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped else 0
        self.nonfinite_steps += bool(skipped)
        metrics["training/nonfinite_steps"] = float(self.nonfinite_steps)
        limit = self.config.trainer.max_nonfinite_steps
        if self.nonfinite_streak >= limit:
            self.logger.log(metrics, step=self.global_step)
            raise NonFiniteError(
                f"stopping at step {self.global_step}: the last {self.nonfinite_streak} steps "
                f"(trainer.max_nonfinite_steps={limit}) each had a NaN/inf loss, gradient norm or "
                "update, so their optimizer steps were skipped and the weights did not change. "
                "Nothing non-finite was saved; the newest checkpoint holds the last good weights. "
                "Lower actor.optim.lr / critic.optim.lr, check the rewards, or raise "
                "trainer.max_nonfinite_steps.")
        if skipped:
            log.warning("step %d: %d non-finite optimizer step(s) skipped (%d steps in a row)",
                        self.global_step, int(skipped), self.nonfinite_streak)

    def _finish(self):
        c = self.config
        if c.trainer.export_hf:
            tok = self.tokenizer
            with disk_full_guard(f"{self.run_dir}/hf_actor", "the Hugging Face export"):
                self.call0(HostWorker.export_hf, f"{self.run_dir}/hf_actor", tokenizer=tok)
            if c.actor.lora.enabled:  # the adapters alone, in PEFT's format
                with disk_full_guard(f"{self.run_dir}/lora_adapter", "the LoRA adapter export"):
                    self.call0(HostWorker.export_peft, f"{self.run_dir}/lora_adapter")
        if c.trainer.plot:
            try:
                M.plot_curves(self.run_dir, f"{self.run_dir}/curves.png")
            except Exception as e:  # noqa: BLE001 - a plot must never fail a finished run
                log.warning("could not draw curves: %s", e)

    def _safe_wait(self):
        try:
            self.group.call(HostWorker.wait_checkpoints)
        except Exception:  # noqa: BLE001 - the worker may be gone
            pass

    def close(self):
        if getattr(self, "source", None) is not None:  # work in flight ends before the workers go
            self.source.close()
        if getattr(self, "group", None) is not None:
            group, self.group = self.group, None
            try:
                group.shutdown()
            except Exception as e:  # noqa: BLE001 - after a full disk: already reported
                if not (getattr(self, "_disk_full", False) and as_disk_full(e) is not None):
                    raise
        self.reward.close()
        if getattr(self, "logger", None) is not None:
            self.logger.close()

    # -- SFT warm start -----------------------------------------------------------------------------
    def run_sft(self) -> None:
        sft_set = sft_dataset(self.config, self.tokenizer)
        bar = _progress(self.config, 0, total=self.config.sft.steps, desc="SFT")
        with M.MetricsLogger(f"{self.run_dir}/sft", backends=("jsonl", "tensorboard"),
                             enable=self.logger_enabled) as sft_log:
            sft_log.rewind(-1)  # SFT runs whole or not at all: a restarted one starts the file anew
            for step, batch in enumerate(sft_batches(self.config, sft_set, self.pad_id)):
                m = self.call0(HostWorker.sft_step, batch)
                sft_log.log(m, step=step + 1)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(nll=f"{m['sft/nll']:.3f}")
        if bar is not None:
            bar.close()

    # -- one RL step ---------------------------------------------------------------------------------
    def _seed(self, salt: int, step: int | None = None) -> int:
        step = self.global_step if step is None else step
        return (self.config.trainer.seed * 1_000_003 + step * 7919 + salt) % (2**31 - 1)

    def _make_source(self) -> RolloutSource:
        """The mode's rollout source (`_sources`), handed what it works with."""
        c = self.config
        ctx = SourceContext(config=c, group=self.group, loader=self.loader, seed=self._seed,
                            timer=self.timer, generate=self._generate)
        if self.mode == "one_step_off":
            return OneStepOffSource(ctx)
        if self.mode in ("buffer", "colocated_buffer"):
            v1 = c.trainer.v1
            bound = v1.sampler.max_off_policy_threshold
            cls = RolloutBufferSource if self.mode == "buffer" else ColocatedBufferSource
            return cls(ctx, groups_per_step=c.data.train_batch_size, sync_every=1,
                       run_ahead=v1.colocate_async.num_warmup_batches,
                       max_off_policy=None if bound is None or bound < 0 else bound)
        return SyncSource(ctx)

    def _generate(self, examples, sampling, *, seed: int) -> RolloutResult:
        """`sampling.n` samples of each example with the current weights: the agent loops
        (`_agent_generate`) or the batch driver."""
        if self.agent_loop:
            return self._agent_generate(examples, sampling, seed=seed)
        return self.call0(HostWorker.generate, [e.prompt_ids for e in examples], n=sampling.n,
                          max_new_tokens=self.config.data.max_response_length, seed=seed,
                          sampling=rollout.SamplingParams.from_config(sampling))

    def _agent_generate(self, examples, sampling, *, seed: int) -> dict:
        """Agent rollouts (`rollout.multi_turn`): `sampling.n` trajectories per example, rows
        in the batch driver's order, already scored (streaming reward loop on the worker)."""
        n = sampling.n
        samples = [dict(raw_prompt=e.raw_prompt, data_source=e.data_source, ground_truth=e.ground_truth,
                        extra_info=e.extra_info, agent_name=e.agent_name, row=i * n + j)
                   for i, e in enumerate(examples) for j in range(n)]
        return self.call0(HostWorker.agent_generate, samples, seed=seed,
                          sampling=rollout.SamplingParams.from_config(sampling))

    def train_step(self) -> dict:
        c = self.config
        timing = self.timer.reset()
        metrics: dict[str, float] = {}
        _chaos.at_step(self.global_step + 1)
        t_step = time.perf_counter()
        examples, batch = self._train_batch(timing, metrics)
        mini_rows = c.actor.ppo_mini_batch_size * c.rollout.n
        olp = old_log_prob_source(c, rows=batch.rows, mini_rows=mini_rows)  # rollout | pass | engine | update
        computed = None
        if olp in _OLD_LOG_PROB_PASSES:
            with self.timer.phase("old_log_prob"):
                computed = self.call0(_OLD_LOG_PROB_PASSES[olp], batch)
        metrics.update(set_old_log_probs(batch, olp, computed))
        if c.algorithm.rollout_correction.enabled:
            with self.timer.phase("rollout_correction"):
                metrics.update(B.rollout_correction(batch, c.algorithm.rollout_correction))
        if c.use_reference:
            with self.timer.phase("ref"):
                batch.update(self.call0(HostWorker.compute_ref_log_prob, batch))
        if c.use_critic:
            with self.timer.phase("values"):
                batch.update(self.call0(HostWorker.compute_values, batch))
        with self.timer.phase("adv"):
            if c.algorithm.use_kl_in_reward:
                beta = float(np.asarray(self.kl_ctrl.value))
                batch.token_level_rewards, current_kl = B.kl_in_reward(batch, beta, c.algorithm.kl_penalty)
                self.kl_ctrl = self.kl_ctrl.update(current_kl, len(examples) * c.rollout.n)
                metrics.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta})
            else:
                batch.token_level_rewards = batch.token_level_scores
            a = c.algorithm
            batch.advantages, batch.returns = B.compute_advantages(
                batch, estimator=a.adv_estimator, gamma=a.gamma, lam=a.lam,
                norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo)
        if c.use_critic:
            with self.timer.phase("update_critic"):
                metrics.update(self.call0(HostWorker.update_critic, batch, mini_rows=c.critic.ppo_mini_batch_size * c.rollout.n,
                                          seed=self._seed(2)))
        if self.global_step >= c.critic.warmup_steps_before_actor or not c.use_critic:
            with self.timer.phase("update_actor"):
                # on-policy unless pi_old is the engine's (bypass mode, or the engine's pass): the
                # first mini-batch's ratio is then exactly 1
                metrics.update(self.call0(HostWorker.update_actor, batch, mini_rows=mini_rows, seed=self._seed(3),
                                          on_policy=olp in ("pass", "update")))
            _chaos.kill_point("update", self.global_step + 1)
            metrics.update(self.source.after_update(self.global_step))  # the mode's weight sync
        timing["step"] = time.perf_counter() - t_step
        metrics.update(self._step_metrics(batch, timing, old_log_prob_pass=olp == "pass"))
        metrics.update(self.source.end_step(timing))
        metrics["training/epoch"] = float(self.loader.epoch)
        return metrics

    def _train_batch(self, timing: dict, metrics: dict):
        """This step's prompts and their scored rollout: verl's fields plus `token_level_scores`
        (and `reward_baselines` for ReMax).

        With `algorithm.filter_groups.enable` (DAPO's dynamic sampling) it generates batches of
        `data.train_batch_size` prompts and keeps only the groups whose filter metric is not the
        same for all `rollout.n` responses, until `train_batch_size` groups are kept (the surplus
        of the last round is dropped), or raises after `max_num_gen_batches` rounds (0 = no limit).
        """
        c = self.config
        fg, n, size = c.algorithm.filter_groups, c.rollout.n, c.data.train_batch_size
        kept_examples, kept_batches, filtered, rounds = [], [], 0, 0
        while True:
            examples, gen, rmetrics = self.source.next(self.global_step, rounds)
            metrics.update(rmetrics)
            _chaos.kill_point("generation", self.global_step + 1)
            rounds += 1
            batch = B.rollout_batch(examples, gen, n=n, pad_token_id=self.pad_id,
                                    max_prompt_length=c.data.max_prompt_length)
            with self.timer.phase("reward"):
                fields = self._score_rollout(examples, gen, batch, n, metrics)
            if not fg.enable or self.source.filters_groups:  # async modes: the rollouter filtered
                break
            metric = B.filter_metric(fg.metric, batch, fields)
            keep = np.asarray(algos.dynamic_sampling_keep_mask(metric, batch.group_ids))
            keep = keep.reshape(-1, n)[:, 0]  # prompt i's responses are rows i*n .. i*n+n-1
            filtered += int((~keep).sum())
            kept_examples += [e for e, k in zip(examples, keep) if k]
            kept_batches.append(batch.select(np.repeat(keep, n)))
            if len(kept_examples) >= size:
                examples = kept_examples[:size]
                batch = B.concat_batches(kept_batches).select(np.arange(size * n))
                metrics.update({"train/num_gen_batches": float(rounds),
                                "filter_groups/kept_groups": float(len(kept_examples)),
                                "filter_groups/filtered_groups": float(filtered)})
                break
            if 0 < fg.max_num_gen_batches <= rounds:
                raise RuntimeError(
                    f"algorithm.filter_groups: {rounds} generation rounds kept {len(kept_examples)} of the "
                    f"{size} groups a step needs (the others had the same {fg.metric!r} for every "
                    "response): the data may be too hard or too easy for the model. Raise "
                    "algorithm.filter_groups.max_num_gen_batches (0 = no limit) or turn the filter off")
        if c.algorithm.adv_estimator == "remax":
            with self.timer.phase("gen_max"):
                batch.reward_baselines = self._greedy_baselines(examples, n)
        return examples, batch

    def _score_rollout(self, examples, gen: RolloutResult, batch: data.Batch, n: int, metrics: dict) -> dict:
        """Puts `token_level_scores` into `batch`: the reward model's, the agent loop's or the
        scorers' sequence score on the last response token, plus DAPO's overlong penalty when
        `reward.overlong_buffer.enable`. Returns per-row fields for the group filter: `score`
        (the sequence score before the penalty) and the reward function's numeric extras."""
        c = self.config
        if gen.scores is not None:  # agent rollouts: scored on the worker as each one finished
            metrics.update(gen.metrics)  # (rule, reward model and judge: the streaming reward loop)
            scores, extra = gen.scores, gen.reward_extra
        else:
            scores, extra = self._score_batch(examples, batch, n, metrics)
        batch.token_level_scores = B.token_level_scores(np.asarray(scores, np.float32), batch.response_mask)
        ob = c.reward.overlong_buffer
        if ob.enable:  # verl's DAPO reward manager: on the response's length with tool tokens
            length = batch.attention_mask[:, batch.prompts.shape[1]:].sum(-1)
            penalty = np.asarray(algos.overlong_penalty(
                length, c.data.max_response_length, ob.len, ob.penalty_factor), np.float32)
            batch.token_level_scores = (batch.token_level_scores
                                        + B.token_level_scores(penalty, batch.response_mask))
            metrics["reward_extra/overlong_reward/mean"] = float(penalty.mean())
            metrics["reward_extra/overlong/mean"] = float((penalty < 0).mean())
        return {"score": np.asarray(scores, np.float32), **extra}

    def _score_batch(self, examples, batch: data.Batch, n: int, metrics: dict):
        """The batch rollout's sequence scores f32[b] and extras: the rule scorers, the reward
        model (one pass over the batch) and the judge (every row's request at once), combined as
        the streaming reward loop combines them (`rewards.combine_scores`; a source with weight 0
        is not run)."""
        r = self.config.reward
        weights = rewards.RewardWeights(
            rule=rewards.resolve_rule_weight(r.rule_weight, has_model=bool(r.model.path),
                                             has_judge=r.judge.enable),
            model=r.model.weight, judge=r.judge.weight)
        parts: dict[str, np.ndarray] = {}
        extra: dict = {}
        if weights.rule != 0 or not (r.model.path or r.judge.enable):
            parts["rule"], extra, rmetrics = self._score(examples, batch, n)
            metrics.update(rmetrics)
        if r.model.path:  # the value at each row's last model token (0 elsewhere)
            parts["model"] = self.call0(HostWorker.compute_rm_score, batch)["rm_scores"].sum(-1)
        if r.judge.enable:
            rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
            questions = rep([rewards.question_of(e.raw_prompt) for e in examples])
            out = self.call0(HostWorker.compute_judge_scores, questions, self._texts(batch),
                             rep([e.ground_truth for e in examples]))
            parts["judge"] = out["judge_score"]
            metrics.update(out["metrics"])
        if set(parts) != {"rule"}:  # the parts, as the streaming loop reports them
            names = {"rule": "rule_score", "model": "rm_score", "judge": "judge_score"}
            extra = {**extra, **{names[k]: np.asarray(v, np.float32) for k, v in parts.items()}}
        metrics.update({f"reward_extra/{k}/mean": float(np.mean(v)) for k, v in extra.items()})
        if set(parts) == {"rule"}:
            return parts["rule"], extra
        return rewards.combine_scores(weights, **parts), extra

    def _greedy_baselines(self, examples, n: int) -> np.ndarray:
        """ReMax (verl): each prompt's greedy response, scored like the samples (overlong penalty
        included); its sequence reward repeated for the prompt's `n` rows. float32[b * n]."""
        c = self.config
        greedy = SamplingConfig(temperature=0.0, top_k=-1, top_p=1.0, n=1)
        gen = self._generate(examples, greedy, seed=self._seed(5))
        batch = B.rollout_batch(examples, gen, n=1, pad_token_id=self.pad_id,
                                max_prompt_length=c.data.max_prompt_length)
        self._score_rollout(examples, gen, batch, 1, {})
        return np.repeat(batch.token_level_scores.sum(-1), n).astype(np.float32)

    def _texts(self, batch) -> list[str]:
        return [self.tokenizer.decode(r[:m.sum()].tolist()) for r, m in zip(batch.responses, batch.response_mask)]

    def _score(self, examples, batch, n):
        texts = self._texts(batch)
        rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
        return self.reward.score_batch(rep([e.data_source for e in examples]), texts,
                                       rep([e.ground_truth for e in examples]),
                                       rep([e.extra_info for e in examples]))

    def _step_metrics(self, batch, timing, *, old_log_prob_pass: bool) -> dict:
        c = self.config
        out = M.compute_data_metrics(batch, use_critic=c.use_critic)
        n_prompt = int(batch.attention_mask[:, :batch.prompts.shape[1]].sum())
        n_resp = int(batch.response_mask.sum())
        out.update(M.compute_timing_metrics(timing, num_prompt_tokens=n_prompt, num_response_tokens=n_resp))
        info = self.info
        out.update(M.compute_throughput_metrics(total_tokens=n_prompt + n_resp, step_time_s=timing["step"],
                                                num_devices=info["num_devices"]))
        seq = batch.input_ids.shape[1]
        # forward + backward of the actor update, plus the trainer's old-log-prob forward (1/3 of 6N)
        passes = c.actor.ppo_epochs + (1 / 3 if old_log_prob_pass else 0)
        olp_s = timing.get("old_log_prob", 0) if old_log_prob_pass else 0
        out["perf/mfu/actor"] = M.compute_mfu(
            num_params=info["num_params"], num_layers=info["num_layers"], hidden=info["hidden_size"],
            seq_len=seq, tokens=int(batch.attention_mask.sum() * passes),
            time_s=max(timing.get("update_actor", 0) + olp_s, 1e-9),
            num_devices=info["num_devices"], peak_flops_per_device=M.peak_flops(info["device_kind"], "bfloat16"))  # MFU vs the bf16 peak
        device_peak = M.max_memory_allocated_gb()  # None on CPU: no device memory to report
        if device_peak is not None:
            out["perf/max_memory_allocated_gb"] = device_peak
        out["perf/cpu_memory_used_gb"] = M.cpu_memory_used_gb()
        return out

    # -- validation --------------------------------------------------------------------------------
    def validate(self, step: int | None = None) -> dict:
        """verl's validation metrics (`M.process_validation_metrics`) over `rollout.val.n`
        responses per validation prompt; writes `trainer.log_val_generations` samples of them
        for `step` (default: the current step) to `<run>/val_generations.jsonl` and TensorBoard."""
        c = self.config
        v = c.rollout.val
        examples = list(self.val_set)
        rows = dict(data_source=[], prompt=[], response=[], ground_truth=[], turns=[])
        infos: dict[str, list[float]] = {"reward": []}
        for start in range(0, len(examples), c.data.val_batch_size):
            chunk = examples[start:start + c.data.val_batch_size]
            gen = self._generate(chunk, v, seed=self._seed(4) + start)  # the same loops as training
            if self.agent_loop:
                scores, extra = gen.scores, gen.reward_extra
                prompts = [self.tokenizer.decode(list(ids)) for ids in gen.prompt_ids]
                lengths = np.asarray(gen.response_attention_mask).sum(-1)
                rows["turns"] += [_turns(m, e.raw_prompt, turns) for m, e, turns in
                                  zip(gen.messages, (e for e in chunk for _ in range(v.n)), gen.turn_texts)]
            else:
                batch = B.rollout_batch(chunk, gen, n=v.n, pad_token_id=self.pad_id,
                                        max_prompt_length=c.data.max_prompt_length)
                scores, extra = self._score_batch(chunk, batch, v.n, {})  # rule + reward model, as training
                prompts = [self.tokenizer.decode(list(e.prompt_ids)) for e in chunk for _ in range(v.n)]
                lengths = gen.response_mask.sum(-1)
                rows["turns"] += [None] * len(prompts)  # one completion: prompt and response say it all
            rows["prompt"] += prompts
            rows["response"] += [self.tokenizer.decode(r[:k].tolist()) for r, k in zip(gen.responses, lengths)]
            rows["data_source"] += [e.data_source for e in chunk for _ in range(v.n)]
            rows["ground_truth"] += [e.ground_truth for e in chunk for _ in range(v.n)]
            start_row = len(infos["reward"])
            infos["reward"] += [float(x) for x in scores]
            for k, vals in extra.items():  # a field some rows lack is 0 there (as in training)
                col = infos.setdefault(k, [0.0] * start_row)
                col += [float(x) for x in vals]
            for col in infos.values():
                col += [0.0] * (len(infos["reward"]) - len(col))
        keys = [i // v.n for i in range(len(infos["reward"]))]  # the prompt each response answers
        out = M.process_validation_metrics(rows["data_source"], keys, infos, seed=c.trainer.seed)
        self._log_val_generations(rows, infos["reward"], self.global_step if step is None else step)
        return out

    def _log_val_generations(self, rows: dict, scores: list[float], step: int) -> None:
        """verl's `log_val_generations`: the same `trainer.log_val_generations` responses
        (a fixed random choice) at every validation, with prompt, score and ground truth; an
        agent-loop sample also has its conversation as `turns`, [{role, content}, ...] (the
        prompt's messages, then the model's, tools' and user's turns apart)."""
        k = min(self.config.trainer.log_val_generations, len(scores))
        if k == 0 or not self.logger_enabled:
            return
        pick = sorted(np.random.default_rng(42).permutation(len(scores))[:k].tolist())
        samples = [{"data_source": rows["data_source"][i], "prompt": rows["prompt"][i],
                    "response": rows["response"][i], "score": scores[i],
                    "ground_truth": _jsonable(rows["ground_truth"][i]),
                    **({"turns": rows["turns"][i]} if rows["turns"][i] is not None else {})}
                   for i in pick]
        self.logger.log_generations(samples, step=step)

    def _keep_best(self, val: dict) -> None:
        """`trainer.keep_best_val_metric`: when this validation's value of the metric beats the
        best so far (higher is better; the best so far is `<run>/hf_best/best.json`'s, so it
        survives a resume), the actor is exported to `<run>/hf_best/` (a Hugging Face folder,
        written beside it and then swapped in) with best.json = {metric, step, value}."""
        name = self.config.trainer.keep_best_val_metric
        if not name:
            return
        if name not in val:
            have = sorted(k for k in val if k.startswith("val-core/"))
            raise ValueError(f"trainer.keep_best_val_metric={name!r} is not among this run's validation "
                             f"metrics; its val-core metrics are {have}")
        value, final = float(val[name]), f"{self.run_dir}/hf_best"
        if self._best_val is None:  # the first validation of this process: the folder's record
            record = _read_best(final)
            self._best_val = record["value"] if record and record.get("metric") == name else -math.inf
        if not value > self._best_val:  # NaN never improves
            return
        self._best_val = value
        partial = f"{final}.partial"
        if self.logger_enabled:  # a folder left by a killed export
            import shutil

            shutil.rmtree(partial, ignore_errors=True)
        self.call0(HostWorker.export_hf, partial, tokenizer=self.tokenizer)  # every process takes part
        if self.logger_enabled:  # process 0 moves the files
            with open(f"{partial}/best.json", "w", encoding="utf-8") as f:
                json.dump({"metric": name, "step": self.global_step, "value": value}, f)
            _swap_in(partial, final)
        log.info("%s=%.4g at step %d is the best so far: exported to %s", name, value, self.global_step, final)

    # -- checkpoints -----------------------------------------------------------------------------------
    def _meta(self) -> dict:
        # the source's entries: the data position the next step draws from, its own state
        return {"global_step": self.global_step, **self.source.state(),
                "kl_coef": float(np.asarray(self.kl_ctrl.value)), "config": self.config.to_dict(),
                "nonfinite_steps": self.nonfinite_steps, "nonfinite_streak": self.nonfinite_streak}

    def save_checkpoint(self) -> None:
        meta = self._meta()
        self.group.call(HostWorker.save_checkpoint, self.global_step, meta)
        self.source.after_save(self.global_step, meta)

    def _restore(self, directory, step) -> None:
        meta = self.call0(HostWorker.restore_checkpoint, str(directory), int(step))
        self.global_step = int(meta["global_step"])
        self.kl_ctrl = dataclasses.replace(self.kl_ctrl, value=np.float32(meta["kl_coef"]))
        # checkpoints from before these counters existed had none: 0
        self.nonfinite_steps = int(meta.get("nonfinite_steps", 0))
        self.nonfinite_streak = int(meta.get("nonfinite_streak", 0))
        self.source.restore(meta)  # the data position and the mode's state
        log.info("resumed from %s at step %d", directory, self.global_step)


def _read_best(folder: str) -> dict | None:
    """`<folder>/best.json` ({metric, step, value}), or None when there is none to read."""
    try:
        with open(os.path.join(folder, "best.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _swap_in(new: str, final: str) -> None:
    """Replaces the folder `final` with `new`: a reader sees the old or the new folder, and a kill
    in between leaves `final.old` (the previous best) beside them."""
    import shutil

    old = f"{final}.old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(final):
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


def _jsonable(x):
    return x if isinstance(x, (str, int, float, bool, type(None), list, dict)) else str(x)


def _turns(messages: list[dict] | None, raw_prompt: list[dict], turn_texts: list[str]) -> list[dict]:
    """An agent trajectory as [{role, content}, ...]: the loop's `messages` when it kept them,
    else the prompt's messages and its assistant turns (`turn_texts`)."""
    if messages is None:
        messages = [*raw_prompt, *({"role": "assistant", "content": t} for t in turn_texts)]
    return [{"role": str(m["role"]), "content": _jsonable(m.get("content", ""))} for m in messages]


def _use_cpu_for_controller() -> None:
    try:
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # noqa: BLE001 - a backend already started (e.g. in tests): keep it
        pass


def _progress(config: RunConfig, start: int, *, total: int | None = None, desc: str | None = None):
    if not config.trainer.progress_bar:
        return None
    from tqdm import tqdm
    if desc is None:
        desc = "PPO" if config.algorithm.adv_estimator == "gae" else config.algorithm.adv_estimator.upper()
        desc = f"{config.trainer.experiment_name} {desc}"
    return tqdm(total=config.trainer.total_training_steps if total is None else total, initial=start,
                desc=desc, unit="step", dynamic_ncols=True)
