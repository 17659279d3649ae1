"""Build the tiny Hugging Face checkpoints and reference outputs under tests/fixtures/models/.

The tests compare our Flax models against these files and never import torch or transformers;
this script is the only place that does. It runs offline: every model is built by transformers
from a config object (no hub access), its weights are overwritten with seeded random values of a
useful scale (so biases, norm scales and greedy generations are not degenerate), and it is saved
with transformers' own `save_pretrained` (fp32 safetensors, transformers-5 `config.json` layout).

    pip install torch==2.13.0 transformers
    HF_HUB_OFFLINE=1 python scripts/make_model_fixtures.py            # writes the fixtures
    python scripts/make_model_fixtures.py --dry-run                    # lists what it would write
    HF_HUB_OFFLINE=1 python scripts/make_model_fixtures.py --only qwen3_moe mixtral  # just these

Made with torch 2.13.0 (CPU) and transformers 5.24.0 (qwen3_moe and mixtral: torch 2.14.1;
qwen3_moe_mixed: torch 2.11.0 and transformers 5.17.0 on the GPU machine, where the
save_pretrained check below gave max |dlogit| = 0).

Output, one folder per checkpoint (`qwen2`: biases + GQA; `qwen2_tied`: tied embeddings;
`qwen3`: q/k norm and head_dim != hidden/heads; `llama3`: llama3 rope scaling; `qwen2_value`:
Qwen2ForTokenClassification with num_labels=1; `qwen3_moe`: Qwen3MoeForCausalLM, 4 experts, top-2,
norm_topk_prob=false, every layer sparse; `mixtral`: MixtralForCausalLM, 4 experts, top-2;
`qwen3_moe_mixed`: Qwen3MoeForCausalLM with 4 layers, the first, third and fourth dense):
- `config.json`, `model.safetensors`: exactly what transformers wrote.
- `reference.npz`: `input_ids` int32[2, 16] (seeded random ids, no padding) and the fp32 model
  output on them: `logits` float32[2, 16, vocab] (causal LMs) or `values` float32[2, 16]
  (value model).
- `generate.json` (causal LMs only), for the rollout engine's parity tests:
    {"max_new_tokens": 8, "do_sample": false, "eos_token_id": null,
     "note": "...", "cases": [{"prompt": [ids], "output": [8 new ids],
                                "margins": [8 floats]}, ...]}
  Each prompt is generated alone (batch of 1, no padding) by `model.generate(do_sample=False,
  max_new_tokens=8)` with eos stopping disabled, so every output has exactly 8 tokens.
  `margins[k]` is the top-1 minus top-2 logit at step k (a small margin means a near tie, where
  fp32 round-off may legitimately pick the other token).
Plus `tokenizer_chatml/`: a byte-level BPE `tokenizer.json` trained here with the `tokenizers`
library on a few sentences, a `tokenizer_config.json` holding a Qwen-style ChatML chat template,
a `generation_config.json` with both stop ids, and `expected.json`: for several conversations the
text transformers' `apply_chat_template(tokenize=False)` renders, the ids of
`tokenizer(text, add_special_tokens=False)`, and the tokenizer's eos/pad ids.

With jaxrl_llm importable, the script also checks that `jaxrl_llm.models.save_pretrained` output
reloads in transformers with the same logits (printed, not stored).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models")
SEQ, BATCH, NEW_TOKENS = 16, 2, 8
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CHECKPOINTS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=10000.0)),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=10000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1000000.0, head_dim=16)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0,
                                               original_max_position_embeddings=64))),
    "qwen2_value": ("Qwen2Config", "Qwen2ForTokenClassification", dict(rope_theta=10000.0, num_labels=1)),
    # mixture of experts: 4 experts, top-2, every layer sparse
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        rope_theta=1000000.0, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        rope_theta=1000000.0, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # Qwen3-MoE with dense layers: 4 layers, decoder_sparse_step=2 makes 0 and 2 dense,
    # mlp_only_layers=[3] makes 3 dense too: dense, sparse, dense, dense
    "qwen3_moe_mixed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        rope_theta=1000000.0, head_dim=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=4,
        moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3])),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "{{- messages[0]['content'] }}\n"
    "{%- else %}\n"
    "{{- 'You are a helpful assistant.' }}\n"
    "{%- endif %}\n"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}\n"
    "{%- for tool in tools %}\n"
    "{{- '\\n' }}\n"
    "{{- tool | tojson }}\n"
    "{%- endfor %}\n"
    "{{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- elif messages[0]['role'] != 'system' %}\n"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{% for message in messages %}\n"
    "    {% if message['role'] == 'system' and loop.first and tools %}\n"
    "        {% continue %}\n"
    "    {% endif %}\n"
    "    {% if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{ raise_exception('Unsupported role: ' + message['role']) }}\n"
    "    {% endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' -}}\n"
    "{% endif %}\n"
)
CONVERSATIONS = [
    dict(messages=[{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True),
    dict(messages=[{"role": "system", "content": "Answer briefly."},
                   {"role": "user", "content": "Hello there"},
                   {"role": "assistant", "content": "Hi! Ünïcode ok."},
                   {"role": "user", "content": "Count: 1 2 3"}], add_generation_prompt=True),
    dict(messages=[{"role": "user", "content": "no prompt"},
                   {"role": "assistant", "content": "done"}], add_generation_prompt=False),
    dict(messages=[{"role": "system", "content": "Use tools."},
                   {"role": "user", "content": "weather?"}], add_generation_prompt=True,
         tools=[{"type": "function", "function": {"name": "get_weather", "description": "<city> & more",
                                                  "parameters": {"type": "object"}}}]),
]
CORPUS = ["The quick brown fox jumps over the lazy dog. 0123456789",
          "You are a helpful assistant. What is 12 + 30? The answer is 42.",
          "Hello there, how are you today? Count: 1 2 3 4 5 6 7 8 9 10",
          "system user assistant tools weather function name description"] * 4


def _randomize(model, seed: int):
    """Seeded weights of a useful scale: Linear ~ N(0, 1/fan_in), embeddings N(0, 1),
    biases N(0, 0.1), norm scales 1 + N(0, 0.1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def build_checkpoint(name: str, out: str, seed: int):
    import numpy as np
    import torch
    import transformers

    config_cls, model_cls, extra = CHECKPOINTS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _randomize(model, seed)
    folder = os.path.join(out, name)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, safe_serialization=True)
    for extra_file in ("generation_config.json",):
        if os.path.exists(os.path.join(folder, extra_file)):
            os.remove(os.path.join(folder, extra_file))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, COMMON["vocab_size"], (BATCH, SEQ)).astype(np.int32)
    with torch.no_grad():
        out_t = model(torch.from_numpy(ids).long()).logits.float().numpy()
    if model_cls.endswith("TokenClassification"):
        np.savez(os.path.join(folder, "reference.npz"), input_ids=ids, values=out_t[..., 0])
        return model
    np.savez(os.path.join(folder, "reference.npz"), input_ids=ids, logits=out_t)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    cases = []
    for prompt in ([5, 17, 42, 8, 63], [71, 3, 29]):
        with torch.no_grad():
            res = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 eos_token_id=None, output_scores=True, return_dict_in_generate=True)
        new = res.sequences[0, len(prompt):].tolist()
        assert len(new) == NEW_TOKENS, new
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in res.scores]
        cases.append(dict(prompt=prompt, output=new, margins=[round(m, 6) for m in margins]))
    with open(os.path.join(folder, "generate.json"), "w") as f:
        json.dump(dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                       note="HF generate, greedy, one prompt per call (no padding), eos stopping off",
                       cases=cases), f, indent=1)
    return model


def build_tokenizer(out: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    folder = os.path.join(out, "tokenizer_chatml")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=None, eos_token="<|im_end|>",
                  pad_token="<|endoftext|>", unk_token=None, model_max_length=32768,
                  chat_template=CHATML_TEMPLATE)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    stop = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": stop, "pad_token_id": stop[1]}, f, indent=1)
    hf = AutoTokenizer.from_pretrained(folder)
    cases = []
    for conv in CONVERSATIONS:
        kwargs = {k: v for k, v in conv.items() if k != "messages"}
        text = hf.apply_chat_template(conv["messages"], tokenize=False, **kwargs)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        cases.append(dict(conv, text=text, ids=ids,
                          decoded=hf.decode(ids, skip_special_tokens=True)))
    expected = dict(cases=cases, eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id,
                    eos_token_ids=stop, vocab_size=len(hf))
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)


def check_our_save(name: str, out: str):
    """Our save_pretrained output must load in transformers to the same logits."""
    import numpy as np
    import torch
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from jaxrl_llm import models

    folder = os.path.join(out, name)
    ours = models.from_pretrained(folder)
    ref = np.load(os.path.join(folder, "reference.npz"))
    with tempfile.TemporaryDirectory() as tmp:
        models.save_pretrained(ours, tmp, max_shard_size="40KB")
        auto = (transformers.AutoModelForTokenClassification if name.endswith("value")
                else transformers.AutoModelForCausalLM)
        hf = auto.from_pretrained(tmp).eval()
        with torch.no_grad():
            got = hf(torch.from_numpy(ref["input_ids"]).long()).logits.float().numpy()
    want = ref["values"][..., None] if name.endswith("value") else ref["logits"]
    print(f"{name}: our save -> transformers reload, max |dlogit| = {np.abs(got - want).max():.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--dry-run", action="store_true", help="list the fixtures, build nothing")
    parser.add_argument("--skip-check", action="store_true", help="do not round-trip through jaxrl_llm")
    parser.add_argument("--only", nargs="+", choices=list(CHECKPOINTS) + ["tokenizer_chatml"],
                        help="build just these fixtures (the others are left as they are)")
    args = parser.parse_args()
    names = list(CHECKPOINTS) + ["tokenizer_chatml"]
    if args.dry_run:
        for name in names:
            print(os.path.join(args.out, name))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    only = set(args.only or names)
    for seed, name in enumerate(CHECKPOINTS):  # seeds by position: adding a fixture changes no other
        if name in only:
            build_checkpoint(name, args.out, seed)
    if "tokenizer_chatml" in only:
        build_tokenizer(args.out)
    if not args.skip_check:
        for name in CHECKPOINTS:
            if name in only:
                check_our_save(name, args.out)


if __name__ == "__main__":
    main()
