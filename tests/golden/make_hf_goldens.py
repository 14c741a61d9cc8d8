"""Make the Hugging Face parity goldens in tests/golden/hf/ (needs torch + transformers).

    bash scripts/setup_hf.sh && .venv/bin/python tests/golden/make_hf_goldens.py && git diff --stat tests/golden/hf

scripts/setup_hf.sh installs the versions versions.json records; with them the script rewrites every file
byte for byte (checked 2026-12-05: no diff), so a diff means the libraries or this script changed.

Three tiny random-init models, each in its own directory: `config.json`, the weights as transformers'
`save_pretrained` writes them (bfloat16 safetensors; the Mistral one sharded, with its index), and
`golden.npz`: `tokens` [2, 24] (a fixed batch), `logits` [2, 24, V] (transformers' fp32 forward with
eager attention, from the bf16 weights held in fp32) and, for greedy generation, `prompts` (three
prompt lengths, right-padded with -1), `max_new_tokens` and `generated` [3, N] (transformers'
`generate(do_sample=False)` of each prompt alone). `versions.json` records the library versions.

* llama3: Llama 3 with llama3 RoPE scaling (GQA 4/2 heads; the head's four frequencies fall in the
  kept, the interpolated and the scaled bands), untied.
* llama_tied: a Llama 2 style model (MHA, theta 1e4) with tied embeddings (Llama 3.2 style head).
* mistral: Mistral with sliding_window 8 < 24 tokens (GQA 4/1), sharded safetensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

OUT = Path(__file__).resolve().parent / "hf"
T = 24
PROMPT_LENS = (3, 7, 12)
NEW = 10

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=512, initializer_range=0.1,
              bos_token_id=1, eos_token_id=None, pad_token_id=0)

MODELS = {
  "llama3": (transformers.LlamaConfig, dict(
      num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256})),
  "llama_tied": (transformers.LlamaConfig, dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                rope_theta=10000.0)),
  "mistral": (transformers.MistralConfig, dict(num_key_value_heads=1, tie_word_embeddings=False,
                                               rope_theta=1000000.0, sliding_window=8)),
}


def make(name: str, seed: int) -> None:
  cls, kw = MODELS[name]
  torch.manual_seed(seed)
  cfg = cls(**COMMON, **kw)
  cfg._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith("norm.weight"):  # ones by default: make them matter (a swapped norm must show)
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      p.copy_(p.to(torch.bfloat16).float())  # the stored bf16 values, held exactly in fp32
  gen = np.random.default_rng(seed)
  tokens = gen.integers(3, COMMON["vocab_size"], size=(2, T))
  with torch.no_grad():
    logits = model(torch.tensor(tokens)).logits.float().numpy()  # [2, T, V]
  prompts = np.full((len(PROMPT_LENS), max(PROMPT_LENS)), -1, np.int64)
  generated = []
  for i, n in enumerate(PROMPT_LENS):
    prompts[i, :n] = gen.integers(3, COMMON["vocab_size"], size=n)
    with torch.no_grad():
      out = model.generate(torch.tensor(prompts[i:i + 1, :n]), max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    generated.append(out[0, n:].numpy())
  d = OUT / name
  shutil.rmtree(d, ignore_errors=True)
  model.to(torch.bfloat16).save_pretrained(d, max_shard_size="40KB" if name == "mistral" else "5GB")
  for extra in ("generation_config.json",):
    (d / extra).unlink(missing_ok=True)  # not part of the golden: maxlm reads config.json only
  np.savez_compressed(d / "golden.npz", tokens=tokens.astype(np.int32), logits=logits,
                      prompts=prompts.astype(np.int32), max_new_tokens=np.int32(NEW),
                      generated=np.stack(generated).astype(np.int32))
  print(f"{name}: {sorted(p.name for p in d.iterdir())}, |logits| max {np.abs(logits).max():.3f}")


def main() -> None:
  OUT.mkdir(parents=True, exist_ok=True)
  for seed, name in enumerate(MODELS):
    make(name, seed)
  (OUT / "versions.json").write_text(json.dumps({"transformers": transformers.__version__,
                                                 "torch": torch.__version__}, indent=2) + "\n")


if __name__ == "__main__":
  main()
