"""`python -m jaxrl_llm.train --config=configs/X.py[:variant] [--config.a.b=v ...]`: run a job.

Multi-host: every host runs this same command; `--coordinator_address`, `--num_processes` and
`--process_id` (or SLURM / TPU VM environment) start `jax.distributed` first.
"""
from __future__ import annotations

import json
import logging
import sys

from absl import app, flags
from ml_collections import config_flags

import sharding
from jaxrl_llm.config import to_run_config

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Run config file.",
                                          lock_config=True)
_COORD = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Number of JAX processes (multi-host).")
_PID = flags.DEFINE_integer("process_id", None, "This process's id (multi-host).")


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src", "orbax", "ray"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    run = to_run_config(_CONFIG.value)
    sharding.initialize_distributed(coordinator_address=_COORD.value, num_processes=_NPROC.value,
                                    process_id=_PID.value)
    from jaxrl_llm.trainer import RLTrainer

    final = RLTrainer(run).fit()
    print(json.dumps({"final_validation": final, "run_dir": run.trainer.default_local_dir}))


def run_main() -> None:
    app.run(main, argv=sys.argv)


if __name__ == "__main__":
    run_main()
