"""The quickstart (a tiny transformer learns addition on CPU) trained fully asynchronously.

The rollouter generates on its own device (`placement.mode=separate`, one device for rollout,
the rest for training) while the trainer trains on finished groups from the trajectory queue
(`trainer.v1.trainer_mode=separate_async`, verl's fully async mode). The rollout may run half a
sync interval ahead (`num_warmup_batches=0.5`; `max_off_policy_threshold=1`: no trained group is
more than one weight sync old), requests in flight at a sync continue with the new weights
(`async_training.partial_rollout`), and token-level importance
weights correct for the stale tokens (`algorithm.rollout_correction.rollout_is=token`). Same
model, data, SFT warm start and steps as configs/quickstart.py; held-out accuracy rises the
same way (tests/trainer/test_trainer_quickstart_async.py checks +20 points).

Launch (minutes on 2 CPU cores; a CPU shows JAX one device unless told to split it):
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m jaxrl_llm.train --config=configs/quickstart_async.py
Variants: `local` runs the workers in-process; `tiny` is a short smoke run in its own folder,
`runs/quickstart_async-tiny/`.
"""
import importlib.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def _quickstart(arg):
    """configs/quickstart.py's config (same model, optimiser and variants), to build on."""
    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(_HERE, "quickstart.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(arg: str | None = None):
    variants = set(arg.split(",")) if arg else set()
    unknown = variants - {"local", "tiny"}
    if unknown:
        raise ValueError(f"unknown quickstart_async variant(s) {sorted(unknown)}; use 'local' and/or 'tiny'")
    quickstart = _quickstart(arg)
    c = quickstart.get_config(arg)
    c.placement.mode = "separate"
    c.placement.rollout_mesh.data = 1
    c.placement.rollout_mesh.fsdp = 1
    c.placement.rollout_mesh.tensor = 1
    v1 = c.trainer.v1
    v1.trainer_mode = "separate_async"
    v1.colocate_async.num_warmup_batches = 0.5
    v1.sampler.max_off_policy_threshold = 1
    # a step takes a whole loader batch: parameter_sync_step x ppo_mini_batch_size = train_batch_size
    v1.separate_async.parameter_sync_step = c.data.train_batch_size // c.actor.ppo_mini_batch_size
    c.async_training.partial_rollout = True
    c.algorithm.rollout_correction.rollout_is = "token"
    c.trainer.experiment_name = "quickstart_async"
    quickstart.use_run_dir(c, "runs/quickstart_async-tiny" if "tiny" in variants else "runs/quickstart_async")
    return c
