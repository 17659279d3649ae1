"""A scripted stand-in for the rollout server (see conftest.py)."""
import dataclasses


@dataclasses.dataclass
class FakeOutput:
    token_ids: list
    log_probs: list
    finish_reason: str
    policy_versions: list = dataclasses.field(default_factory=list)


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
