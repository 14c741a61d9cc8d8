"""The one table mapping Hugging Face Llama/Mistral/Mixtral tensors <-> maxlm parameters, with each reshape.

HF stores `nn.Linear` weights as [out, in]; maxlm kernels are [in, ...out]. HF's q/k projections are
already in the layout its rotate-half RoPE expects (the conversion from Meta's interleaved checkpoints
permuted them), and maxlm's RoPE (`maxlm.layers.rope.apply_rope`) rotates the same halves, so q and k
need no permutation here: only the transpose and the grouped fused-QKV layout (per KV head j: its G
query heads h = j*G + i, then K, then V; HF's `repeat_kv` gives query head h the KV head h // G).
Mixtral's blocks hold `block_sparse_moe.gate` (the router, [E, D]) and `block_sparse_moe.experts.{e}.w1/w3/w2`
(gate, up [F, D]; down [D, F]) where Llama has `mlp.*`: maxlm's `moe/router` [D, E] and `moe/w1`, `moe/w3`
[E, D, F], `moe/w2` [E, F, D], the experts stacked in order, and `moe_norm/scale` for `post_attention_layernorm`.
Each entry's two functions are exact inverses (transposes, reshapes, stacks and concatenations only).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from maxlm.config import ModelConfig

Arrays = list[np.ndarray]


@dataclasses.dataclass(frozen=True)
class Entry:
  """One maxlm parameter and the HF tensors it is made of ('{i}' = layer index in per-layer names)."""
  path: tuple[str, ...]  # inside a layer for per-layer entries, else from the tree root
  shape: tuple[int, ...]  # maxlm shape (one layer's; stacked parameters add a leading n_layers axis)
  hf: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]  # of the HF tensors (one layer's)
  per_layer: bool
  to_maxlm: Callable[[Arrays], np.ndarray]
  to_hf: Callable[[np.ndarray], Arrays]
  float32: bool = False  # held in float32 at least, whatever model.param_dtype (the router, maxlm/layers/moe.py)

  def hf_names(self, layer: int | None = None) -> list[str]:
    return [n.format(i=layer) for n in self.hf]


def _same(xs: Arrays) -> np.ndarray:
  return xs[0]


def _t(xs: Arrays) -> np.ndarray:
  return xs[0].T


def _stack_t(xs: Arrays) -> np.ndarray:
  return np.stack([x.T for x in xs])


def _unstack_t(w: np.ndarray) -> Arrays:
  return [x.T for x in w]


def _moe_entries(m: ModelConfig, layer: str) -> list[Entry]:
  """A Mixtral block's norm, router and experts (module doc)."""
  d, f, e = m.d_model, m.ffn_dim, m.moe.experts
  experts = layer + "block_sparse_moe.experts.{e}."

  def each(w: str) -> tuple[str, ...]:
    return tuple(experts.replace("{e}", str(j)) + f"{w}.weight" for j in range(e))
  return [
    Entry(("moe_norm", "scale"), (d,), (layer + "post_attention_layernorm.weight",), ((d,),), True,
          _same, lambda w: [w]),
    Entry(("moe", "router"), (d, e), (layer + "block_sparse_moe.gate.weight",), ((e, d),), True,
          _t, lambda w: [w.T], float32=True),
    Entry(("moe", "w1"), (e, d, f), each("w1"), ((f, d),) * e, True, _stack_t, _unstack_t),
    Entry(("moe", "w3"), (e, d, f), each("w3"), ((f, d),) * e, True, _stack_t, _unstack_t),
    Entry(("moe", "w2"), (e, f, d), each("w2"), ((d, f),) * e, True, _stack_t, _unstack_t),
  ]


def table(m: ModelConfig) -> list[Entry]:
  """Every maxlm parameter of `m` with its HF tensors, in HF's order (embedding, layers, norm, head)."""
  d, kv, g, dh, h = m.d_model, m.n_kv_heads, m.n_heads // m.n_kv_heads, m.head_dim, m.n_heads
  f, v = m.ffn_dim, m.vocab_size

  def qkv_to_maxlm(xs: Arrays) -> np.ndarray:  # q [H*Dh, D], k/v [KV*Dh, D] -> [D, KV, G+2, Dh]
    q = xs[0].T.reshape(d, kv, g, dh)  # query head h = j*G + i sits at [:, j, i]
    k_, v_ = (x.T.reshape(d, kv, 1, dh) for x in xs[1:])  # [D, KV, 1, Dh]
    return np.concatenate([q, k_, v_], axis=2)  # [D, KV, G+2, Dh]

  def qkv_to_hf(w: np.ndarray) -> Arrays:  # [D, KV, G+2, Dh] -> q [H*Dh, D], k [KV*Dh, D], v [KV*Dh, D]
    return [w[:, :, :g].reshape(d, h * dh).T, w[:, :, g].reshape(d, kv * dh).T,
            w[:, :, g + 1].reshape(d, kv * dh).T]

  def mlp_to_maxlm(xs: Arrays) -> np.ndarray:  # gate, up [F, D] -> [D, 2, F] (0 = gate, 1 = up)
    return np.stack([xs[0].T, xs[1].T], axis=1)

  layer = "model.layers.{i}."
  if m.moe.experts and m.moe.every != 1:
    raise ValueError(f"model.moe.every={m.moe.every}: the weight table maps Mixtral (experts in every block)")
  mlp = _moe_entries(m, layer) if m.moe.experts else [
    Entry(("mlp", "scale"), (d,), (layer + "post_attention_layernorm.weight",), ((d,),), True,
          _same, lambda w: [w]),
    Entry(("mlp", "wi_kernel"), (d, 2, f), (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"),
          ((f, d), (f, d)), True, mlp_to_maxlm, lambda w: [w[:, 0].T, w[:, 1].T]),
    Entry(("mlp", "wo_kernel"), (f, d), (layer + "mlp.down_proj.weight",), ((d, f),), True,
          _t, lambda w: [w.T]),
  ]
  entries = [
    Entry(("embed", "embedding"), (v, d), ("model.embed_tokens.weight",), ((v, d),), False,
          _same, lambda w: [w]),
    Entry(("qkv", "scale"), (d,), (layer + "input_layernorm.weight",), ((d,),), True, _same, lambda w: [w]),
    Entry(("qkv", "kernel"), (d, kv, g + 2, dh), tuple(layer + f"self_attn.{p}_proj.weight" for p in "qkv"),
          ((h * dh, d), (kv * dh, d), (kv * dh, d)), True, qkv_to_maxlm, qkv_to_hf),
    Entry(("out", "kernel"), (h, dh, d), (layer + "self_attn.o_proj.weight",), ((d, h * dh),), True,
          lambda xs: xs[0].T.reshape(h, dh, d), lambda w: [w.reshape(h * dh, d).T]),
    *mlp,
  ]
  if m.tie_embeddings:
    entries.append(Entry(("final_norm", "scale"), (d,), ("model.norm.weight",), ((d,),), False,
                         _same, lambda w: [w]))
  else:
    entries += [Entry(("lm_head", "scale"), (d,), ("model.norm.weight",), ((d,),), False, _same, lambda w: [w]),
                Entry(("lm_head", "kernel"), (d, v), ("lm_head.weight",), ((v, d),), False, _t, lambda w: [w.T])]
  return entries


def param_path(e: Entry, layer: int | None, scan: bool) -> tuple[str, ...]:
  """Where the entry lives in the params tree: `layers/...` (stacked, scan_layers) or `layers_<i>/...`."""
  if not e.per_layer:
    return e.path
  return ("layers",) + e.path if scan else (f"layers_{layer}",) + e.path


def hf_tensor_list(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
  """(name, shape) of every HF tensor in the order the converters produce them."""
  out = []
  for layer, e in iter_entries(m):
    out += list(zip(e.hf_names(layer), e.shapes))
  return out


def iter_entries(m: ModelConfig):
  """(layer or None, entry) in HF order: the embedding, every layer's entries, the final norm / head."""
  entries = table(m)
  for e in entries:
    if not e.per_layer and e.path[0] == "embed":
      yield None, e
  for i in range(m.n_layers):
    for e in entries:
      if e.per_layer:
        yield i, e
  for e in entries:
    if not e.per_layer and e.path[0] != "embed":
      yield None, e
