"""Tokenizers: transformers-equal chat templates and ids on a tiny ChatML tokenizer (expected values
recorded by scripts/make_model_fixtures.py), and the built-in CharTokenizer's fixed vocabulary."""
import json
import os
import shutil

import jinja2
import pytest

from jaxrl_llm import models

FOLDER = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models", "tokenizer_chatml")


def expected():
    with open(os.path.join(FOLDER, "expected.json")) as f:
        return json.load(f)


def render(tok, case):
    kwargs = {k: case[k] for k in ("tools",) if k in case}
    return tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                   **kwargs)


def test_chat_template_text_and_ids_equal_transformers():
    tok = models.load_tokenizer(FOLDER)
    assert isinstance(tok, models.HFTokenizer)
    exp = expected()
    assert exp["cases"][0]["text"] == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n")
    for case in exp["cases"]:
        text = render(tok, case)
        assert text == case["text"]
        assert tok.encode(text) == case["ids"]
        assert tok.decode(case["ids"]) == case["decoded"]


def test_special_ids_and_stop_tokens():
    tok = models.load_tokenizer(FOLDER)
    exp = expected()
    assert tok.eos_token_id == exp["eos_token_id"] == tok.encode("<|im_end|>")[0]
    assert tok.pad_token_id == exp["pad_token_id"]
    assert tok.eos_token_ids == tuple(exp["eos_token_ids"])  # <|im_end|>, then <|endoftext|>
    assert tok.vocab_size == exp["vocab_size"]
    assert len(tok.encode("<|im_start|>user")) == 1 + len(tok.encode("user"))
    assert tok.decode(tok.encode("<|im_start|>hi"), skip_special_tokens=False) == "<|im_start|>hi"


def test_chat_template_jinja_file_is_used_when_config_has_none(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").write_text(config.pop("chat_template"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = models.load_tokenizer(folder)
    case = expected()["cases"][1]
    assert render(tok, case) == case["text"]
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        models.load_tokenizer(folder).apply_chat_template(case["messages"])


def test_template_raise_exception_reaches_the_caller():
    tok = models.load_tokenizer(FOLDER)
    with pytest.raises(jinja2.TemplateError, match="Unsupported role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_environment_matches_transformers_options():
    t = models.compile_chat_template(
        "{% for m in messages %}\n  {% if m == 'b' %}{% continue %}{% endif %}\n{{ m }};"
        "{% endfor %}{{ {'a': '<&>'} | tojson }}{% generation %}!{% endgeneration %}")
    # trim_blocks + lstrip_blocks drop the tag lines, loopcontrols skip 'b', tojson does not escape
    assert t.render(messages=["a", "b", "c"]) == 'a;c;{"a": "<&>"}!'


def test_char_tokenizer_fixed_ids_and_chat_template():
    tok = models.CharTokenizer()
    assert [tok.encode(s)[0] for s in ("<pad>", "<eos>", "<user>", "<assistant>", "<system>")] == [0, 1, 2, 3, 4]
    assert tok.encode("09azAZ! \n") == [5, 14, 15, 40, 41, 66, 67, 99, 100]
    assert tok.vocab_size == 102 and tok.pad_token_id == 0 and tok.eos_token_ids == (1,)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "<x>"}]
    text = tok.apply_chat_template(messages)
    assert text == "<system>s<user>2+2?<assistant>4<eos><user><x><assistant>"
    ids = tok.encode(text)
    assert ids[:2] == [4, tok.encode("s")[0]] and ids[-1] == 3 and ids.count(1) == 1
    assert tok.decode(ids) == "s2+2?4<x>"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert not tok.apply_chat_template(messages[:2], add_generation_prompt=False).endswith("<assistant>")
    with pytest.raises(ValueError, match="'é'"):
        tok.encode("café")


def test_char_tokenizer_saves_and_reloads_with_an_exported_model(tmp_path):
    model = models.from_pretrained(os.path.join(FOLDER, "..", "qwen2_tied"))
    models.save_pretrained(model, tmp_path / "m", tokenizer=models.CharTokenizer())
    assert isinstance(models.load_tokenizer(tmp_path / "m"), models.CharTokenizer)
    assert isinstance(models.load_tokenizer("char"), models.CharTokenizer)
    models.save_pretrained(model, tmp_path / "h", tokenizer=FOLDER)
    hf = models.load_tokenizer(tmp_path / "h")
    assert isinstance(hf, models.HFTokenizer) and hf.eos_token_ids == tuple(expected()["eos_token_ids"])
    assert os.path.exists(tmp_path / "h" / "model.safetensors")
