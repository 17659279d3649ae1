"""Kill points for `scripts/chaos.py`: `JAXRL_CHAOS_KILL_AT=<phase>:<step>` makes the process
SIGKILL itself the first time the run reaches `<phase>` at a training step >= `<step>`.

Phases (where the trainer calls `kill_point`):
  generation   the step's rollout is back, nothing of it trained yet (`RLTrainer._train_batch`)
  update       the actor's update is done, not yet synced or saved (`RLTrainer.train_step`)
  save         orbax has finalised the step directory, its completion marker is not written
               (`Checkpointer._mark_complete`; `step` is the checkpoint's)
  async_queue  a checkpoint was saved while the async trajectory queue or the prompts handed
               to the rollouter were not empty (`RLTrainer.save_checkpoint`)
  tool_call    an agent loop is about to run a tool call (`ToolAgentLoop._run_call`)

`step` is the step being trained, 1-based (the row it will log). Phases that do not know it
use the one the trainer last announced with `at_step` (in-process workers; a Ray worker process
sees 0 there). Before killing, one line `chaos: killed at <phase> step <step>` goes to stderr,
so the caller can tell where the kill landed. The variable is read once, at import; when it is
unset (every normal run) `kill_point` is one comparison.
"""
from __future__ import annotations

import os
import signal
import sys

ENV = "JAXRL_CHAOS_KILL_AT"
PHASES = ("generation", "update", "save", "async_queue", "tool_call")


def parse(spec: str | None) -> tuple[str, int] | None:
    """`"<phase>:<step>"` -> (phase, step); None/"" -> None; ValueError naming the variable."""
    if not spec:
        return None
    phase, _, step = spec.partition(":")
    if phase not in PHASES or not step.strip().isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected <phase>:<step> with phase one of "
                         f"{', '.join(PHASES)} and step a non-negative integer, e.g. update:3")
    return phase, int(step)


_target = parse(os.environ.get(ENV))
_step = 0


def at_step(step: int) -> None:
    """The trainer says which step it is training (for phases that do not know it)."""
    global _step
    _step = step


def kill_point(phase: str, step: int | None = None) -> None:
    """Kills this process here when `JAXRL_CHAOS_KILL_AT` names `phase` and a step <= this one."""
    if _target is None:
        return
    step = _step if step is None else step
    if phase == _target[0] and step >= _target[1]:
        _kill(phase, step)


def _kill(phase: str, step: int) -> None:
    print(f"chaos: killed at {phase} step {step}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
