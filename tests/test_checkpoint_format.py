"""docs/checkpoint_format.md is true. Its Python blocks, run as written against a checkpoint of a tiny
training run (saved on 8 simulated CPU devices), restore the parameters onto 8, 2 and 1 devices exactly
as the trainer holds them, reproduce the saved checksums and digests, and compute the model's logits
from the documented weight layout; its parameter and FP8 tables match the model's trees, and the data item
holds the keys the Files table names."""

import itertools
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from maxlm.build import build_step
from maxlm.checkpoint import Checkpointer
from maxlm.config import CheckpointConfig, load_config, to_dict
from maxlm.trainer import Trainer

DOC = Path(__file__).resolve().parent.parent / "docs" / "checkpoint_format.md"
# G = 2 query heads per KV head; llama3 RoPE scaling with a short original context so that it changes
# the frequencies used at positions < 16; a sliding window shorter than the sequence; fp32 compute
# so that the model can be compared with the float64 reference of the doc.
TINY = ["model.backend=flax", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8",
        "model.ffn_dim=48", "model.n_layers=2", "model.vocab_size=128", "model.dtype=float32",
        "model.remat=none", "model.rope_scaling=llama3", "model.rope_original_max_position=64",
        "model.sliding_window=6", "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=8",
        "optim.warmup_steps=0", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]


def python_blocks(markdown: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", markdown, re.S | re.M)


def _leaves(tree) -> dict:
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _paths(tree, prefix: str = "") -> dict[str, tuple]:
  """{"a/b/c": shape} of a tree of arrays or ShapeDtypeStructs (nested dicts)."""
  return {prefix + "/".join(str(k.key) for k in p): tuple(x.shape)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """Two real training steps on a (data, fsdp, tensor) = (1, 4, 2) mesh, a checkpoint of step 2, and
  the namespace the doc's Python blocks leave behind, run in order with `step_dir` set."""
  cfg = load_config(TINY)
  t = Trainer(cfg)
  t.build()
  for _ in range(2):
    t.state, _ = t.train_step(t.state, t.to_device(next(t.train_data)))
  root = tmp_path_factory.mktemp("run") / "checkpoints"
  ckpt = Checkpointer(root, CheckpointConfig(enabled=True))
  ckpt.save(2, t.state, t.train_data.get_state(), to_dict(cfg))
  ckpt.close()
  ns = {"step_dir": root / "2"}
  blocks = python_blocks(DOC.read_text())
  assert len(blocks) >= 5
  for block in blocks:
    exec(compile(block, str(DOC), "exec"), ns)  # noqa: S102 - the documented recipe, as written
  return {"cfg": cfg, "trainer": t, "step_dir": root / "2", "ns": ns}


def test_params_restore_as_saved_and_onto_fewer_devices(run):
  ns, want = run["ns"], _leaves(run["trainer"].state.params)
  devices = jax.devices()
  assert len(devices) == 8
  cases = [(ns["params"], None), (ns["restore_params"](run["step_dir"], devices), 8),
           (ns["params_on_2"], 2), (ns["params_on_1"], 1)]
  for params, n in cases:
    got = _leaves(params)
    assert got.keys() == want.keys()
    for k, x in got.items():
      assert x.dtype == want[k].dtype and np.array_equal(np.asarray(x), np.asarray(want[k])), k
      if n is not None:
        assert x.sharding.device_set == set(devices[:n]), k
    if n == 2:  # not merely replicated: some arrays are split over the two devices
      assert any(x.sharding.shard_shape(x.shape) != x.shape for x in got.values())


def test_state_item_and_adam_moments(run):
  ns, state = run["ns"], run["trainer"].state
  assert int(ns["state"]["step"]) == 2 and ns["state"]["model_state"] == {}
  for name in ("mu", "nu"):
    want, got = _leaves(getattr(state.opt_state[1][0], name)), _leaves(ns["adam"][name])
    assert got.keys() == want.keys()
    assert all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want), name
  assert np.array_equal(np.asarray(ns["state"]["rng"]), np.asarray(state.rng))


def test_documented_checksums_reproduce_the_saved_ones(run):
  """The doc's numpy checksum equals maxlm's (computed in JAX on the sharded arrays) for every array of
  the train state; its digest asserts ran when the blocks were executed."""
  arrays = run["ns"]["meta"]["arrays"]
  leaves = _leaves(run["trainer"].state)
  assert arrays.keys() == leaves.keys()
  for k, x in leaves.items():
    assert run["ns"]["array_checksum"](np.asarray(x)) == arrays[k][2], k


# Both sides are computed from the same weights: the model in float32, the doc's reference in float64.
# Float32 rounding (6e-8 relative per operation) over two layers of sums of <= 48 terms bounds the
# difference near 1e-6 of the logits' scale (measured: 2.3e-7). 1e-4 of the scale is far above that and
# below what a wrong reading changes (measured, relative to the scale: no llama3 scaling 9e-4, query
# heads taken KV-minor 5.5e-3, interleaved RoPE 6.3e-3, no sliding window 0.25, K and V swapped 0.65).
def _close(a, b) -> bool:
  return bool(np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(b)))


def _model_logits(built, params, tokens):
  with built.scope():
    return np.asarray(jax.jit(built.model.apply)({"params": params}, tokens[None]))[0]  # [T, V]


def test_reference_forward_of_the_doc_matches_the_model(run):
  ns, t = run["ns"], run["trainer"]
  config = ns["json_item"](run["step_dir"], "config")
  tokens = np.arange(8) % 5  # the doc's example
  model = _model_logits(t.built, t.state.params, tokens)
  assert _close(model, ns["logits"])
  tokens = (np.arange(16) * 37) % 128  # a full-length sequence: the sliding window (6) matters
  model = _model_logits(t.built, t.state.params, tokens)
  assert _close(model, ns["forward"](ns["params"], config, tokens))
  # sensitivity: the same check fails for a wrong reading of the fused QKV kernel
  split = ns["split_qkv"]
  try:
    ns["split_qkv"] = lambda kernel: (lambda q, k, v: (q, v, k))(*split(kernel))
    assert not _close(model, ns["forward"](ns["params"], config, tokens))
  finally:
    ns["split_qkv"] = split


def test_unrolled_layers_are_the_slices_of_the_scanned_ones(run):
  """`layers_<i>` with model.scan_layers=false holds slice i of the scanned `layers` arrays: the unrolled
  model given those slices computes the same logits, and so does the doc's reference."""
  ns, t = run["ns"], run["trainer"]
  params = dict(t.state.params)
  stacked = params.pop("layers")
  for i in range(run["cfg"].model.n_layers):
    params[f"layers_{i}"] = jax.tree_util.tree_map(lambda x, i=i: np.asarray(x)[i], stacked)
  unrolled = Trainer(load_config(TINY + ["model.scan_layers=false"]))
  unrolled = build_step(unrolled.cfg, unrolled.mesh, abstract=True)
  tokens = (np.arange(16) * 11) % 128
  want = _model_logits(t.built, t.state.params, tokens)
  assert _close(_model_logits(unrolled, params, tokens), want)
  config = ns["json_item"](run["step_dir"], "config")
  assert np.array_equal(ns["forward"](params, config, tokens), ns["forward"](ns["params"], config, tokens))


def _table(section: str) -> list[tuple[str, str, str]]:
  """(path, shape expression, holds) rows of the first table under `## <section>` in the doc."""
  text = DOC.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"^\| `([^`]+)` \| `\[([^\]]*)\]` \| (.*?) \|$", text, re.M)


def _expand(path: str) -> list[str]:
  """`a/{x,y}_b` -> [a/x_b, a/y_b]."""
  parts = re.split(r"\{([^}]*)\}", path)
  choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
  return ["".join(c) for c in itertools.product(*choices)]


def _documented(section: str, m, applies) -> dict[str, tuple]:
  """The documented {path: shape} for model config `m` (scanned or unrolled per m.scan_layers)."""
  sym = {"V": m.vocab_size, "D": m.d_model, "L": m.n_layers, "H": m.n_heads, "KV": m.n_kv_heads,
         "G": m.n_heads // m.n_kv_heads, "Dh": m.head_dim, "F": m.ffn_dim, "A": m.fp8_amax_history_len}
  out = {}
  rows = _table(section)
  assert rows, section
  for path, shape, holds in rows:
    if not applies(holds):
      continue
    shape = tuple(eval(f"({shape},)", {}, sym))  # noqa: S307 - the doc's own shape expressions
    for p in _expand(path):
      if "layers/" in p and not m.scan_layers:
        out.update({p.replace("layers/", f"layers_{i}/"): shape[1:] for i in range(m.n_layers)})
      else:
        out[p] = shape
  return out


def _abstract(*extra):
  cfg = load_config(TINY + list(extra))
  t = Trainer(cfg)
  state = build_step(cfg, t.mesh, abstract=True).state  # in the model's scope: TE layers need its mesh resource
  t.train_data.close()
  return cfg, state


def _params_rows(m):
  def applies(holds: str) -> bool:
    if "untied embeddings only" in holds:
      return not m.tie_embeddings
    if "tied embeddings only" in holds:
      return m.tie_embeddings
    return True
  return _documented("Weight layout", m, applies)


def test_documented_parameter_table_matches_the_trees(run):
  assert _paths(run["ns"]["params"]) == _params_rows(run["cfg"].model)  # the checkpoint (scanned)
  for extra in (["model.scan_layers=false"], ["model.tie_embeddings=true"]):
    cfg, state = _abstract(*extra)
    assert _paths(state.params) == _params_rows(cfg.model), extra


@pytest.mark.te
def test_documented_fp8_table_matches_the_trees(fake_fp8_gpu):
  te = ["model.backend=te", "model.fp8_amax_history_len=4"]
  for extra in (["model.precision=fp8_delayed"],
                ["model.precision=fp8_delayed", "model.scan_layers=false", "model.fp8_lm_head=true"]):
    cfg, state = _abstract(*te, *extra)
    lm_head = cfg.model.fp8_lm_head
    want = _documented("FP8 state", cfg.model, lambda holds: "fp8_lm_head=true" not in holds or lm_head)
    assert _paths(state.model_state) == want, extra
  _, state = _abstract(*te, "model.precision=fp8_current")
  assert jax.tree_util.tree_leaves(state.model_state) == []


def test_data_item_is_documented(run):
  """The data item holds the keys its row of the Files table names, one state per row of the batch."""
  data = json.loads((run["step_dir"] / "data" / "metadata").read_text())
  row = next(line for line in DOC.read_text().splitlines() if line.startswith("| `data/metadata`"))
  assert all(f'"{k}"' in row for k in data), (sorted(data), row)
  assert sorted(data["rows"], key=int) == [str(r) for r in range(data["streams"])]
  assert data["streams"] == run["cfg"].data.global_batch_size and data["batches"] == 2
