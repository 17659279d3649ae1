"""Build tests/fixtures/models/smollm2_tiny/: a tiny random Llama of SmolLM2's configuration family
with SmolLM2-135M-Instruct's real tokenizer files, plus transformers' reference outputs.

    python scripts/fetch_smollm2.py /tmp/smollm2                 # the real folder (tokenizer source)
    HF_HUB_OFFLINE=1 python scripts/make_smollm2_fixture.py /tmp/smollm2

Made with torch 2.14.1 (CPU) and transformers 5.24.0. The CI tests (tests/models/test_models_smollm2.py)
never import torch or transformers; they compare against what this script recorded.

The model: LlamaForCausalLM with the real vocabulary (49,152), tied embeddings, GQA, an explicit
head_dim, rope_theta 1e5 and rms_norm_eps 1e-5 like SmolLM2, but 2 layers of width 16, so it is
~0.8M parameters (1.6 MB in bfloat16, the dtype it is saved in, as many Hub checkpoints are).
Weights are seeded N(0, 1/fan_in) (embeddings N(0, 1), norms 1 + N(0, 0.1), the residual outputs
o_proj/down_proj 6x larger so that a token does not just predict itself through the tied
embedding); the embedding rows of
the stop tokens `<|im_end|>` (2) and `<|endoftext|>` (0) are scaled up so that greedy and sampled
generations really end on them now and then.

Files: config.json, model.safetensors (transformers' save_pretrained), tokenizer.json,
tokenizer_config.json, chat_template.jinja (copied from the real folder), generation_config.json
(eos ids [2, 0], like the real folder), and expected.json:
  {"chat": [{"messages", "text", "ids"}...]     transformers' apply_chat_template(
                                                   add_generation_prompt=True), text and ids
   "eos_token_ids": [2, 0], "pad_token_id": 2, "vocab_size": 49152,
   "logits": {"case": 0, "columns": [...], "values": [[...]], "logsumexp": [...], "argmax": [...]}
        fp32 logits of chat case 0 at every position: a fixed subset of columns (256 seeded ids
        plus every position's argmax) and the full-vocabulary logsumexp
   "generate": [{"prompt", "output", "finish", "margins"}...]
        transformers greedy generate (max_new_tokens=24, eos ids from generation_config), one
        prompt per call; finish "stop" when it ended on an eos id.
  }
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models", "smollm2_tiny")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
EOS = [2, 0]
NEW_TOKENS = 24
CONFIG = dict(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=8192,
              rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=2, pad_token_id=2, hidden_act="silu")
CHATS = [
    [{"role": "user", "content": "What is 17 + 25?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Solve: 3 * (4 + 5) = ?  Ünïcode and emoji 🙂 too."},
     {"role": "assistant", "content": "27"}, {"role": "user", "content": "And 12345 - 6789?"}],
    [{"role": "user", "content": "Hi"}],
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("real", help="the folder scripts/fetch_smollm2.py wrote (tokenizer source)")
    p.add_argument("--out", default=OUT)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch
    import transformers
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(args.real, name), os.path.join(args.out, name))
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, w in model.named_parameters():
            noise = torch.randn(w.shape, generator=g)
            if name.endswith("norm.weight"):
                w.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                noise[2] *= 2.0  # <|im_end|>
                noise[0] *= 2.0  # <|endoftext|>
                w.copy_(noise)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                w.copy_(6.0 * noise / w.shape[-1] ** 0.5)  # layers outweigh the tied embedding
            else:
                w.copy_(noise / w.shape[-1] ** 0.5)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=list(EOS), pad_token_id=2)
    model.save_pretrained(args.out)
    model = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()  # what we test
    tok = AutoTokenizer.from_pretrained(args.out)
    chats = []
    for messages in CHATS:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        chats.append(dict(messages=messages, text=text, ids=list(map(int, ids))))
    ids0 = torch.tensor([chats[0]["ids"]])
    with torch.no_grad():
        logits = model(ids0).logits[0].float().numpy()
    rng = np.random.default_rng(0)
    argmax = logits.argmax(-1)
    columns = sorted(set(rng.choice(CONFIG["vocab_size"], 256, replace=False).tolist())
                     | set(argmax.tolist()) | set(EOS))
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    gens = []
    for c in chats:
        with torch.no_grad():
            res = model.generate(torch.tensor([c["ids"]]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 output_scores=True, return_dict_in_generate=True)
        new = res.sequences[0, len(c["ids"]):].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in res.scores]
        gens.append(dict(prompt=c["ids"], output=new, finish="stop" if new[-1] in EOS else "length",
                         margins=[round(m, 5) for m in margins]))
    expected = dict(chat=chats, eos_token_ids=EOS, pad_token_id=tok.pad_token_id, vocab_size=len(tok),
                    logits=dict(case=0, columns=columns,
                                values=np.round(logits[:, columns], 6).tolist(),
                                logsumexp=np.round(lse, 6).tolist(), argmax=argmax.tolist()),
                    generate=gens)
    with open(os.path.join(args.out, "expected.json"), "w") as f:
        json.dump(expected, f, ensure_ascii=False)
    for gcase in gens:
        print(gcase["finish"], len(gcase["output"]), min(gcase["margins"]))
    print("wrote", args.out, sorted(os.listdir(args.out)))


if __name__ == "__main__":
    main()
