"""`python -m jaxrl_llm.sft --config=configs/X.py`: supervised fine-tuning only.

Uses the config's `model`, `mesh` and `sft` sections (multi-turn `messages`, loss on assistant
tokens), then writes the model as a Hugging Face folder to `<trainer.default_local_dir>/hf_sft`.
Its metrics go to `<trainer.default_local_dir>/sft/` (metrics.jsonl, tensorboard/), the folder
the RL job's SFT warm start writes too; the RL run's own metrics.jsonl is left alone.
The RL job runs the same SFT as a warm start when `sft.steps > 0`.
"""
from __future__ import annotations

import json
import logging
import sys

from absl import app
from ml_collections import config_flags

from jaxrl_llm import _cli

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Run config file.",
                                          lock_config=True)


def run_sft(run) -> dict:
    from jaxrl_llm.metrics import MetricsLogger
    from jaxrl_llm.trainer import load_tokenizer
    from jaxrl_llm.trainer._sft_data import sft_batches, sft_dataset
    from jaxrl_llm.workers import HostWorker

    if run.sft.steps <= 0:
        raise ValueError("sft.steps must be > 0 for `python -m jaxrl_llm.sft`")
    tok = load_tokenizer(run)
    ds = sft_dataset(run, tok)
    host = HostWorker(run, vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id,
                      stop_token_ids=(tok.eos_token_id,))
    last = {}
    with MetricsLogger(f"{run.trainer.default_local_dir}/sft", backends=tuple(run.trainer.logger)) as logger:
        logger.rewind(-1)  # a new SFT run starts the file anew, as the RL job's warm start does
        for step, batch in enumerate(sft_batches(run, ds, tok.pad_token_id)):
            last = host.sft_step(batch)
            logger.log(last, step=step + 1)
    out = f"{run.trainer.default_local_dir}/hf_sft"
    host.export_sft(out, tokenizer=tok)
    host.close()
    return {"final": last, "hf_dir": out}


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO)
    run = _cli.load_run(_CONFIG)
    _cli.enable_compilation_cache()
    print(json.dumps(run_sft(run)))


if __name__ == "__main__":
    app.run(main, argv=sys.argv, flags_parser=_cli.parse_flags)
