"""SmolLM2-135M-Instruct runs here exactly as in transformers.

CI part: a tiny random Llama of SmolLM2's configuration family (vocabulary 49,152, tied
embeddings, GQA, explicit head_dim, bf16 safetensors) with SmolLM2's real tokenizer files; the
expected values were recorded by scripts/make_smollm2_fixture.py with transformers.

Real-weights part (skipped unless JAXRL_SMOLLM2_PATH names the folder that
scripts/fetch_smollm2.py wrote; it then needs the `dev` extra, transformers and torch):
    JAXRL_SMOLLM2_PATH=/tmp/smollm2 python -m pytest -q tests/models/test_models_smollm2.py
"""
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rollout
from jaxrl_llm import models

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "smollm2_tiny")
REAL = os.environ.get("JAXRL_SMOLLM2_PATH")
real_only = pytest.mark.skipif(not REAL, reason="JAXRL_SMOLLM2_PATH (scripts/fetch_smollm2.py) not set")
NEAR_TIE = 1e-3  # a top-1/top-2 logit margin below this may flip under fp32 round-off


@functools.cache
def expected():
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        return json.load(f)


@functools.cache
def tiny():
    return models.from_pretrained(FIXTURE)


@functools.cache
def _jitted(graphdef):
    return jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))


def forward(model, ids):
    graphdef, state = nnx.split(model)
    return np.asarray(_jitted(graphdef)(state, jnp.asarray(np.asarray(ids, np.int32)[None])))[0]


def params(model):
    return {"/".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def raw_tensors(file):
    """{name: (dtype, shape, bytes)} of a safetensors file (numpy has no bfloat16 to load into)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def agree_until_near_tie(got, want, margins):
    """Greedy outputs must agree token for token, except after a step whose recorded top-1/top-2
    margin is a near tie (there fp32 round-off may legitimately pick the other token)."""
    for k, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert margins[k] < NEAR_TIE, f"step {k}: {a} != {b} (margin {margins[k]})"
            return False
    assert len(got) == len(want), (got, want)
    return True


# ------------------------------------------------------------------------------ CI (fixture)

def test_tiny_fixture_is_smollm2s_configuration_family():
    c = tiny().config
    assert (c.model_type, c.vocab_size, c.tie_word_embeddings) == ("llama", 49152, True)
    assert c.num_key_value_heads < c.num_attention_heads and c.head_dim == 8
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 2)


def test_chat_template_text_and_ids_equal_transformers():
    tok = models.load_tokenizer(FIXTURE)
    for case in expected()["chat"]:
        text = tok.apply_chat_template(case["messages"], add_generation_prompt=True)
        assert text == case["text"]
        assert tok.encode(text) == case["ids"]
    assert expected()["chat"][0]["text"] == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n")


def test_special_ids_come_from_tokenizer_and_generation_config():
    tok = models.load_tokenizer(FIXTURE)
    exp = expected()
    assert tok.eos_token_ids == tuple(exp["eos_token_ids"]) == (2, 0)  # <|im_end|>, <|endoftext|>
    assert tok.pad_token_id == exp["pad_token_id"] == 2
    assert tok.vocab_size == exp["vocab_size"] == 49152
    assert tok.decode(tok.encode("17 + 25 = 42<|im_end|>")) == "17 + 25 = 42"


def test_logits_equal_transformers_fp32():
    ref = expected()["logits"]
    logits = forward(tiny(), expected()["chat"][ref["case"]]["ids"])
    np.testing.assert_allclose(logits[:, ref["columns"]], np.asarray(ref["values"]), atol=1e-4, rtol=0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref["logsumexp"]), atol=1e-4, rtol=0)
    assert logits.argmax(-1).tolist() == ref["argmax"]


def test_save_and_reload_is_exact(tmp_path):
    model = tiny()
    models.save_pretrained(model, tmp_path / "fp32", tokenizer=FIXTURE)
    again = models.from_pretrained(tmp_path / "fp32")
    assert again.config == model.config
    a, b = params(model), params(again)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    ids = expected()["chat"][1]["ids"]
    np.testing.assert_array_equal(forward(model, ids), forward(again, ids))
    tok = models.load_tokenizer(tmp_path / "fp32")
    assert tok.eos_token_ids == (2, 0) and tok.chat_template == models.load_tokenizer(FIXTURE).chat_template
    # saved back in the checkpoint's own bf16, the tensors are bit-identical to transformers' file
    models.save_pretrained(model, tmp_path / "bf16", dtype=jnp.bfloat16)
    ours, theirs = (raw_tensors(os.path.join(p, "model.safetensors")) for p in (tmp_path / "bf16", FIXTURE))
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert ours[k] == theirs[k], k


@functools.cache
def tiny_engine(temperature, slots=4):
    return rollout.Engine.from_pretrained(FIXTURE, max_concurrent_decodes=slots, max_prefill_length=128,
                                          max_target_length=160, dtype="float32",
                                          temperature=temperature)


def test_engine_greedy_equals_transformers_generate_for_chat_prompts():
    engine = tiny_engine(0.0)
    assert engine.stop_token_ids == (2, 0) and engine.pad_token_id == 2
    cases = expected()["generate"]
    batch = rollout.RolloutDriver(engine, steps_per_sync=4).generate(
        [c["prompt"] for c in cases], n=1, max_new_tokens=24,
        sampling=rollout.SamplingParams(temperature=0.0), seed=0)
    assert {c["finish"] for c in cases} == {"stop", "length"}  # the fixture exercises both
    for i, c in enumerate(cases):
        got = batch.responses[i, :batch.response_lengths[i]].tolist()
        if agree_until_near_tie(got, c["output"], c["margins"]):
            assert batch.finish_reasons[i] == c["finish"], i


def test_sampling_stops_on_the_generation_config_eos_ids():
    """<|endoftext|> (0) is a stop id only through generation_config.json; sampled rows must end
    on the first stop id they draw, and only there."""
    engine = tiny_engine(1.0, slots=16)
    prompts = [c["ids"] for c in expected()["chat"]]
    batch = rollout.RolloutDriver(engine, steps_per_sync=4).generate(
        prompts, n=16, max_new_tokens=24, sampling=rollout.SamplingParams(temperature=1.0, top_k=8),
        seed=3)
    last = {0: 0, 2: 0}
    for row, (resp, n, reason) in enumerate(zip(batch.responses, batch.response_lengths,
                                                batch.finish_reasons)):
        toks = resp[:n].tolist()
        assert not {0, 2} & set(toks[:-1]), f"row {row} ran past a stop id: {toks}"
        if toks[-1] in (0, 2):
            assert reason == "stop"
            last[toks[-1]] += 1
        else:
            assert reason == "length" and n == 24
    assert last[0] > 0 and last[2] > 0, last


# ------------------------------------------------------------------------------ real weights

@functools.cache
def hf_real():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return (AutoModelForCausalLM.from_pretrained(REAL, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(REAL))


@functools.cache
def ours_real():
    return models.from_pretrained(REAL)


REAL_CHATS = [
    [{"role": "user", "content": "What is 17 + 25?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Compute 8 * 7 - 5. Put the final answer after 'Answer:'."}],
]


def _hf_ids(messages):
    _, tok = hf_real()
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


@real_only
def test_real_chat_template_ids_equal_transformers():
    tok = models.load_tokenizer(REAL)
    for messages in REAL_CHATS:
        assert tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True)) == _hf_ids(messages)
    assert tok.eos_token_ids == (2, 0)


@real_only
def test_real_logits_equal_transformers_fp32():
    import torch

    hf, _ = hf_real()
    for messages in REAL_CHATS[:2]:
        ids = _hf_ids(messages)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].numpy()
        got = forward(ours_real(), ids)
        # |logits| reach ~40 here; 30 fp32 layers with different reduction orders differ by ~1e-4
        assert np.abs(got - want).max() <= 1e-3, np.abs(got - want).max()
        assert (got.argmax(-1) == want.argmax(-1)).mean() == 1.0


@real_only
def test_real_save_and_reload_is_exact(tmp_path):
    model = ours_real()
    models.save_pretrained(model, tmp_path, tokenizer=REAL)
    again = models.from_pretrained(tmp_path)
    a, b = params(model), params(again)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "chat_template.jinja"} <= set(os.listdir(tmp_path))
    ids = _hf_ids(REAL_CHATS[0])
    np.testing.assert_array_equal(forward(model, ids), forward(again, ids))


@real_only
def test_real_engine_greedy_equals_transformers_generate():
    import torch

    hf, _ = hf_real()
    engine = rollout.Engine.from_pretrained(REAL, max_concurrent_decodes=4, max_prefill_length=64,
                                            max_target_length=128, dtype="float32", temperature=0.0)
    assert engine.stop_token_ids == (2, 0)
    prompts = [_hf_ids(m) for m in REAL_CHATS]
    batch = rollout.RolloutDriver(engine, steps_per_sync=8).generate(
        prompts, n=1, max_new_tokens=48, sampling=rollout.SamplingParams(temperature=0.0), seed=0)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            res = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48,
                              output_scores=True, return_dict_in_generate=True)
        want = res.sequences[0, len(ids):].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in res.scores]
        got = batch.responses[i, :batch.response_lengths[i]].tolist()
        if agree_until_near_tie(got, want, margins):
            assert batch.finish_reasons[i] == ("stop" if want[-1] in (2, 0) else "length")


@real_only
def test_real_sampling_ends_turns_on_im_end():
    engine = rollout.Engine.from_pretrained(REAL, max_concurrent_decodes=16, max_prefill_length=64,
                                            max_target_length=192, dtype="float32", temperature=1.0)
    prompts = [_hf_ids(m) for m in REAL_CHATS]
    batch = rollout.RolloutDriver(engine, steps_per_sync=8).generate(
        prompts, n=4, max_new_tokens=128, sampling=rollout.SamplingParams(temperature=1.0), seed=0)
    stops = 0
    for resp, n, reason in zip(batch.responses, batch.response_lengths, batch.finish_reasons):
        toks = resp[:n].tolist()
        assert not {0, 2} & set(toks[:-1])
        stops += reason == "stop"
        assert (reason == "stop") == (toks[-1] in (0, 2))
    assert stops >= len(batch.finish_reasons) // 2  # an instruct model ends most short answers
