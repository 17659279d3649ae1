"""Save and exactly resume an RL run with orbax.

`Checkpointer` writes one orbax step directory per save holding the array state (actor/critic
params, optimizer states, PRNG keys — sharded or not) and a JSON `meta` dict (data-iterator state,
KL-controller value, config); `restore` reads it back onto the shardings and dtypes of a target.
`resolve_resume` turns the trainer's `resume_mode` into a `(checkpoint_root, step)` pair, skipping
steps whose files fail their checksums (`NoUsableCheckpoint` when none is left);
`set_aside_steps` moves newer or broken steps out of the
way of a resumed run.

Exporting Hugging Face folders is left to `jaxrl_llm.models`.
"""
import os

from jaxrl_llm.checkpoint._manager import Checkpointer
from jaxrl_llm.checkpoint._resume import (NoUsableCheckpoint, finalized_steps, newest_valid_step,
                                          resolve_resume, set_aside_steps)
from jaxrl_llm.checkpoint._verify import COMPLETE_MARKER, verify_step



def checkpoint_root(run_dir: str) -> str:
    """Where a run keeps its step directories: `<run_dir>/checkpoints`."""
    return os.path.join(run_dir, "checkpoints")


__all__ = ["COMPLETE_MARKER", "Checkpointer", "NoUsableCheckpoint", "checkpoint_root", "finalized_steps",
           "newest_valid_step", "resolve_resume", "set_aside_steps", "verify_step"]
