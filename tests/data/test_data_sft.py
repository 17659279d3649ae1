"""SFTDataset: loss mask covers exactly the assistant turns (multi-turn), EOS added; collation."""
import numpy as np
import pytest

from jaxrl_llm.data import DataError, SFTDataset, collate_sft, write_rows


def _masked_text(tokenizer, ex):
    return tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])


def test_single_turn_mask_is_answer_plus_eos(tokenizer):
    rows = [{"messages": [{"role": "user", "content": "2+3="},
                          {"role": "assistant", "content": "5"}]}]
    ex = SFTDataset(rows, tokenizer, max_length=64)[0]
    assert tokenizer.decode(ex.input_ids) == "<user>2+3=\n<assistant>5\n"
    assert ex.input_ids[-1] == tokenizer.eos_token_id and ex.loss_mask[-1] == 1
    assert _masked_text(tokenizer, ex) == "5\n"
    assert sum(ex.loss_mask) == 3  # "5", "\n", EOS
    assert len(ex.input_ids) == len(ex.loss_mask)


def test_multi_turn_masks_every_assistant_turn_and_nothing_else(tokenizer, tmp_path):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "A2"}]
    write_rows(tmp_path / "sft.parquet", [{"messages": messages}])
    ex = SFTDataset(tmp_path / "sft.parquet", tokenizer, max_length=128)[0]
    eos = tokenizer.eos_token_id
    spans, current = [], []
    for t, m in zip(ex.input_ids, ex.loss_mask):
        if m:
            current.append(t)
        elif current:
            spans.append(current)
            current = []
    spans.append(current)
    assert [tokenizer.decode(s) for s in spans] == ["A1\n", "A2\n"]
    assert all(s[-1] == eos for s in spans)
    unmasked = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if not m])
    assert unmasked == "<system>S\n<user>Q1\n<assistant><user>Q2\n<assistant>"


def test_sft_errors_name_the_row(tokenizer):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    with pytest.raises(DataError, match="row 1: field 'messages' has no assistant"):
        SFTDataset([good, {"messages": [{"role": "user", "content": "q"}]}], tokenizer,
                   max_length=64)
    with pytest.raises(DataError, match="row 0: conversation has 22 tokens"):
        SFTDataset([good], tokenizer, max_length=10)
    cut = SFTDataset([good], tokenizer, max_length=10, truncation="right")[0]
    assert len(cut.input_ids) == 10 and cut.loss_mask == [0] * 10


def test_collate_sft_right_pads(tokenizer):
    rows = [{"messages": [{"role": "user", "content": c}, {"role": "assistant", "content": a}]}
            for c, a in [("1+1=", "2"), ("10+10=", "20")]]
    ds = SFTDataset(rows, tokenizer, max_length=40)
    batch = collate_sft([ds[0], ds[1]], tokenizer.pad_token_id, 40)
    n = len(ds[0].input_ids)
    assert set(batch) == {"input_ids", "attention_mask", "position_ids", "loss_mask"}
    assert all(v.shape == (2, 40) and v.dtype == np.int32 for v in batch.values())
    assert batch["input_ids"][0, :n].tolist() == ds[0].input_ids
    assert (batch["input_ids"][0, n:] == tokenizer.pad_token_id).all()
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (40 - n)
    assert batch["position_ids"][0, :n].tolist() == list(range(n))
    assert batch["loss_mask"][0].tolist() == ds[0].loss_mask + [0] * (40 - n)


def test_the_documented_tool_trace_row_trains_on_the_call_and_the_answer_only():
    """docs/quickstart.md's SFT row for tool use, as written there: the loss covers the hermes
    call and the final answer; the user's question and the tool's reply are context."""
    import json
    import os
    import re

    from jaxrl_llm.agent import get_tool_parser
    from jaxrl_llm.data import SFTDataset
    from jaxrl_llm.models import CharTokenizer

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "quickstart.md")).read()
    section = doc[doc.index("### SFT data for tool use"):]
    row = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    tok = CharTokenizer()
    ex = SFTDataset([row], tok, max_length=200)[0]
    trained = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    context = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if not m])
    call = row["messages"][1]["content"]
    assert trained.startswith(call) and trained.endswith("1776") and "37*48=" not in trained
    assert "37*48=" in context and "1776" in context  # the question and the tool's reply
    (parsed,) = get_tool_parser("hermes").parse(call)[1]
    assert (parsed.name, parsed.arguments, parsed.error) == ("calculator", {"expression": "37*48"}, None)
