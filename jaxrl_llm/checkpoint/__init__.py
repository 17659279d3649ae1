"""Save and exactly resume an RL run with orbax.

`Checkpointer` writes one orbax step directory per save holding the array state (actor/critic
params, optimizer states, PRNG keys — sharded or not) and a JSON `meta` dict (data-iterator state,
KL-controller value, config); `restore` reads it back onto the shardings and dtypes of a target.
`resolve_resume` turns the trainer's `resume_mode` into a `(checkpoint_root, step)` pair.

Exporting Hugging Face folders is left to `jaxrl_llm.models`.
"""
from jaxrl_llm.checkpoint._manager import Checkpointer
from jaxrl_llm.checkpoint._resume import finalized_steps, resolve_resume

__all__ = ["Checkpointer", "finalized_steps", "resolve_resume"]
