"""Text generation with a KV cache: prefill the prompts, then decode one token at a time.

`generate(model_cfg, params, prompts, max_new_tokens, temperature=, top_k=, top_p=, seed=,
stop_tokens=, ...)` is the one entry point (`maxlm generate` and `maxlm.Model.generate` call it).

* Prompts of different lengths share a batch, right-padded; each row has its own positions, so a row
  decodes exactly as it would alone.
* Shapes are bucketed (batch, prompt length, max_new_tokens and the stop list rounded up to powers of
  two), and each bucket is traced and compiled once: one program for the prefill and one for the whole
  decode loop (a `lax.while_loop`), reused for every later call in the bucket, never one per token.
* The cache holds min(sliding_window, prompt + new tokens) slots: a rolling buffer for Mistral.
* Sampling: temperature 0 is greedy; else temperature, then top-k, then top-p (Hugging Face's order),
  from `seed`: row r's token at step i draws from fold_in(fold_in(PRNGKey(seed), r), i), so results do
  not depend on the other rows or the bucket.
* A row stops after it emits a stop token (kept in its output) or completes a stop sequence.
* Decode attention is pure JAX (`maxlm/layers/kv_cache.py`) on both layer backends; the other layers run
  on the model's backend, in the compute dtype, without FP8 (a TE model trained in FP8 decodes in bf16).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.config import ModelConfig
from maxlm.errors import BadInput
from maxlm.layers import resolve_backend
from maxlm.model import Transformer
from maxlm.scope import model_scope

_MIN_BUCKET = 16
_MIN_STOP = (8, 4)  # stop table [sequences, length]: the usual few stop ids share one compiled program
_TRACES = {"prefill": 0, "decode": 0}  # incremented while tracing: tests count compilations with it
_COMPILED: dict[tuple, Any] = {}


class GenerationError(BadInput, ValueError):
  """Bad generation arguments (empty prompt, too long for the model, out-of-range sampling setting)."""


@dataclasses.dataclass
class Generation:
  """What `generate` returns, one entry per prompt."""
  tokens: list[list[int]]  # the generated ids (a stop token that ended the row is included)
  finish_reasons: list[str]  # "stop" (stop token / sequence) or "length" (max_new_tokens reached)
  timing: dict[str, float]  # compile_s (0 when the bucket was compiled before), prefill_s, decode_s
  logits: np.ndarray | None = None  # [B, max_new_tokens, V] fp32, the logits each token was drawn from


def trace_counts() -> dict[str, int]:
  """How often the prefill and decode programs were traced in this process (one per shape bucket)."""
  return dict(_TRACES)


def bucket(n: int, minimum: int = _MIN_BUCKET) -> int:
  """`n` rounded up to a power of two, at least `minimum`."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


# --- sampling ------------------------------------------------------------------------------------


def top_k_filter(logits: jax.Array, k) -> jax.Array:
  """Logits [B, V] with everything below the k-th largest of each row set to -inf (k <= 0: all kept).

  Ties with the k-th largest are kept (as Hugging Face's TopKLogitsWarper)."""
  v = logits.shape[-1]
  k = jnp.asarray(k, jnp.int32)
  desc = -jnp.sort(-logits, axis=-1)  # [B, V]
  kth = jnp.take(desc, jnp.clip(k - 1, 0, v - 1), axis=-1)[:, None]  # [B, 1]
  return jnp.where((k <= 0) | (logits >= kth), logits, -jnp.inf)


def top_p_filter(logits: jax.Array, p) -> jax.Array:
  """Nucleus filter of logits [B, V]: keep the most likely tokens whose probabilities sum to >= p.

  As Hugging Face's TopPLogitsWarper: in ascending order, drop each token whose cumulative probability
  (itself included) is <= 1 - p; the most likely token always stays. p >= 1 keeps everything."""
  order = jnp.argsort(logits, axis=-1)  # [B, V] ascending
  asc = jnp.take_along_axis(logits, order, axis=-1)  # [B, V]
  cum = jnp.cumsum(jax.nn.softmax(asc, axis=-1), axis=-1)  # [B, V]
  drop = (cum <= 1.0 - p).at[:, -1].set(False)  # [B, V] in ascending order
  drop = jnp.take_along_axis(drop, jnp.argsort(order, axis=-1), axis=-1)  # [B, V] back in vocab order
  return jnp.where(drop & (p < 1.0), -jnp.inf, logits)


def sample(logits: jax.Array, keys: jax.Array, temperature, top_k, top_p) -> jax.Array:
  """Next tokens [B] from logits [B, V] (fp32): greedy when temperature == 0, else one draw per row
  from keys [B] (typed keys) after temperature, top-k and top-p."""
  def draw(lg):
    lg = lg / temperature
    lg = jax.lax.cond((top_k > 0) | (top_p < 1.0),
                      lambda x: top_p_filter(top_k_filter(x, top_k), top_p), lambda x: x, lg)
    return jax.vmap(jax.random.categorical)(keys, lg).astype(jnp.int32)  # [B]
  def greedy(lg):
    return jnp.argmax(lg, axis=-1).astype(jnp.int32)  # [B]
  return jax.lax.cond(temperature > 0, draw, greedy, logits)


# --- the two programs ----------------------------------------------------------------------------


def _empty_cache(cfg: ModelConfig, batch: int, slots: int) -> dict[str, jax.Array]:
  shape = (cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.head_dim)  # [L, B, S, KV, Dh]
  return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype),
          "pos": jnp.full((batch, slots), -1, jnp.int32)}  # pos: [B, S], -1 = empty


def _prefill_fn(model: Transformer, slots: int):
  def prefill(params, tokens, lengths):
    _TRACES["prefill"] += 1
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    valid = (positions < lengths[:, None]).astype(jnp.int32)  # [B, T]
    logits, out = model.apply({"params": params}, tokens, positions, valid,
                              _empty_cache(model.cfg, b, slots), mutable=["kv_cache"])  # [B, 1, V]
    return logits[:, 0].astype(jnp.float32), out["kv_cache"]  # [B, V]
  return prefill


def _decode_fn(model: Transformer, max_new: int, keep_logits: bool):
  def decode(params, cache, logits, lengths, done, n_new, stop_seqs, temperature, top_k, top_p, key):
    """logits [B, V] of each row's next token; lengths [B] prompt lengths; done [B] rows to skip;
    n_new: tokens to make (<= max_new); stop_seqs [S, L] right-aligned, -1 = any token."""
    _TRACES["decode"] += 1
    b, v = logits.shape
    row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(b))  # [B] keys
    hist_len = stop_seqs.shape[1]

    def step_once(i, logits, done, out, hist, seen):
      keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(row_keys)  # [B]
      tok = sample(logits, keys, temperature, top_k, top_p)  # [B]
      out = out.at[:, i].set(jnp.where(done, -1, tok))  # [B, N]
      hist = jnp.concatenate([hist[:, 1:], tok[:, None]], axis=1)  # [B, L] the newest tokens
      match = (stop_seqs[None] == -1) | (stop_seqs[None] == hist[:, None])  # [B, S, L]
      stopped = jnp.any(jnp.all(match, axis=-1), axis=-1)  # [B]
      if keep_logits:
        seen = seen.at[:, i].set(logits)  # [B, N, V]
      return tok, done | stopped, out, hist, seen, stopped & ~done

    out = jnp.full((b, max_new), -1, jnp.int32)  # [B, N]
    hist = jnp.full((b, hist_len), -2, jnp.int32)  # [B, L] -2 matches no stop id
    seen = jnp.zeros((b, max_new, v) if keep_logits else (0,), jnp.float32)
    stop_at = jnp.full((b,), -1, jnp.int32)  # [B] step at which each row stopped
    tok, new_done, out, hist, seen, hit = step_once(0, logits, done, out, hist, seen)
    stop_at = jnp.where(hit, 0, stop_at)

    def cond(s):
      i, _, _, done, *_ = s
      return (i < n_new) & ~jnp.all(done)

    def body(s):
      i, cache, tok, done, out, hist, seen, stop_at = s
      pos = (lengths + i - 1)[:, None]  # [B, 1] the position of the token fed now
      logits, new = model.apply({"params": params}, tok[:, None], pos, jnp.ones_like(pos), cache,
                                mutable=["kv_cache"])  # [B, 1, V]
      tok, new_done, out, hist, seen, hit = step_once(i, logits[:, 0].astype(jnp.float32), done, out, hist,
                                                      seen)
      return i + 1, new["kv_cache"], tok, new_done, out, hist, seen, jnp.where(hit, i, stop_at)

    state = (jnp.int32(1), cache, tok, new_done, out, hist, seen, stop_at)
    _, _, _, _, out, _, seen, stop_at = jax.lax.while_loop(cond, body, state)
    return out, stop_at, seen
  return decode


# --- entry point ---------------------------------------------------------------------------------


def _stop_table(stop_tokens, stop_sequences) -> np.ndarray:
  """Stop tokens and sequences as one right-aligned table [S, L] (-1 = any token), bucketed."""
  seqs = [[int(t)] for t in (stop_tokens or ())] + [[int(t) for t in s] for s in (stop_sequences or ())]
  for s in seqs:
    if not s or min(s) < 0:
      raise GenerationError(f"stop sequence {s} must be a non-empty list of token ids >= 0")
  width = bucket(max((len(s) for s in seqs), default=1), _MIN_STOP[1])
  table = np.full((bucket(len(seqs), _MIN_STOP[0]), width), -1, np.int32)  # [S, L]
  table[len(seqs):, -1] = -3  # unused rows match nothing
  for i, s in enumerate(seqs):
    table[i, width - len(s):] = s
  return table


def check_settings(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
  """Raise GenerationError for an out-of-range length or sampling setting."""
  if max_new_tokens < 1:
    raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if not (np.isfinite(temperature) and temperature >= 0):
    raise GenerationError(f"temperature must be a finite number >= 0, got {temperature}")
  if top_k < 0:
    raise GenerationError(f"top_k must be >= 0 (0 = off), got {top_k}")
  if not 0 < top_p <= 1:
    raise GenerationError(f"top_p must be in (0, 1], got {top_p}")


def _check(prompts, max_new_tokens, vocab_size, max_length, temperature, top_k, top_p) -> None:
  check_settings(max_new_tokens, temperature, top_k, top_p)
  if not prompts:
    raise GenerationError("no prompts given")
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise GenerationError(f"prompt {i} is empty (give at least one token, e.g. BOS)")
    if min(p) < 0 or max(p) >= vocab_size:
      raise GenerationError(f"prompt {i} holds token id {max(p) if max(p) >= vocab_size else min(p)} outside "
                            f"[0, {vocab_size}) (model.vocab_size)")
  longest = max(len(p) for p in prompts)
  if max_length and longest + max_new_tokens > max_length:
    raise GenerationError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                          f"max length {max_length} (shorten the prompt or max_new_tokens)")


def generate(model_cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop_tokens: Sequence[int] | None = None, stop_sequences: Sequence[Sequence[int]] | None = None,
             backend: str | None = None, dtype: str | None = None, max_length: int | None = None,
             mesh=None, return_logits: bool = False) -> Generation:
  """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

  model_cfg/params: the model (params as `Transformer(model_cfg).init` makes them, unboxed); backend and
  dtype override model_cfg's (compute dtype of activations and the cache). max_length, when given, caps
  prompt + new tokens (the context the model was trained for). mesh: run under this mesh with the
  logical sharding rules (params already placed on it); None = default device. return_logits keeps the
  fp32 logits of every step (tests; [B, max_new_tokens, V]).
  """
  cfg = dataclasses.replace(model_cfg, backend=resolve_backend(backend or model_cfg.backend),
                            dtype=dtype or model_cfg.dtype, remat="none")
  _check(prompts, max_new_tokens, cfg.vocab_size, max_length, temperature, top_k, top_p)
  n = len(prompts)
  b, t, new = bucket(n, 1), bucket(max(len(p) for p in prompts)), bucket(max_new_tokens)
  slots = t + new
  if cfg.sliding_window:
    slots = min(slots, cfg.sliding_window)
  tokens = np.zeros((b, t), np.int32)  # [B, T] right-padded; padding rows hold one token and are skipped
  lengths = np.ones((b,), np.int32)  # [B]
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
    lengths[i] = len(p)
  done = np.arange(b) >= n  # [B]
  stops = _stop_table(stop_tokens, stop_sequences)
  key = jax.random.key(seed)

  with model_scope(cfg, cfg.backend, mesh, quantized=False):
    model = Transformer(cfg)
    samp = (np.float32(temperature), np.int32(top_k), np.float32(top_p))
    t0 = time.perf_counter()
    pkey = ("prefill", cfg, b, t, slots, mesh)
    if pkey not in _COMPILED:
      _COMPILED[pkey] = jax.jit(_prefill_fn(model, slots)).lower(params, tokens, lengths).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, cache = _COMPILED[pkey](params, tokens, lengths)
    jax.block_until_ready(logits)
    prefill_s = time.perf_counter() - t0
    args = (params, cache, logits, lengths, done, np.int32(max_new_tokens), stops, *samp, key)
    dkey = ("decode", cfg, b, t, slots, new, stops.shape, return_logits, mesh)
    t0 = time.perf_counter()
    if dkey not in _COMPILED:
      _COMPILED[dkey] = jax.jit(_decode_fn(model, new, return_logits)).lower(*args).compile()
    compile_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    out, stop_at, seen = jax.device_get(_COMPILED[dkey](*args))
    decode_s = time.perf_counter() - t0

  toks, reasons = [], []
  for i in range(n):
    if stop_at[i] >= 0:
      toks.append(out[i, :stop_at[i] + 1].tolist())
      reasons.append("stop")
    else:
      toks.append(out[i, :max_new_tokens].tolist())
      reasons.append("length")
  logits_out = np.asarray(seen)[:n, :max_new_tokens] if return_logits else None
  return Generation(toks, reasons, {"compile_s": compile_s, "prefill_s": prefill_s, "decode_s": decode_s},
                    logits_out)
