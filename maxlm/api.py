"""`maxlm.Model`: the one loaded model, in Python and behind `maxlm generate` / `maxlm eval`: its config,
parameters, tokenizer and stop ids; logits, generation (token ids or text), evaluation, Hugging Face export.

    from maxlm import Model
    model = Model.from_pretrained("runs/tiny")                 # a run, checkpoints or step directory
    model = Model.from_pretrained("Llama-3.2-1B", dtype="bfloat16")  # an HF directory (safetensors)
    logits = model.logits(tokens)                              # [B, T] int -> [B, T, V] float32
    new_ids = model.generate([[1, 15, 27]], max_new_tokens=20)  # KV-cache decoding (maxlm.generation)
    out = model.complete(["It is a truth"], max_new_tokens=20, stop=["."])  # text in, text out (out.texts)
    model.eval()                                               # loss, perplexity, bits per byte on its eval data
    model.save_pretrained("out/hf")                            # HF safetensors (the source's dtype) + config.json

`Model.load(path, overrides)` loads a model as its run was configured (the trained dtype; dotted config keys
over the checkpoint's), the way the commands do.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import evaluate, generation, inference
from maxlm.checkpoint import CheckpointError
from maxlm.checkpoint import load_params as load_orbax_params
from maxlm.config import Config, ConfigError, MeshConfig, load_config
from maxlm.data import Tokenizer
from maxlm.hf import config as hf_config
from maxlm.hf.files import (EXPORT_DTYPES, HF_SIDE_FILES, atomic_dir, checkpoint_source_dtype, dir_entries, find_step_dir,
                            hf_data_config, is_hf_dir, read_step_config, run_tokenizer_files, write_config_json)
from maxlm.hf.safetensors_io import MAX_SHARD_BYTES, SafetensorsReader
from maxlm.hf.transfer import device_reader, export_hf, load_hf_params, source_dtype
from maxlm.layers import resolve_backend
from maxlm.parallel import context
from maxlm.parallel.mesh import make_mesh
from maxlm.model import Transformer
from maxlm.scope import model_scope
from maxlm.parallel.sharding import shardings_from_logical, strip_boxes

# Of the model, these may differ from the checkpoint's in Model.load (the others are fixed by its weights).
MODEL_OVERRIDES = ("model.backend", "model.dtype", "model.param_dtype")


def _abstract_params(cfg: Config, mesh):
  """(ShapeDtypeStructs with shardings, shardings) of the params, without allocating them."""
  model = Transformer(cfg.model)
  with _scope(cfg, mesh):
    abstract = jax.eval_shape(lambda r: model.init(r, jnp.zeros((1, 8), jnp.int32)), jax.random.PRNGKey(0))
    shardings = shardings_from_logical(abstract["params"], mesh)
  structs = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   strip_boxes(abstract["params"]), shardings)
  return structs, shardings


def _scope(cfg: Config, mesh):
  """Mesh + logical axis rules + TE's unquantized scope (maxlm/scope.py): entered for init and every trace."""
  return model_scope(cfg.model, resolve_backend(cfg.model.backend), mesh, quantized=False)


def _token_prompts(prompts) -> list[list[int]]:
  """generate's prompts as lists of ints; TypeError for text (that is `complete`'s) or anything not a list of
  integer-id sequences (a string would otherwise become a list of characters)."""
  text = TypeError("generate takes token ids, a list of prompts each a list of ints (e.g. [[1, 791]]); "
                   "for text use Model.complete(['...'])")
  if isinstance(prompts, (str, bytes)):
    raise text
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, (str, bytes)):
      raise text
    a = np.asarray(p)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
      raise TypeError(f"generate takes a list of prompts, each a list of int token ids (e.g. [[1, 791]]); "
                      f"prompt {i} is {type(p).__name__} {a.dtype} of shape {a.shape}")
    out.append(a.astype(np.int64).tolist())
  return out


class Model:
  """A Llama/Mistral model: its full `config` (a maxlm Config), `params` (on `mesh`) and inference."""

  def __init__(self, config: Config, params, mesh, hf_config_dict: dict | None = None,
               side_files: Sequence[tuple[Path, str]] = (), source_dtype: str = "float32", step_dir: Path | None = None):
    self.config, self.params, self.mesh = config, params, mesh
    self.source_dtype = source_dtype  # of the loaded weights' files: save_pretrained's default dtype
    self.hf_config = hf_config_dict  # the imported config.json (kept so save_pretrained round-trips it)
    self.side_files = list(side_files)  # (source, file name) of the tokenizer files save_pretrained copies
    self.step_dir = step_dir  # the checkpoint step loaded; None for an HF directory or a model made in Python
    self._model = Transformer(config.model)
    self._logits_fn = None
    self._text = None  # (tokenizer, bos_id, stop_ids), read on first use

  @classmethod
  def load(cls, path: str | Path, overrides: Sequence[str] = ()) -> "Model":
    """Load a run / checkpoints / step directory or an HF directory as its run was configured (the way
    `maxlm generate` and `maxlm eval` do), with its tokenizer: the checkpoint's config (an HF directory's mapped
    config.json) with dotted config `overrides` over it (`data.eval_paths=new.txt`, `model.dtype=float32`, ...);
    `data.paths` without `data.type` takes the format from the new files' names (data.type=auto).
    Of the model only MODEL_OVERRIDES may change. Unknown keys and bad values raise ConfigError before any
    weights are read; weights CheckpointError; the tokenizer DataError."""
    path = Path(path)
    if not path.exists():
      raise CheckpointError(f"{path}: no such file or directory")
    overrides = list(overrides)
    keys = {o.split("=", 1)[0].strip().lstrip("-") for o in overrides}  # as parse_overrides reads them
    if "data.paths" in keys and "data.type" not in keys:
      # The checkpoint's data.type is the one its run resolved for its own files (or none); new paths get
      # theirs from their names again (data.type=auto), as a training command line would.
      overrides.insert(0, "data.type=auto")
    fixed = [o.split("=", 1)[0] for o in overrides if o.startswith("model.") and o.split("=", 1)[0] not in MODEL_OVERRIDES]
    load_config(overrides)  # unknown keys and bad values stop here, before any weights are read
    if fixed:
      raise ConfigError(f"{fixed[0]} is fixed by the checkpoint; of the model only {', '.join(MODEL_OVERRIDES[:-1])} "
                        f"and {MODEL_OVERRIDES[-1]} may be overridden")
    step = None if is_hf_dir(path) else find_step_dir(path)
    want = load_config(overrides, base=read_step_config(step) if step else None).model
    model = cls.from_pretrained(path, backend=want.backend, dtype=want.dtype, param_dtype=want.param_dtype)
    model.config = load_config(overrides, base=model.config)
    model._model = Transformer(model.config.model)
    model._text_side()  # the tokenizer is read now: a bad one stops the load
    return model

  @property
  def tokenizer(self) -> Tokenizer:
    """The run's tokenizer (data.tokenizer, else the one its prepared shards record, else the shipped one; an
    HF directory's tokenizer.json), read on first use."""
    return self._text_side()[0]

  @property
  def bos_id(self) -> int | None:
    """The id prepended to prompts, as the run trained (data.add_bos); None: nothing."""
    return self._text_side()[1]

  @property
  def stop_ids(self) -> list[int]:
    """The ids that end a generation: data.eos_id or the tokenizer's EOS, and an HF config's eos_token_id."""
    return self._text_side()[2]

  @property
  def max_length(self) -> int | None:
    """The longest prompt + generation: a checkpoint's data.seq_len, an HF config's max_position_embeddings."""
    return (self.hf_config or {}).get("max_position_embeddings") if self.step_dir is None else self.config.data.seq_len

  def _text_side(self) -> tuple[Tokenizer, int | None, list[int]]:
    if self._text is None:
      eos = (self.hf_config or {}).get("eos_token_id")
      self._text = inference.run_tokenizer(self.config.data, self.config.model.vocab_size,
                                           eos if isinstance(eos, list) else [eos])
    return self._text

  @classmethod
  def from_pretrained(cls, path: str | Path, backend: str = "auto", dtype: str = "float32",
                      param_dtype: str = "float32", mesh=None) -> "Model":
    """Load an HF directory (config.json + safetensors, sharded or not) or a maxlm run / checkpoints /
    step directory. `dtype` is the compute dtype, `param_dtype` the weights' (float32 holds bf16 files
    exactly); `mesh` defaults to FSDP over every device. `.source_dtype` remembers the files' dtype (an
    HF directory's safetensors dtype, float32 if its tensors mix dtypes; a checkpoint's parameter dtype)
    for save_pretrained. Bad input raises ConfigError (config) or CheckpointError (weights) in one line."""
    path = Path(path)
    if not path.exists():
      raise CheckpointError(f"{path}: no such file or directory")
    over = dict(backend=backend, dtype=dtype, param_dtype=param_dtype, precision="bf16", remat="none")
    mesh = mesh if mesh is not None else make_mesh(MeshConfig())
    if is_hf_dir(path):
      hf = hf_config.read_config_json(path)
      m = dataclasses.replace(hf_config.from_hf(hf, where=str(path / "config.json")), scan_layers=True, **over)
      data = hf_data_config(path, hf, m.vocab_size)
      cfg = Config(model=m, data=data)
      _, shardings = _abstract_params(cfg, mesh)
      reader = SafetensorsReader(path)
      params = load_hf_params(reader, m, shardings)
      side = [(path / n, n) for n in HF_SIDE_FILES if (path / n).is_file()]
      return cls(cfg, params, mesh, hf_config_dict=hf, side_files=side, source_dtype=source_dtype(reader, m))
    step_dir = find_step_dir(path)
    run = read_step_config(step_dir)
    cfg = dataclasses.replace(run, model=dataclasses.replace(run.model, **over))
    structs, _ = _abstract_params(cfg, mesh)
    params = load_orbax_params(str(step_dir), structs)
    return cls(cfg, params, mesh, side_files=run_tokenizer_files(run.data),
               source_dtype=checkpoint_source_dtype(step_dir, run), step_dir=step_dir)

  def logits(self, tokens, segment_ids=None, positions=None) -> np.ndarray:
    """Logits [B, T, V] (float32, on the host) for int tokens [B, T]; packed rows take segment_ids
    (documents 1..k, 0 = padding) and positions (restarting at 0 per document)."""
    tokens = np.asarray(tokens, np.int32)  # [B, T]
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    if self._logits_fn is None:
      def fn(params, tokens, positions, segment_ids):
        def apply(t, p, s):
          return self._model.apply({"params": params}, t, p, s).astype(jnp.float32)
        # on a mesh with a context axis: run in its load-balanced order, logits restored (maxlm/parallel/context.py)
        return context.apply_balanced(apply, tokens, positions, segment_ids, strategy=self._model.context_strategy,
                                      window=self.config.model.sliding_window)
      self._logits_fn = jax.jit(fn)
    pos = None if positions is None else np.asarray(positions, np.int32)  # [B, T]
    seg = None if segment_ids is None else np.asarray(segment_ids, np.int32)  # [B, T]
    # float32 compute means float32 matmuls: on GPUs XLA's default precision would use TF32 (10-bit mantissa).
    # This covers XLA's dots (the flax backend); TE's own GEMMs run float32 inputs in TF32 on a GPU anyway
    # (seen: 1.7e-3 from transformers' logits on the H200): exact float32 on a GPU needs backend="flax".
    precision = "highest" if self.config.model.dtype == "float32" else "default"
    with _scope(self.config, self.mesh), jax.default_matmul_precision(precision):
      out = self._logits_fn(self.params, tokens, pos, seg)  # [B, T, V]
    return np.asarray(jax.device_get(out))

  def generate(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] | None = None,
               stop_sequences: Sequence[Sequence[int]] | None = None, max_length: int | None = None):
    """Continue each prompt (token ids) by up to max_new_tokens with a KV cache (`maxlm.generation`);
    returns the new token ids per prompt. stop_tokens / stop_sequences end a row; max_length caps prompt +
    new tokens."""
    out = generation.generate(self.config.model, self.params, _token_prompts(prompts), max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              stop_tokens=stop_tokens, stop_sequences=stop_sequences, max_length=max_length,
                              mesh=self.mesh)
    return out.tokens

  def complete(self, texts: Sequence[str], max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop: Sequence[str] = (), add_bos: bool | None = None,
               max_length: int | None = None) -> inference.Completions:
    """Continue each text (one batch) with the model's tokenizer: BOS first as the run trained (add_bos=True or
    False overrides), EOS (`stop_ids`) and the `stop` texts end a row (the returned text leaves the stop out,
    the tokens keep it), prompt + new tokens at most max_length (default `self.max_length`)."""
    if isinstance(texts, (str, bytes)):
      raise TypeError(f"complete takes a list of texts, one batch (e.g. complete([{texts[:20]!r}])), not one "
                      f"{type(texts).__name__}")
    tok = self.tokenizer
    prompts = inference.encode_prompts(tok, texts, self.bos_id, add_bos)
    stop_seqs = inference.encode_stops(tok, stop)
    out = generation.generate(self.config.model, self.params, prompts, max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, stop_tokens=self.stop_ids, stop_sequences=stop_seqs,
                              max_length=self.max_length if max_length is None else max_length, mesh=self.mesh)
    return inference.completions(tok, prompts, out, [[s] for s in self.stop_ids] + stop_seqs)

  def eval(self, batches=None, max_batches: int | None = None) -> dict:
    """Loss (token-weighted mean NLL, nats), perplexity, bits per byte, tokens, bytes and batches (maxlm/evaluate.py)
    over `batches` (dicts of int32 [B, T] inputs/targets/segment_ids/positions; default: the config's eval data,
    data.eval_paths or its held-out split), at most max_batches (0: all; default: all of the given batches,
    train.eval_steps of the config's data)."""
    tok = self.tokenizer
    skip = [self.bos_id, *self.stop_ids, tok.bos_id, tok.eos_id]  # not text: left out of the bytes
    if batches is not None:
      return evaluate.evaluate_params(self.config, self.params, self.mesh, tok, skip, batches, max_batches or 0)
    it = evaluate.eval_batches(self.config)
    try:
      limit = self.config.train.eval_steps if max_batches is None else max_batches
      return evaluate.evaluate_params(self.config, self.params, self.mesh, tok, skip, it, limit)
    finally:
      it.close()

  def save_pretrained(self, out_dir: str | Path, dtype: str | None = None,
                      max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False) -> Path:
    """Write the model in Hugging Face format to `out_dir`: safetensors shards of at most max_shard_bytes
    (with model.safetensors.index.json when there are several), config.json and the tokenizer files.
    `dtype` (float32, bfloat16, float16) defaults to `.source_dtype`, so loading and saving is bit for
    bit. `out_dir` may be missing or an empty directory; a non-empty one is refused unless `overwrite`,
    which replaces the model files and keeps the others (see atomic_dir). Nothing half-written is left."""
    dtype = dtype or self.source_dtype
    if dtype not in EXPORT_DTYPES:
      raise ConfigError(f"save_pretrained: dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    out = Path(out_dir)
    if not overwrite and dir_entries(out):
      raise ConfigError(f"output directory {out} already exists and is not empty (overwrite=True replaces "
                        f"its model files)")
    m = self.config.model
    cfg = hf_config.to_hf(m, dtype, base=self.hf_config, max_position=self.config.data.seq_len,
                          bos_id=self.config.data.bos_id, eos_id=self.config.data.eos_id)
    def write(tmp: Path) -> None:
      export_hf(device_reader(self.params, m), m, tmp, dtype, max_shard_bytes)
      write_config_json(tmp, cfg)
    return atomic_dir(out, write, self.side_files, overwrite=overwrite)
