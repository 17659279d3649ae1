"""`python -m jaxrl_llm.sft --config=configs/X.py`: supervised fine-tuning only.

Uses the config's `model`, `mesh` and `sft` sections (multi-turn `messages`, loss on assistant
tokens; rows from `sft.train_files`, else the built-in task's demonstrations). Everything it
writes goes to its own folder, `<trainer.default_local_dir>/sft_only/`: `config.json`,
`metrics.jsonl` and `tensorboard/`, and the model as a Hugging Face folder in `hf/`. It never
writes the RL run's files there (checkpoints/, metrics.jsonl, the warm start's `sft/`), so it can
run in an RL run's folder before or after the RL job. The RL job runs the same SFT as a warm
start when `sft.steps > 0` (its metrics in `<run>/sft/`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

from absl import app
from ml_collections import config_flags

from jaxrl_llm import _cli
from jaxrl_llm.config import ConfigError

log = logging.getLogger(__name__)

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Run config file.",
                                          lock_config=True)


SFT_ONLY_DIR = "sft_only"


def run_sft(run) -> dict:
    """Trains `sft.steps` steps and exports the model; returns the last metrics and the paths."""
    from jaxrl_llm.metrics import MetricsLogger
    from jaxrl_llm.trainer import load_tokenizer
    from jaxrl_llm.trainer._sft_data import sft_batches, sft_dataset
    from jaxrl_llm.trainer._startup import check_data_files, write_config_json
    from jaxrl_llm.workers import HostWorker

    if run.sft.steps <= 0:
        raise ConfigError(f"sft.steps={run.sft.steps}: `python -m jaxrl_llm.sft` needs sft.steps > 0 "
                          "(e.g. --config.sft.steps=300)")
    check_data_files(run)
    folder = os.path.join(run.trainer.default_local_dir, SFT_ONLY_DIR)
    # the worker writes under its config's run folder (e.g. its checkpoint root): give it ours
    run = dataclasses.replace(run, trainer=dataclasses.replace(run.trainer, default_local_dir=folder))
    os.makedirs(folder, exist_ok=True)
    write_config_json(run, folder)
    tok = load_tokenizer(run)
    ds = sft_dataset(run, tok)
    source = ", ".join(run.sft.train_files) or f"built-in {run.data.builtin_task} demonstrations"
    log.info("sft data: %s (%d rows); writing to %s", source, len(ds), folder)
    host = HostWorker(run, vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id,
                      stop_token_ids=(tok.eos_token_id,))
    last = {}
    with MetricsLogger(folder, backends=tuple(run.trainer.logger)) as logger:
        logger.rewind(-1)  # a new SFT run starts the file anew
        for step, batch in enumerate(sft_batches(run, ds, tok.pad_token_id)):
            last = host.sft_step(batch)
            logger.log(last, step=step + 1)
    out = os.path.join(folder, "hf")
    host.export_sft(out, tokenizer=tok)
    host.close()
    return {"final": last, "hf_dir": out, "run_dir": folder}


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO)
    run = _cli.load_run(_CONFIG)
    _cli.enable_compilation_cache()
    try:
        result = run_sft(run)
    except ConfigError as e:  # e.g. a missing sft.train_files file: one line, exit status 2
        _cli.fail(str(e))
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main, argv=sys.argv, flags_parser=_cli.parse_flags)
