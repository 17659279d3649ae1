"""GSM8K-style records ({"question", "answer" ending in "#### N"}) -> verl-schema rows.

Same layout as verl's gsm8k preprocessing: data_source "openai/gsm8k", the question plus an
instruction to answer after "####", ground truth the number after "####" with commas removed.
`scripts/convert_gsm8k.py` is the command-line wrapper.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from jaxrl_llm.data._schema import DataError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(records: Iterable[Mapping], *, split: str, source: str = "<records>") -> list[dict]:
    rows = []
    for index, record in enumerate(records):
        for key in ("question", "answer"):
            if not isinstance(record.get(key), str):
                raise DataError(f"{source} row {index}: field {key!r} must be a str")
        if "####" not in record["answer"]:
            raise DataError(f"{source} row {index}: field 'answer' has no '#### N' final answer")
        truth = record["answer"].split("####")[-1].strip().replace(",", "")
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{record['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "answer": record["answer"],
                           "question": record["question"]},
        })
    return rows
