"""The reward model and the generative judge in the streaming reward loop: the RM as a scoring
service batched over the trajectories waiting together (scores equal a plain full forward), the
judge's requests through a real `RolloutServer` over its own tiny random checkpoint (its reply is
noise, so a fixture parser reads the reply's length), the loop in the agent runner (what sync
agent rollouts run) and under the `Rollouter` (what the async modes run), the combination rule,
and the config errors."""
import asyncio
import json
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rollout
import sharding
from jaxrl_llm import agent, models, rewards
from jaxrl_llm.config import ConfigError, MultiTurnConfig, load_config
from jaxrl_llm.workers._roles import RewardModelWorker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARSERS = os.path.join(ROOT, "fixtures", "rewards", "judge_parsers.py")
QUICKSTART = os.path.join(os.path.dirname(ROOT), "configs", "quickstart.py")
TINY = models.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, model_type="qwen2", attention_bias=True)
TEMPLATE = "Q:{question} R:{response} T:{ground_truth} grade:"
P, T = 16, 16  # data.max_prompt_length / max_response_length of the RM's layout


@pytest.fixture(scope="module")
def tok():
    return models.CharTokenizer()


@pytest.fixture(scope="module")
def rm():
    """(the value model, a RewardModelWorker over it on one device, 2 rows per micro-batch)."""
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    model = sharding.init_sharded(lambda: models.ValueModel(TINY, rngs=nnx.Rngs(params=3)), mesh, "train")
    return model, RewardModelWorker(model, mesh=mesh, micro_per_device=2)


def full_forward_score(model, prompt, response) -> float:
    """The value at the response's last token of one unpadded sequence: the reference."""
    return float(model(jnp.asarray([list(prompt) + list(response)], jnp.int32))[0, -1])


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory, tok):
    """The judge's own engine + server over a tiny random checkpoint saved with the char tokenizer."""
    path = str(tmp_path_factory.mktemp("judge"))
    models.save_pretrained(models.init_model(TINY, seed=5), path, tokenizer=tok)
    engine = rollout.Engine.from_pretrained(path, max_concurrent_decodes=4, max_prefill_length=64,
                                            max_target_length=72, dtype="float32", temperature=0.0)
    server = rollout.RolloutServer(engine, steps_per_sync=4)
    yield path, server
    server.close()


def make_judge(server, tok, tmp_path, parser="reply_length", **kw):
    return rewards.Judge(server, tok, template=TEMPLATE, parser=rewards.make_score_parser(f"{PARSERS}:{parser}"),
                         sampling=rollout.SamplingParams(temperature=0.0), max_new_tokens=8,
                         max_prompt_length=64, log_path=str(tmp_path / "judge.jsonl"), log_every=1, **kw)


def rm_service(worker, **kw):
    return rewards.RewardModelService(lambda b: worker.compute_rm_score(b)["rm_scores"].sum(-1),
                                      max_prompt_length=P, max_response_length=T, pad_token_id=0,
                                      row_multiple=2, **kw)


# -- the combination rule ---------------------------------------------------------------------------
def test_combine_scores_is_the_weighted_sum_of_the_sources_that_ran():
    w = rewards.RewardWeights(rule=0.5, model=2.0, judge=-1.0)
    assert rewards.combine_scores(w, rule=1.0, model=0.25, judge=3.0) == pytest.approx(0.5 + 0.5 - 3.0)
    assert rewards.combine_scores(w, rule=1.0, judge=3.0) == pytest.approx(-2.5)  # no model: no term
    assert rewards.combine_scores(w, model=0.25) == pytest.approx(0.5)
    rows = rewards.combine_scores(w, rule=np.array([1.0, 0.0]), model=np.array([0.25, -1.0]),
                                  judge=np.array([3.0, 2.0]))
    np.testing.assert_allclose(rows, [-2.0, -4.0])  # the batch rollout's form: f32[b]
    assert rows.dtype == np.float32
    # auto (-1): the rule alone, or replaced by a model / judge (verl's rm_scores)
    assert rewards.resolve_rule_weight(-1, has_model=False, has_judge=False) == 1.0
    assert rewards.resolve_rule_weight(-1, has_model=True, has_judge=False) == 0.0
    assert rewards.resolve_rule_weight(-1, has_model=False, has_judge=True) == 0.0
    assert rewards.resolve_rule_weight(0.3, has_model=True, has_judge=True) == 0.3


# -- the reward model service -----------------------------------------------------------------------
def test_rm_service_scores_waiting_trajectories_in_one_forward_equal_to_a_full_forward(rm):
    """The first forward is held until the other four requests queued: they then go in one
    forward (rows padded to the micro-batch with copies, their scores dropped)."""
    model, worker = rm
    rows = [([20, 21, 22], [30, 31]), ([5] * P, [6] * T), ([40], [41, 42, 43]), ([50, 51], [52]),
            ([60, 61, 62, 63], [64, 65, 66])]
    service = None
    held = threading.Event()

    def score_fn(batch):
        if not held.is_set():
            held.set()
            with service._cv:  # the rest arrive while this forward runs
                assert service._cv.wait_for(lambda: len(service._queue) == len(rows) - 1, timeout=60)
        return worker.compute_rm_score(batch)["rm_scores"].sum(-1)

    service = rewards.RewardModelService(score_fn, max_prompt_length=P, max_response_length=T,
                                         pad_token_id=0, row_multiple=2)

    async def go():
        first = asyncio.ensure_future(service.score(*rows[0]))
        await asyncio.get_running_loop().run_in_executor(None, held.wait)  # its forward has started
        return list(await asyncio.gather(first, *(service.score(p, r) for p, r in rows[1:])))

    try:
        got = asyncio.run(go())
    finally:
        service.close()
    assert service.batch_sizes == [1, 4]
    want = [full_forward_score(model, p, r) for p, r in rows]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert len(set(np.round(want, 5))) == len(rows)  # distinct: each row got its own score


def test_rm_service_with_token_budget_and_packing_scores_as_a_full_forward(rm):
    """reward.model.use_dynamic_bsz and model.use_remove_padding reach the loop's forward: the
    service calls the same worker, here one with a 40-token budget that packs rows."""
    model, _ = rm
    worker = RewardModelWorker(model, mesh=rm[1].mesh, micro_per_device=2, remove_padding=True,
                               budget=(40, "reward.model.forward_max_token_len_per_device"))
    rows = [([20, 21, 22], [30, 31]), ([40], [41, 42, 43]), ([50, 51], [52])]
    service = rm_service(worker)
    try:
        got = asyncio.run(_gather(service, rows))
    finally:
        service.close()
    np.testing.assert_allclose(got, [full_forward_score(model, p, r) for p, r in rows], atol=1e-4)


async def _gather(service, rows):
    return list(await asyncio.gather(*(service.score(p, r) for p, r in rows)))


def test_rm_service_refuses_a_row_longer_than_the_layout(rm):
    service = rm_service(rm[1])
    try:
        with pytest.raises(ValueError, match="data.max_response_length=16"):
            asyncio.run(service.score([1], [2] * (T + 1)))
    finally:
        service.close()


# -- the judge ---------------------------------------------------------------------------------------
def test_judge_request_goes_through_the_rollout_server_and_is_logged(judge_server, tok, tmp_path):
    path, server = judge_server
    judge = make_judge(server, models.load_tokenizer(path), tmp_path)
    got = asyncio.run(judge.judge("3+4=", "7", "7"))
    ids, cut = judge.prompt_ids("3+4=", "7", "7")
    assert not cut and tok.decode(ids, skip_special_tokens=False) == "<user>Q:3+4= R:7 T:7 grade:<assistant>"
    # the same request straight to the server: the judgement is that reply, parsed
    direct = server.generate("direct", ids, sampling=rollout.SamplingParams(temperature=0.0), max_new_tokens=8)
    assert got.text == tok.decode(direct.token_ids) and got.parsed
    assert got.score == float(len(got.text)) and got.policy_version == direct.policy_version
    logged = [json.loads(line) for line in open(tmp_path / "judge.jsonl")]
    assert logged == [{"index": 0, "policy_version": got.policy_version, "question": "3+4=", "response": "7",
                       "ground_truth": "7", "judgement": got.text, "score": got.score, "parsed": True,
                       "truncated": False}]


def test_judge_prompt_keeps_its_last_tokens_and_a_failed_parse_scores_the_failure_score(judge_server, tmp_path):
    path, server = judge_server
    judge = make_judge(server, models.load_tokenizer(path), tmp_path, parser="never", failure_score=-2.0)
    ids, cut = judge.prompt_ids("x" * 80, "7", "7")
    assert cut and len(ids) == 64 and models.CharTokenizer().decode(ids).endswith("R:7 T:7 grade:")
    got = asyncio.run(judge.judge("1+1=", "2", "2"))
    assert (got.score, got.parsed) == (-2.0, False)


@pytest.mark.parametrize("spec,text,want", [("last_number", "a 3 then 7.5 end", 7.5),
                                            ("last_number", "no digits", None),
                                            (r"regex:Score: (\d+)", "Score: 4 ... Score: 9", 9.0),
                                            (r"regex:\d+", "x12y", 12.0)])
def test_score_parsers(spec, text, want):
    assert rewards.make_score_parser(spec)(text) == want


# -- the loop in the runner (sync) and under the rollouter (async) ----------------------------------
class _Out:
    def __init__(self, ids):
        self.token_ids, self.log_probs, self.finish_reason = ids, [-0.5] * len(ids), "stop"
        self.policy_versions = [0] * len(ids)


class ScriptedPolicy:
    """The policy's server: row r answers `answers[r % len(answers)]` + EOS."""

    def __init__(self, tok, answers):
        self.tok, self.answers = tok, answers

    async def agenerate(self, request_id, prompt_ids, *, sampling, max_new_tokens, session_id, seed, row):
        from jaxrl_llm.agent import TURN_ROW_STRIDE
        return _Out(self.tok.encode(self.answers[(row % TURN_ROW_STRIDE) % len(self.answers)]) + [1])

    def release_session(self, session_id):
        pass


def _runner(tok, loop):
    mt = MultiTurnConfig(enable=True, default_agent_loop="single_turn_agent", max_assistant_turns=0,
                         max_user_turns=0, max_parallel_calls=1, max_tool_response_length=256,
                         tool_response_truncate_side="middle", tool_timeout_s=5.0, tool_memory_limit_gb=4.0,
                         tool_workers=1, sandbox="process", tool_config_path="", function_tool_path="",
                         interaction_config_path="", format="hermes", tokenization_sanity_check_mode="strict")
    return agent.AgentRunner(ScriptedPolicy(tok, ["7", "8", "x7"]), tok, mt, max_prompt_length=P,
                             max_response_length=T, pad_token_id=0, tools={}, interactions={}, reward_loop=loop)


def _loop(rm, judge_server, tmp_path, weights):
    path, server = judge_server
    manager = rewards.RewardManager(num_workers=0)  # the built-in arithmetic scorer, in-process
    return rewards.RewardLoop(manager, model=rm_service(rm[1]),
                              judge=make_judge(server, models.load_tokenizer(path), tmp_path), weights=weights)


def _check_combined(rm, scores, extra, prompts, responses, weights):
    """Each row's score is the weighted sum of its three sources, each what it should be."""
    want_rule = [1.0 if r.strip() == "7" else 0.0 for r in responses]
    np.testing.assert_array_equal(extra["rule_score"], want_rule)
    want_rm = [full_forward_score(rm[0], p, r) for p, r in zip(prompts, responses_ids(responses))]
    np.testing.assert_allclose(extra["rm_score"], want_rm, atol=1e-4)
    assert all(s > 0 for s in extra["judge_score"])  # the reply's length: the judge answered
    np.testing.assert_allclose(scores, weights.rule * extra["rule_score"] + weights.model * extra["rm_score"]
                               + weights.judge * extra["judge_score"], rtol=1e-6)


def responses_ids(texts):
    tok = models.CharTokenizer()
    return [tok.encode(t) + [1] for t in texts]


def test_runner_scores_each_trajectory_with_rule_model_and_judge(rm, judge_server, tok, tmp_path):
    weights = rewards.RewardWeights(rule=2.0, model=0.5, judge=0.25)
    runner = _runner(tok, _loop(rm, judge_server, tmp_path, weights))
    samples = [agent.AgentSample(raw_prompt=[{"role": "user", "content": "3+4="}], data_source="arithmetic",
                                 ground_truth="7", extra_info={}, agent_name="", row=i) for i in range(3)]
    try:
        out = runner.run(samples, sampling=rollout.SamplingParams(temperature=1.0), seed=0)
    finally:
        runner.close()
    prompts = out["prompt_ids"]
    _check_combined(rm, out["scores"], out["reward_extra"], prompts, ["7", "8", "x7"], weights)
    m = out["metrics"]
    assert m["reward/judge/parse_failures"] == 0.0 and m["reward/judge/score/mean"] > 0
    assert m["reward_extra/rm_score/mean"] == pytest.approx(float(np.mean(out["reward_extra"]["rm_score"])))
    judged = [json.loads(line) for line in open(tmp_path / "judge.jsonl")]
    assert sorted(j["response"] for j in judged) == ["7", "8", "x7"] and all(j["question"] == "3+4=" for j in judged)


def test_rollouter_scores_groups_with_rule_model_and_judge(rm, judge_server, tok, tmp_path):
    """The async modes' producer: the same loop scores each trajectory of each group."""
    weights = rewards.RewardWeights(rule=1.0, model=1.0, judge=0.5)
    runner = _runner(tok, _loop(rm, judge_server, tmp_path, weights))
    r = agent.Rollouter(runner, sampling=rollout.SamplingParams(temperature=1.0), groups_per_sync=2,
                        staleness_threshold=0.0, partial_rollout=False)
    groups = [agent.PromptGroup(index=i, seed=7, first_row=i * 3, n=3,
                                sample=dict(raw_prompt=[{"role": "user", "content": f"{i}+7="}],
                                            data_source="arithmetic", ground_truth="7", extra_info={},
                                            agent_name=""))
              for i in range(2)]
    try:
        r.feed(groups)
        taken = r.take_batch(2, timeout=120)
    finally:
        r.close()
        runner.close()
    results = [res for g in sorted(taken.groups, key=lambda g: g.prompt.index) for res in g.results]
    extra = {k: np.asarray([res[3].extra[k] for res in results]) for k in ("rule_score", "rm_score", "judge_score")}
    scores = np.asarray([res[3].score for res in results])
    responses = [models.CharTokenizer().decode(res[1].response_ids) for res in results]
    _check_combined(rm, scores, extra, [res[1].prompt_ids for res in results], responses, weights)
    assert all(res[3].judgement is not None for res in results)


# -- config -------------------------------------------------------------------------------------------
def _load(tmp_path, **o):
    base = {"trainer.default_local_dir": str(tmp_path), "rollout.multi_turn.enable": True}
    return load_config(f"{QUICKSTART}:tiny", [f"{k}={v}" for k, v in {**base, **o}.items()])


@pytest.mark.parametrize("override,match", [
    ({"reward.judge.prompt_template": "Judge {answer}: {response}"}, r"reward.judge.prompt_template uses \{answer\}"),
    ({"reward.judge.prompt_template": "no response here {question}"}, r"reward.judge.prompt_template has no"),
    ({"reward.judge.prompt_template": "{response} {"}, "reward.judge.prompt_template: not a valid"),
    ({"reward.judge.score_parser": "first_number"}, r"reward.judge.score_parser='first_number' is not a parser"),
    ({"reward.judge.score_parser": "regex:(unclosed"}, "reward.judge.score_parser=.*does not compile"),
    ({"reward.judge.score_parser": f"{PARSERS}:missing"}, "reward.judge.score_parser=.*cannot load"),
    ({"reward.judge.model_path": "/no/such/judge"}, "reward.judge.model_path='/no/such/judge' is not a folder"),
    ({"rollout.multi_turn.enable": False}, "reward.judge.model_path='policy' .* batch rollout .* give the judge a"),
    ({"reward.judge.max_prompt_length": 40, "reward.judge.max_tokens": 1},
     r"reward.judge.max_prompt_length=40 \+ reward.judge.max_tokens=1 exceeds the policy engine's 40"),
    ({"reward.judge.temperature": -1.0}, "reward.judge.temperature must be >= 0"),
    ({"reward.judge.max_tokens": 0}, "reward.judge.max_tokens must be > 0"),
    ({"reward.rule_weight": -0.5}, "reward.rule_weight must be >= 0, or -1"),
])
def test_bad_judge_settings_are_config_errors_naming_the_field(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        _load(tmp_path, **{"reward.judge.enable": True, **override})


def test_rule_weight_zero_without_a_model_or_judge_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="reward.rule_weight=0 .* nothing would score"):
        _load(tmp_path, **{"reward.rule_weight": 0.0})


def test_async_modes_accept_a_reward_model(tmp_path):
    run = _load(tmp_path, **{"reward.model.path": str(tmp_path), "trainer.v1.trainer_mode": "colocate_async"})
    assert run.rollout_source == "colocated_buffer" and run.reward.model.path == str(tmp_path)
    run = _load(tmp_path, **{"reward.judge.enable": True, "reward.judge.score_parser": f"{PARSERS}:reply_length",
                             "reward.judge.max_prompt_length": 32, "reward.judge.max_tokens": 8})
    assert run.reward.judge.model_path == "policy"


def test_reward_model_in_the_loop_refuses_several_processes(tmp_path, monkeypatch):
    """The RM's forward spans the training mesh of every host: per-host streaming would break SPMD."""
    import types

    from jaxrl_llm.workers import _host
    run = _load(tmp_path, **{"reward.model.path": str(tmp_path)})
    monkeypatch.setattr(_host.jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"reward.model.path with agent or asynchronous rollouts .* \(this run: 2\)"):
        _host.HostWorker._reward_loop(types.SimpleNamespace(config=run), rewards.RewardManager(num_workers=0))
