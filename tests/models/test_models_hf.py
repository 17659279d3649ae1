"""Hugging Face I/O: parity with transformers' logits (fixtures made by
scripts/make_model_fixtures.py), exact save/reload round trips, config layouts, clear errors."""
import functools
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxrl_llm import models

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models")
CAUSAL = ["qwen2", "qwen2_tied", "qwen3", "llama3"]


def fixture(name):
    return os.path.join(FIXTURES, name)


def reference(name):
    return dict(np.load(os.path.join(fixture(name), "reference.npz")))


@functools.cache
def _jitted(graphdef):
    return jax.jit(lambda s, i, m: nnx.merge(graphdef, s)(i, attention_mask=m))


def forward(model, ids, attention_mask=None):
    """Jitted full forward; an all-ones mask by default so every call shares one compilation."""
    graphdef, state = nnx.split(model)
    mask = np.ones(np.shape(ids), np.int32) if attention_mask is None else attention_mask
    return np.asarray(_jitted(graphdef)(state, jnp.asarray(ids), jnp.asarray(mask)))


@functools.cache
def loaded(name):
    """The fixture model, loaded once per test session (tests never modify it)."""
    return models.from_pretrained(fixture(name))


def copy_fixture(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(fixture(name), dst)
    return dst


def params(model):
    return {"/".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("name", CAUSAL)
def test_logits_match_transformers_within_1e_4(name):
    model = loaded(name)
    ref = reference(name)
    logits = forward(model, ref["input_ids"])
    assert logits.shape == ref["logits"].shape
    assert np.abs(logits - ref["logits"]).max() <= 1e-4


def test_family_features_are_read_from_config():
    q2, tied, q3, llama = (loaded(n).config for n in CAUSAL)
    assert q2.attention_bias and not q2.tie_word_embeddings and q2.num_key_value_heads == 2
    assert tied.tie_word_embeddings
    assert q3.qk_norm and q3.head_dim == 16 and q3.head_dim * q3.num_attention_heads != q3.hidden_size
    assert llama.rope_scaling == models.RopeScaling(8.0, 1.0, 4.0, 64)
    assert llama.rope_theta == 500000.0 and not llama.attention_bias


def test_value_model_matches_transformers_token_classification():
    model = loaded("qwen2_value")
    assert isinstance(model, models.ValueModel)
    ref = reference("qwen2_value")
    assert np.abs(forward(model, ref["input_ids"]) - ref["values"]).max() <= 1e-4


def test_greedy_argmax_reproduces_recorded_hf_generate():
    for name in CAUSAL:
        with open(os.path.join(fixture(name), "generate.json")) as f:
            gen = json.load(f)
        cases = gen["cases"]
        # both prompts in one [2, 16] batch, right-padded: causal attention makes the padding
        # after a row's last token harmless, and the shape matches the parity test's compilation
        buf = np.zeros(reference(name)["input_ids"].shape, np.int32)
        lengths = [len(c["prompt"]) for c in cases]
        for row, c in enumerate(cases):
            buf[row, : lengths[row]] = c["prompt"]
        for k in range(gen["max_new_tokens"]):
            logits = forward(loaded(name), buf)
            for row, n in enumerate(lengths):
                buf[row, n + k] = int(np.argmax(logits[row, n + k - 1]))
        for row, c in enumerate(cases):
            assert buf[row, lengths[row]: lengths[row] + gen["max_new_tokens"]].tolist() == c["output"], name


def test_left_padded_batch_matches_unpadded_rows():
    model = loaded("qwen2")
    ref = reference("qwen2")
    ids, pad = ref["input_ids"], 5
    short = ids[1, : ids.shape[1] - pad]
    left = np.stack([ids[0], np.concatenate([np.full(pad, 7, np.int32), short])])
    mask = np.ones_like(left)
    mask[1, :pad] = 0
    padded = forward(model, left, attention_mask=mask)
    right = np.stack([ids[0], np.concatenate([short, np.full(pad, 7, np.int32)])])
    alone = forward(model, right)[1, : len(short)]  # causal: right padding cannot leak back
    assert np.abs(padded[1, pad:] - alone).max() <= 1e-5
    assert np.abs(padded[0] - ref["logits"][0]).max() <= 1e-4
    # without the mask the padding leaks into the real tokens: the comparison can fail
    leaky = forward(model, left)
    assert np.abs(leaky[1, pad:] - alone).max() > 1e-3


def test_legacy_top_level_rope_config_loads_same_as_rope_parameters(tmp_path):
    folder = copy_fixture("llama3", tmp_path)
    with open(folder / "config.json") as f:
        hf = json.load(f)
    assert "rope_parameters" in hf and "rope_theta" not in hf  # the fixture is transformers-5 style
    rope = hf.pop("rope_parameters")
    hf["rope_theta"] = rope.pop("rope_theta")
    hf["rope_scaling"] = dict(rope, type=rope.pop("rope_type"))
    (folder / "config.json").write_text(json.dumps(hf))
    legacy = models.from_pretrained(folder)
    new = loaded("llama3")
    assert legacy.config == new.config
    ids = reference("llama3")["input_ids"]
    np.testing.assert_array_equal(forward(legacy, ids), forward(new, ids))


def test_config_to_hf_and_back_is_identity():
    for name in CAUSAL + ["qwen2_value"]:
        config = loaded(name).config
        hf = models.config_to_hf(config, value_head=name.endswith("value"))
        assert models.config_from_hf(hf, dtype=config.dtype) == config
        with open(os.path.join(fixture(name), "config.json")) as f:
            original = json.load(f)
        for key, value in original.items():
            if key not in ("transformers_version", "rope_parameters", "rope_theta"):
                assert hf[key] == value, (name, key)
        assert hf["rope_parameters"] == original["rope_parameters"]


@pytest.mark.parametrize("name", ["qwen2", "qwen2_tied", "qwen3", "llama3", "qwen2_value"])
def test_save_writes_exactly_the_tensors_transformers_wrote(name, tmp_path):
    model = loaded(name)
    models.save_pretrained(model, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    ours = load_file(tmp_path / "out" / "model.safetensors")
    theirs = load_file(os.path.join(fixture(name), "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape, key
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    assert ("lm_head.weight" in ours) == (name in ("qwen2", "qwen3", "llama3"))


def test_sharded_checkpoint_with_index_round_trips_exactly(tmp_path):
    model = loaded("qwen3")
    out = tmp_path / "sharded"
    models.save_pretrained(model, out, max_shard_size="30KB")
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(os.path.getsize(out / f) < 30_000 + 4096 for f in files)
    assert sorted(index["weight_map"]) == sorted(load_file(os.path.join(fixture("qwen3"), "model.safetensors")))
    assert index["metadata"]["total_size"] == models.count_params(model) * 4
    reloaded = models.from_pretrained(out)
    a, b = params(model), params(reloaded)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_value_head_round_trip_and_fresh_head_from_causal_checkpoint(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        value = models.from_pretrained(fixture("qwen2"), value_head=True, seed=3)
    assert isinstance(value, models.ValueModel) and "fresh value head" in caplog.text
    assert np.abs(params(value)["score/kernel"]).max() > 0
    np.testing.assert_array_equal(params(value)["model/norm/scale"], params(loaded("qwen2"))["model/norm/scale"])
    models.save_pretrained(value, tmp_path / "v")
    with open(tmp_path / "v" / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen2ForTokenClassification"]
    names = load_file(tmp_path / "v" / "model.safetensors")
    assert names["score.weight"].shape == (1, 32) and names["score.bias"].shape == (1,)
    assert "lm_head.weight" not in names
    back = models.from_pretrained(tmp_path / "v")
    assert isinstance(back, models.ValueModel)
    a, b = params(value), params(back)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_bfloat16_load_and_save_keep_bf16(tmp_path):
    model = models.from_pretrained(fixture("qwen2"), dtype=jnp.bfloat16)
    assert {v.dtype for v in params(model).values()} == {jnp.dtype(jnp.bfloat16)}
    ref = reference("qwen2")
    logits = forward(model, ref["input_ids"])
    assert np.abs(logits - ref["logits"]).max() < 0.25  # bf16 round-off, not a wrong mapping
    models.save_pretrained(model, tmp_path / "bf16")
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    back = models.from_pretrained(tmp_path / "bf16", dtype="bfloat16")
    a, b = params(model), params(back)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    mixed = models.from_pretrained(fixture("qwen2"), dtype=jnp.bfloat16, param_dtype=jnp.float32)
    assert mixed.config.dtype == jnp.bfloat16 and params(mixed)["lm_head/kernel"].dtype == np.float32


def test_qwen25_7b_parameter_count_by_eval_shape():
    hf = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064,
              hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
              num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0,
              rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
              torch_dtype="bfloat16", use_sliding_window=False)
    config = models.config_from_hf(hf, param_dtype="bfloat16")
    abstract = models.abstract_model(config)
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert models.count_params(abstract) == 7_615_616_512


# ------------------------------------------------------------------------------- errors

def _rewrite_tensors(folder, edit):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_unknown_architecture_is_named(tmp_path):
    folder = copy_fixture("qwen2", tmp_path)
    hf = json.loads((folder / "config.json").read_text())
    hf["architectures"] = ["MistralForCausalLM"]
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        models.from_pretrained(folder)


def test_missing_tensor_is_named(tmp_path):
    folder = copy_fixture("qwen2", tmp_path)
    _rewrite_tensors(folder, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.mlp\.down_proj\.weight"):
        models.from_pretrained(folder)


def test_wrong_shape_is_named(tmp_path):
    folder = copy_fixture("qwen3", tmp_path)
    _rewrite_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight":
                                                 np.zeros((16, 32), np.float32)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(16, 32\).*\(32, 32\)"):
        models.from_pretrained(folder)


def test_unexpected_tensor_is_named_but_rotary_inv_freq_is_ignored(tmp_path):
    folder = copy_fixture("llama3", tmp_path)
    _rewrite_tensors(folder, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(4, np.float32)}))
    models.from_pretrained(folder)
    _rewrite_tensors(folder, lambda t: t.update({"model.layers.0.mlp.gate_proj.bias": np.zeros(64, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected .*model\.layers\.0\.mlp\.gate_proj\.bias"):
        models.from_pretrained(folder)


def test_missing_config_field_and_missing_files_are_named(tmp_path):
    folder = copy_fixture("qwen2", tmp_path)
    hf = json.loads((folder / "config.json").read_text())
    del hf["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="intermediate_size"):
        models.from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="yarn"):
        models.config_from_hf(dict(hf, intermediate_size=64, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}))


def test_fixture_script_dry_run_lists_the_committed_fixtures():
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "make_model_fixtures.py")
    out = subprocess.run([sys.executable, script, "--dry-run", "--out", FIXTURES],
                         capture_output=True, text=True, check=True).stdout.split()
    names = ["qwen2_value", "qwen3_moe", "mixtral", "qwen3_moe_mixed", "tokenizer_chatml"]
    assert [os.path.basename(p) for p in out] == CAUSAL + names
    assert all(os.path.isdir(p) for p in out)
