"""`python -m jaxrl_llm.train --config=configs/X.py[:variant] [--config.a.b=v ...]`: run a job.

Every config field, its default and meaning: docs/configs.md. The shipped configs (configs/)
say their variants and launch command in their docstrings.

Multi-host, local backend (`trainer.backend=local`): every host runs this same command;
`--coordinator_address`, `--num_processes` and `--process_id` (or the SLURM / TPU VM environment)
start `jax.distributed` first, and only process 0 writes metrics.

Multi-host, Ray backend (`trainer.backend=ray`): run it once, on a node of a Ray cluster, with
`--num_hosts=N`; this process stays the single controller (JAX on CPU) and starts one worker
actor per host, which call `jax.distributed.initialize` themselves (coordinator: a free port on
actor 0's node, or `--coordinator_address`).
"""
from __future__ import annotations

import json
import logging
import sys

from absl import app, flags
from ml_collections import config_flags

import sharding
from jaxrl_llm import _cli
from jaxrl_llm._disk import DiskFullError

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", _cli.CONFIG_HELP,
                                          lock_config=True)
_COORD = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Number of JAX processes (multi-host).")
_PID = flags.DEFINE_integer("process_id", None, "This process's id (multi-host).")
_HOSTS = flags.DEFINE_integer("num_hosts", None, "Ray backend: worker actors, one per host "
                              "(default --num_processes, else 1).")


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "orbax", "ray"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Ray's notice that token authentication is on (its default, kept) on every start
    logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)
    run = _cli.load_run(_CONFIG)
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.trainer._startup import check_data_files
    try:  # a data file the config names that is not there: one line, before anything starts
        check_data_files(run)
    except ConfigError as e:
        _cli.fail(str(e))
    _cli.enable_compilation_cache()
    done = _cli.completed_step(run)
    if done is not None:  # nothing to train: say so before starting Ray or compiling anything
        print(f"{run.trainer.default_local_dir} is complete: its newest checkpoint is step {done} of "
              f"trainer.total_training_steps={run.trainer.total_training_steps}. Raise "
              "trainer.total_training_steps to train further, set trainer.val_only=True to validate "
              "it, or delete the folder to start over.", flush=True)
        return
    from jaxrl_llm.trainer import RLTrainer

    if run.trainer.backend == "ray":
        # the controller never joins jax.distributed: the Ray actors are the JAX processes
        num_hosts = _HOSTS.value or _NPROC.value or 1
        distributed = {"coordinator_address": _COORD.value} if _COORD.value else None
        trainer = RLTrainer(run, num_hosts=num_hosts, distributed=distributed)
    else:
        if _HOSTS.value not in (None, 1):
            raise app.UsageError("--num_hosts is for trainer.backend=ray; with the local backend start "
                                 "one process per host with --num_processes/--process_id")
        sharding.initialize_distributed(coordinator_address=_COORD.value, num_processes=_NPROC.value,
                                        process_id=_PID.value)
        trainer = RLTrainer(run)
    try:
        final = trainer.fit()
    except DiskFullError as e:  # one line, not a traceback per thread that hit the full disk
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    print(json.dumps({"final_validation": final, "run_dir": run.trainer.default_local_dir}))


def run_main() -> None:
    app.run(main, argv=sys.argv, flags_parser=_cli.parse_flags)


if __name__ == "__main__":
    run_main()
