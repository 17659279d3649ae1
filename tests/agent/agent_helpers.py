"""Scripted stand-ins for the rollout server (see conftest.py) and the rollouter tests' runner
and prompts."""
import asyncio
import dataclasses
import threading

import numpy as np


@dataclasses.dataclass
class FakeOutput:
    token_ids: list
    log_probs: list
    finish_reason: str
    policy_versions: list = dataclasses.field(default_factory=list)
    request_id: str = ""
    num_cached_tokens: int = 0


class ScriptedServer:
    """`replies[row][k]` is the text of turn k of the trajectory with that row (an EOS is
    appended unless the budget cuts it); records every request."""

    def __init__(self, tokenizer, replies, logprob=-0.5):
        self.tok, self.replies, self.logprob = tokenizer, replies, logprob
        self.requests, self.released = [], []
        self.hooks = {}  # row -> async callable run before answering that row's first turn
        self.version = 0  # the policy version stamped on every token

    async def agenerate(self, request_id, prompt_ids, *, sampling, max_new_tokens, session_id,
                        seed, row):
        from jaxrl_llm.agent import TURN_ROW_STRIDE
        base, _ = row % TURN_ROW_STRIDE, row // TURN_ROW_STRIDE
        self.requests.append(dict(request_id=request_id, prompt_ids=list(prompt_ids),
                                  max_new_tokens=max_new_tokens, session_id=session_id, row=row))
        if base in self.hooks and not any(r["row"] % TURN_ROW_STRIDE == base for r in self.requests[:-1]):
            await self.hooks[base]()
        turn = sum(1 for r in self.requests if r["session_id"] == session_id) - 1
        ids = self.tok.encode(self.replies[base][turn]) + [self.tok.eos_token_id]
        reason = "stop"
        if len(ids) > max_new_tokens:
            ids, reason = ids[:max_new_tokens], "length"
        return FakeOutput(ids, [self.logprob] * len(ids), reason, [self.version] * len(ids))

    def release_session(self, session_id):
        self.released.append(session_id)


class TokenServer:
    """Emits a request's tokens one at a time (a short sleep each), every token stamped with the
    policy version of the moment; the tokens and the length depend only on (seed, row). A
    request whose seed is in `fail_seeds` raises."""

    def __init__(self, max_len=12, delay=0.002, fail_seeds=()):
        self.version, self.max_len, self.delay = 0, max_len, delay
        self.fail_seeds = set(fail_seeds)
        self.lock = threading.Lock()

    async def agenerate(self, request_id, prompt_ids, *, sampling, max_new_tokens, session_id, seed, row):
        if seed in self.fail_seeds:
            raise RuntimeError(f"engine on fire (seed {seed})")
        rng = np.random.default_rng([seed, row])
        n = int(min(rng.integers(1, self.max_len + 1), max_new_tokens))
        ids = rng.integers(ord("a"), ord("z") + 1, size=n).tolist()
        versions = []
        for _ in range(n):
            await asyncio.sleep(self.delay * rng.uniform(0.2, 3.0))
            versions.append(self.version)
        return FakeOutput(ids, [-0.5] * n, "length", versions)

    def release_session(self, session_id):
        pass


class GatedServer:
    """Each request (keyed by its seed) emits `lengths.get(seed, 2)` tokens: the first at once,
    the rest after the test `release`s the seed (all seeds in `released` pass straight through);
    every token carries the policy version of the moment it is emitted. Seeds in `fail_seeds`
    raise (once released). `wait_arrived(n)` blocks until n requests reached the server."""

    def __init__(self, released=(), fail_seeds=(), lengths=None):
        self.version = 0
        self.open, self.fail_seeds, self.lengths = set(released), set(fail_seeds), dict(lengths or {})
        self.gates, self.loop, self.arrived = {}, None, 0
        self.cv = threading.Condition()

    def release(self, *seeds):
        with self.cv:
            for s in seeds:
                self.open.add(s)
                if s in self.gates:
                    self.loop.call_soon_threadsafe(self.gates[s].set)

    def wait_arrived(self, n, timeout=30):
        with self.cv:
            assert self.cv.wait_for(lambda: self.arrived >= n, timeout), f"{self.arrived} of {n} arrived"

    async def agenerate(self, request_id, prompt_ids, *, sampling, max_new_tokens, session_id, seed, row):
        n = self.lengths.get(seed, 2)
        versions = [self.version]
        with self.cv:
            self.loop = asyncio.get_running_loop()
            gate = None if seed in self.open else self.gates.setdefault(seed, asyncio.Event())
            self.arrived += 1
            self.cv.notify_all()
        if gate is not None:
            await gate.wait()
        if seed in self.fail_seeds:
            raise RuntimeError(f"engine on fire (seed {seed})")
        versions += [self.version] * (n - 1)
        return FakeOutput([ord("a")] * n, [-0.5] * n, "length", versions)

    def release_session(self, session_id):
        pass


def make_runner(server, tok, reward_loop=None):
    from jaxrl_llm import agent
    from jaxrl_llm.config import MultiTurnConfig
    mt = MultiTurnConfig(enable=False, default_agent_loop="single_turn_agent", max_assistant_turns=0,
                         max_user_turns=0, max_parallel_calls=1, max_tool_response_length=256,
                         tool_response_truncate_side="middle", tool_timeout_s=5.0,
                         tool_memory_limit_gb=4.0, tool_workers=1, sandbox="process",
                         tool_config_path="",
                         function_tool_path="", interaction_config_path="", format="hermes",
                         tokenization_sanity_check_mode="strict")
    return agent.AgentRunner(server, tok, mt, max_prompt_length=16, max_response_length=16,
                             pad_token_id=0, tools={}, interactions={}, reward_loop=reward_loop)


def prompt_groups(start, count, n=2, seed=7, extra_info=None):
    """Prompt groups with indices start .. start+count-1; `seed=None` gives group i seed i."""
    from jaxrl_llm import agent
    return [agent.PromptGroup(index=i, seed=i if seed is None else seed, first_row=(i % 4) * n, n=n,
                              sample=dict(raw_prompt=[{"role": "user", "content": f"{i}+1="}],
                                          data_source="arithmetic", ground_truth=str(i + 1),
                                          extra_info=dict(extra_info or {}), agent_name=""))
            for i in range(start, start + count)]
