"""`configs/grpo_gsm8k.py` runs end to end on a tiny local stand-in for a Qwen2.5 folder + gsm8k
parquet (written here: nothing is downloaded), and bad inputs fail with clear errors."""
import os

import pytest
from flax import nnx

import sharding
from jaxrl_llm import data, models
from jaxrl_llm.config import load_config
from jaxrl_llm.data import DataError
from jaxrl_llm.trainer import RLTrainer

from trainer_helpers import ROOT

TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "models", "tokenizer_chatml")


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    root = tmp_path_factory.mktemp("gsm8k")
    tok = models.load_tokenizer(TOKENIZER)
    cfg = models.ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             model_type="qwen2", attention_bias=True, tie_word_embeddings=True)
    mesh = sharding.make_mesh((1, 8, 1))
    model = sharding.init_sharded(lambda: models.CausalLM(cfg, rngs=nnx.Rngs(params=0)), mesh, "train")
    models.save_pretrained(model, root / "Qwen2.5-tiny", tokenizer=TOKENIZER)
    records = [{"question": f"Tom has {a} apples and buys {b}. How many?", "answer": f"{a}+{b}=#### {a + b}"}
               for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (4, 1), (6, 3), (9, 9)]]
    data.write_rows(root / "train.parquet", data.tasks.gsm8k_rows(records, split="train"))
    data.write_rows(root / "test.parquet", data.tasks.gsm8k_rows(records[:4], split="test"))
    return root


def _overrides(standin, run_dir, **extra):
    o = {"model.path": standin / "Qwen2.5-tiny", "data.train_files": standin / "train.parquet",
         "data.val_files": standin / "test.parquet", "data.train_batch_size": 4,
         "data.val_batch_size": 4, "data.max_prompt_length": 128, "data.max_response_length": 8,
         "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size_per_device": 1,
         "rollout.n": 4, "rollout.max_concurrent_decodes": 16, "model.dtype": "float32",
         "trainer.backend": "local", "trainer.total_training_steps": 1, "trainer.default_local_dir": run_dir,
         "trainer.progress_bar": False, "trainer.plot": False, "trainer.async_save": False,
         "reward.num_workers": 1}
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def test_grpo_gsm8k_config_runs_on_a_local_standin(standin, tmp_path):
    run = load_config(os.path.join(ROOT, "configs", "grpo_gsm8k.py"), _overrides(standin, tmp_path / "run"))
    assert run.actor.use_kl_loss and run.algorithm.adv_estimator == "grpo"
    final = RLTrainer(run).fit()
    assert "val-core/openai/gsm8k/reward/mean@1" in final
    # the actor comes back as a Hugging Face folder that our loader (and transformers) can read
    reloaded = models.from_pretrained(tmp_path / "run" / "hf_actor")
    assert reloaded.config.vocab_size == models.load_tokenizer(TOKENIZER).vocab_size
    assert os.path.exists(tmp_path / "run" / "hf_actor" / "tokenizer.json")


def test_bad_data_row_names_file_and_row(standin, tmp_path):
    bad = tmp_path / "bad.parquet"
    rows = data.read_rows(standin / "train.parquet")
    del rows[2]["reward_model"]
    _write_raw(bad, rows)
    run = load_config(os.path.join(ROOT, "configs", "grpo_gsm8k.py"),
                      _overrides(standin, tmp_path / "run", **{"data.train_files": bad}))
    with pytest.raises(DataError, match=r"bad\.parquet.*row 2"):
        RLTrainer(run)


def _write_raw(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_missing_model_folder_is_a_clear_error(standin, tmp_path):
    run = load_config(os.path.join(ROOT, "configs", "grpo_gsm8k.py"),
                      _overrides(standin, tmp_path / "run", **{"model.path": tmp_path / "no_such_model",
                                                               "model.tokenizer": TOKENIZER}))
    with pytest.raises(Exception, match="no_such_model"):
        RLTrainer(run)
