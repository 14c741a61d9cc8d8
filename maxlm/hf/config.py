"""Hugging Face `config.json` <-> maxlm `ModelConfig` (Llama 2/3/3.1/3.2, Mistral and Mixtral).

Reads the config.json of transformers 4.x (`rope_theta`, `rope_scaling`) and 5.x (`rope_parameters`).
Anything maxlm's decoder cannot compute exactly (biases, other activations, other RoPE scalings,
other architectures) is refused with one line naming the field; nothing is silently approximated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from maxlm.config import ConfigError, ModelConfig, MoEConfig

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral"}
# Fields that would change the computation when set to anything but these values (a router's jitter noise
# multiplies its inputs by noise in training: maxlm's router has none).
_MUST_BE = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "use_qk_norm": False,
            "router_jitter_noise": 0.0}
_WINDOWED = ("mistral", "mixtral")  # the model types with a sliding_window field
# Keys of config.json written by save_pretrained; the rest of an imported config.json is kept as it was.
_OWNED = ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling",
          "rope_parameters", "sliding_window", "tie_word_embeddings", "torch_dtype", "dtype", "hidden_act",
          "attention_bias", "mlp_bias", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
          "router_jitter_noise")


# The ModelConfig fields a config.json determines (the architecture); the rest are run-time choices.
ARCH_FIELDS = ("name", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
               "norm_eps", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
               "rope_high_freq_factor", "rope_original_max_position", "sliding_window", "tie_embeddings", "moe")


class HFConfigError(ConfigError):
  """A Hugging Face config that maxlm cannot represent exactly (one line, exit code 2)."""


def read_config_json(hf_dir: Path) -> dict[str, Any]:
  path = Path(hf_dir) / "config.json"
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except FileNotFoundError:
    raise HFConfigError(f"{hf_dir}: no config.json (not a Hugging Face model directory)") from None
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise HFConfigError(f"{path}: unreadable config.json ({e})") from None
  if not isinstance(data, dict):
    raise HFConfigError(f"{path}: config.json is not a JSON object")
  return data


def _rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
  """maxlm's RoPE fields from `rope_parameters` (5.x) or `rope_theta` + `rope_scaling` (4.x)."""
  params = hf.get("rope_parameters")
  if isinstance(params, dict) and "rope_theta" in params:
    theta, scaling = params["rope_theta"], params
  else:
    theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling")
  out: dict[str, Any] = {"rope_theta": float(theta)}
  if not scaling:
    return out
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return out
  if kind != "llama3":
    raise HFConfigError(f"{where}: unsupported rope_scaling type {kind!r} (maxlm supports default and llama3)")
  try:
    out.update(rope_scaling="llama3", rope_factor=float(scaling["factor"]),
               rope_low_freq_factor=float(scaling["low_freq_factor"]),
               rope_high_freq_factor=float(scaling["high_freq_factor"]),
               rope_original_max_position=int(scaling["original_max_position_embeddings"]))
  except KeyError as e:
    raise HFConfigError(f"{where}: llama3 rope_scaling lacks {e.args[0]!r}") from None
  return out


def from_hf(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
  """The maxlm ModelConfig of an HF Llama/Mistral/Mixtral config dict; HFConfigError names what does not fit."""
  archs = hf.get("architectures") or []
  model_type = hf.get("model_type")
  known = [a for a in archs if a in ARCHITECTURES]
  if archs and not known:
    raise HFConfigError(f"{where}: unsupported architecture {archs[0]!r} (maxlm reads "
                        f"{', '.join(ARCHITECTURES)})")
  if model_type not in ARCHITECTURES.values():
    raise HFConfigError(f"{where}: unsupported model_type {model_type!r} (maxlm reads llama, mistral, mixtral)")
  for key, ok in _MUST_BE.items():
    if key in hf and hf[key] != ok:
      raise HFConfigError(f"{where}: unsupported {key}: {json.dumps(hf[key])} (maxlm needs {json.dumps(ok)})")
  try:
    d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    fields: dict[str, Any] = dict(
        name=str(hf.get("_name_or_path") or model_type), vocab_size=int(hf["vocab_size"]), d_model=d,
        n_layers=int(hf["num_hidden_layers"]), n_heads=h,
        n_kv_heads=int(hf.get("num_key_value_heads") or h),
        head_dim=int(hf.get("head_dim") or d // h), ffn_dim=int(hf["intermediate_size"]),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        sliding_window=int(hf.get("sliding_window") or 0) if model_type in _WINDOWED else 0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    if model_type == "mixtral":  # every block a mixture (MixtralConfig's defaults: 8 experts, top 2, 0.001)
      fields["moe"] = MoEConfig(experts=int(hf.get("num_local_experts", 8)), top_k=int(hf.get("num_experts_per_tok", 2)),
                                aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
  except KeyError as e:
    raise HFConfigError(f"{where}: missing field {e.args[0]!r}") from None
  except (TypeError, ValueError) as e:
    raise HFConfigError(f"{where}: malformed field ({e})") from None
  fields.update(_rope(hf, where))
  cfg = ModelConfig(**fields)
  if cfg.moe.experts and not 1 <= cfg.moe.top_k <= cfg.moe.experts:
    raise HFConfigError(f"{where}: num_experts_per_tok ({cfg.moe.top_k}) must be in 1..num_local_experts "
                        f"({cfg.moe.experts})")
  if cfg.n_heads % cfg.n_kv_heads:
    raise HFConfigError(f"{where}: num_attention_heads ({cfg.n_heads}) is not a multiple of "
                        f"num_key_value_heads ({cfg.n_kv_heads})")
  return cfg


def to_hf(cfg: ModelConfig, dtype: str, base: dict[str, Any] | None = None, max_position: int = 0,
          bos_id: int = -1, eos_id: int = -1) -> dict[str, Any]:
  """config.json for `cfg`: `base` (an imported config.json) with the fields maxlm owns rewritten.

  Experts make it a MixtralForCausalLM (every block a mixture: model.moe.every=1); a sliding window a
  MistralForCausalLM (Llama has none); otherwise the base's architecture, or LlamaForCausalLM. The RoPE fields
  keep the base's style (5.x `rope_parameters` or 4.x).
  """
  base = dict(base or {})
  model_type = "mistral" if cfg.sliding_window or base.get("model_type") == "mistral" else "llama"
  if cfg.moe.experts:
    if cfg.moe.every != 1:
      raise HFConfigError(f"model.moe.every={cfg.moe.every}: Hugging Face's Mixtral has experts in every block "
                          "(model.moe.every=1)")
    model_type = "mixtral"
  arch = next(a for a, t in ARCHITECTURES.items() if t == model_type)
  rope: dict[str, Any] = {"rope_type": "default"}
  if cfg.rope_scaling == "llama3":
    rope = {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position}
  out = {k: v for k, v in base.items() if k not in _OWNED}
  out.update(architectures=[arch], model_type=model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
             num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
             head_dim=cfg.head_dim, intermediate_size=cfg.ffn_dim, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
             tie_word_embeddings=cfg.tie_embeddings)
  if model_type == "llama":  # MistralConfig and MixtralConfig have neither field
    out.update(attention_bias=False, mlp_bias=False)
  if model_type == "mixtral":
    out.update(num_local_experts=cfg.moe.experts, num_experts_per_tok=cfg.moe.top_k,
               router_aux_loss_coef=cfg.moe.aux_loss_coef, router_jitter_noise=0.0)
  out["dtype" if "dtype" in base else "torch_dtype"] = dtype  # transformers 5.x names it dtype
  if "rope_parameters" in base:
    out["rope_parameters"] = {**rope, "rope_theta": cfg.rope_theta}
  else:
    out["rope_theta"] = cfg.rope_theta
    if model_type != "mixtral" or cfg.rope_scaling == "llama3" or "rope_scaling" in base:  # (MixtralConfig 4.x
      out["rope_scaling"] = rope if cfg.rope_scaling == "llama3" else None  # has no such field)
  if model_type in _WINDOWED:
    out["sliding_window"] = cfg.sliding_window or None
  if "max_position_embeddings" not in out:
    long = int(cfg.rope_original_max_position * cfg.rope_factor) if cfg.rope_scaling == "llama3" else 0
    out["max_position_embeddings"] = max(long, max_position, 2048)
  if "initializer_range" not in out:
    out["initializer_range"] = cfg.init_std
  for key, tok in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
    if key not in out and tok >= 0:
      out[key] = tok
  return out
