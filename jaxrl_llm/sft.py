"""`python -m jaxrl_llm.sft --config=configs/X.py`: supervised fine-tuning only.

Uses the config's `model`, `mesh` and `sft` sections (multi-turn `messages`, loss on assistant
tokens), then writes the model as a Hugging Face folder to `<trainer.default_local_dir>/hf_sft`.
The RL job runs the same SFT as a warm start when `sft.steps > 0`.
"""
from __future__ import annotations

import json
import logging
import sys

import numpy as np
from absl import app
from ml_collections import config_flags

from jaxrl_llm import data
from jaxrl_llm.config import to_run_config

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Run config file.",
                                          lock_config=True)


def run_sft(run) -> dict:
    from jaxrl_llm.metrics import MetricsLogger
    from jaxrl_llm.trainer import load_tokenizer
    from jaxrl_llm.workers import HostWorker

    s, d = run.sft, run.data
    if s.steps <= 0:
        raise ValueError("sft.steps must be > 0 for `python -m jaxrl_llm.sft`")
    tok = load_tokenizer(run)
    if s.train_files:
        ds = data.SFTDataset(list(s.train_files)[0] if len(s.train_files) == 1 else list(s.train_files),
                             tok, max_length=s.max_length, messages_key=s.messages_key)
    else:
        rows = data.tasks.make_arithmetic_sft_rows(s.builtin_size, d.seed + 7, max_operand=d.builtin_max_operand,
                                                       off_by_one=s.builtin_off_by_one,
                                                       trailing_junk=s.builtin_trailing_junk)
        ds = data.SFTDataset(rows, tok, max_length=s.max_length)
    host = HostWorker(run, vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id,
                      stop_token_ids=(tok.eos_token_id,))
    rng = np.random.default_rng(run.trainer.seed)
    last = {}
    with MetricsLogger(run.trainer.default_local_dir, backends=tuple(run.trainer.logger)) as logger:
        for step in range(s.steps):
            idx = rng.choice(len(ds), size=s.batch_size, replace=len(ds) < s.batch_size)
            batch = data.collate_sft([ds[int(i)] for i in idx], tok.pad_token_id, s.max_length)
            last = host.sft_step({k: np.asarray(v) for k, v in batch.items()})
            logger.log(last, step=step + 1)
    out = f"{run.trainer.default_local_dir}/hf_sft"
    host.export_sft(out, tokenizer=tok)
    host.close()
    return {"final": last, "hf_dir": out}


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO)
    print(json.dumps(run_sft(to_run_config(_CONFIG.value))))


if __name__ == "__main__":
    app.run(main, argv=sys.argv)
