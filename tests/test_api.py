"""maxlm.Model (maxlm/api.py) on a maxlm run: loading from run / checkpoints / step directories, logits
against the independent reference (tests/reference.py), packed rows, HF export with the tokenizer, errors,
and a lazy `import maxlm`."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

import reference as R
from maxlm import Model
from maxlm.checkpoint import CheckpointError
from maxlm.cli.train import main as train_main
from maxlm.config import ConfigError, DataConfig
from maxlm.data.tokenizer import SMALL_TOKENIZER
from maxlm.hf.files import run_tokenizer_files

U32 = 2.0 ** -24  # float32 unit roundoff
ARGS = ["model.backend=flax", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=8", "model.ffn_dim=64", "model.vocab_size=8192", "model.rope_scaling=llama3",
        "model.rope_original_max_position=64", "model.init_std=0.2", "data.seq_len=16",
        "data.global_batch_size=8", "train.steps=1", "train.eval_every=0", "checkpoint.enabled=true"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("runs")
  assert train_main(ARGS + [f"output_dir={out}", "run_name=tiny"]) == 0
  return out / "tiny"


@pytest.fixture(scope="module")
def model(run_dir):
  return Model.from_pretrained(run_dir, backend="flax")


def _leaves(params):
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_run_checkpoints_and_step_directories_load_alike(run_dir, model):
  assert model.config.model.d_model == 32 and model.config.model.dtype == "float32"
  want = _leaves(model.params)
  for path in (run_dir / "checkpoints", run_dir / "checkpoints" / "1"):
    have = _leaves(Model.from_pretrained(path, backend="flax").params)
    assert have.keys() == want.keys() and all(np.array_equal(have[k], want[k]) for k in want)


def test_logits_match_the_reference(model):
  tokens = np.random.default_rng(0).integers(0, 8192, size=(2, 12))
  logits = model.logits(tokens)  # [2, 12, V]
  ref = R.forward(R.as_float64(jax.device_get(model.params)), model.config.model, tokens)
  # float32 against float64: test_model's derivation, 64 ulps of the logit scale per block and the head
  tol = 64 * (model.config.model.n_layers + 1) * U32 * np.abs(ref).max()
  assert logits.dtype == np.float32 and np.abs(logits - ref).max() <= tol



def test_generate_is_greedy_argmax_over_the_logits_and_takes_only_token_ids(model):
  """Greedy generate (KV cache) equals extending the prompt by argmax of model.logits' last position, one token at
  a time (no cache); a [B, T] integer array is a batch of prompts. Text or a flat list of ids is a TypeError
  that names the right call (a string used to become a list of characters and fail deep inside)."""
  prompt = [3, 17, 42, 7]
  seq = list(prompt)
  for _ in range(4):
    seq.append(int(np.argmax(model.logits([seq])[0, -1])))
  assert model.generate([prompt], 4) == [seq[len(prompt):]]
  assert model.generate(np.array([prompt, prompt], np.int32), 4) == [seq[len(prompt):]] * 2
  with pytest.raises(TypeError, match=r"generate takes token ids.*for text use Model\.complete"):
    model.generate(["It is a truth"], 4)
  with pytest.raises(TypeError, match=r"generate takes token ids"):
    model.generate("It is a truth", 4)
  with pytest.raises(TypeError, match=r"prompt 0 is int int64 of shape \(\)"):
    model.generate([3, 17, 42], 4)
  with pytest.raises(TypeError, match=r"prompt 1 is list float64 of shape \(2,\)"):
    model.generate([[3, 17], [1.5, 2.0]], 4)
  with pytest.raises(TypeError, match=r"complete takes a list of texts, one batch \(e\.g\. complete\(\['It is'\]\)\)"):
    model.complete("It is", 4)

def test_packed_rows_equal_documents_alone(model):
  rng = np.random.default_rng(1)
  a, b = rng.integers(0, 8192, size=5), rng.integers(0, 8192, size=7)
  packed = np.concatenate([a, b])[None]  # [1, 12]
  seg = np.array([[1] * 5 + [2] * 7])
  pos = np.array([list(range(5)) + list(range(7))])
  out = model.logits(packed, segment_ids=seg, positions=pos)
  alone_a, alone_b = model.logits(a[None]), model.logits(b[None])
  # same computation up to the order of fp32 reductions over different lengths: the same 64-ulp bound
  tol = 64 * 3 * U32 * max(np.abs(alone_a).max(), np.abs(alone_b).max())
  np.testing.assert_allclose(out[0, :5], alone_a[0], rtol=0, atol=tol)
  np.testing.assert_allclose(out[0, 5:], alone_b[0], rtol=0, atol=tol)


def test_save_pretrained_exports_config_weights_and_tokenizer(model, tmp_path):
  assert model.source_dtype == "float32"  # the run's model.param_dtype
  out = model.save_pretrained(tmp_path / "hf")  # float32 by default: the run's parameter dtype
  cfg = json.loads((out / "config.json").read_text())
  assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
  assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["tie_word_embeddings"] is False
  assert cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 8
  from maxlm.data.tokenizer import DEFAULT_TOKENIZER  # the run used the shipped tokenizer
  assert (out / "tokenizer.model").read_bytes() == DEFAULT_TOKENIZER.read_bytes()
  back = Model.from_pretrained(out, backend="flax")
  have, want = _leaves(back.params), _leaves(model.params)
  assert all(np.array_equal(have[k], want[k]) for k in want)  # fp32 files hold the weights exactly
  assert back.config.data.tokenizer == str(out)  # generate/eval find the tokenizer there


def _files(d: Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_save_pretrained_into_existing_directories(model, tmp_path):
  """Empty: written into (HF's convention; tempfile.TemporaryDirectory() is how people call it), and
  left empty on an error. Non-empty: refused in one line naming it; overwrite=True replaces the model
  files, removes stale shards and keeps unrelated files."""
  want = _files(model.save_pretrained(tmp_path / "ref", max_shard_bytes=40_000))
  assert len([n for n in want if n.endswith(".safetensors")]) > 1  # sharded, with an index
  with tempfile.TemporaryDirectory() as d:
    assert model.save_pretrained(d, max_shard_bytes=40_000) == Path(d)
    assert _files(Path(d)) == want  # and no hidden work directory left
  empty = tmp_path / "empty"
  empty.mkdir()
  real = model.side_files
  model.side_files = real + [(tmp_path / "no-such-file", "tokenizer.json")]  # fails after the weights
  try:
    with pytest.raises(FileNotFoundError):
      model.save_pretrained(empty)
  finally:
    model.side_files = real
  assert list(empty.iterdir()) == []
  full = tmp_path / "full"
  full.mkdir()
  (full / "README.md").write_text("notes")
  (full / "model-00001-of-00009.safetensors").write_text("stale")
  (full / "config.json").write_text("{}")
  with pytest.raises(ConfigError) as e:
    model.save_pretrained(full)
  assert str(full) in str(e.value) and "not empty" in str(e.value) and "\n" not in str(e.value)
  assert _files(full).keys() == {"README.md", "model-00001-of-00009.safetensors", "config.json"}
  model.save_pretrained(full, max_shard_bytes=40_000, overwrite=True)
  assert _files(full) == want | {"README.md": b"notes"}
  with pytest.raises(ConfigError, match="dtype 'int8' is not one of float32, bfloat16, float16"):
    model.save_pretrained(tmp_path / "int8", dtype="int8")
  assert not (tmp_path / "int8").exists()


def test_a_run_naming_a_shipped_tokenizer_exports_that_file(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # configs/default.yml names it bare; no such file in the working directory
  assert run_tokenizer_files(DataConfig(tokenizer="austen_sp512.model")) == [(SMALL_TOKENIZER, "tokenizer.model")]



def test_a_run_exports_the_tokenizer_it_trained_with(tmp_path, monkeypatch):
  """Without data.tokenizer, a run on prepared shards trained with the tokenizer the shards record, and one on raw
  text with the shipped 8k model: the HF export carries that file (it carried none: generation found the tokenizer,
  `convert maxlm-to-hf` and save_pretrained did not). Synthetic tokens, or data not on this machine: none."""
  from maxlm.data.prepare import prepare
  from maxlm.data.tokenizer import DEFAULT_TOKENIZER
  monkeypatch.chdir(tmp_path)
  (tmp_path / "a.txt").write_text("".join(f"line {i} of some prose\n" for i in range(60)))
  prepare([str(tmp_path / "a.txt")], str(tmp_path / "shards"), tokenizer=str(SMALL_TOKENIZER), progress=False)
  recorded = Path(json.loads((tmp_path / "shards" / "maxlm_data.json").read_text())["tokenizer"]["path"])
  assert recorded.samefile(SMALL_TOKENIZER)
  for data in (DataConfig(type="arrayrecord", paths="shards"), DataConfig(paths="shards")):
    assert run_tokenizer_files(data) == [(recorded, "tokenizer.model")]
  assert run_tokenizer_files(DataConfig(paths="a.txt")) == [(DEFAULT_TOKENIZER, "tokenizer.model")]
  assert run_tokenizer_files(DataConfig(type="synthetic")) == []
  assert run_tokenizer_files(DataConfig(paths="gone/")) == []
  assert run_tokenizer_files(DataConfig(paths="a.txt", tokenizer="austen_sp512.model")) == [
      (SMALL_TOKENIZER, "tokenizer.model")]  # data.tokenizer first

def test_bad_paths_raise_one_line_checkpoint_errors(tmp_path, run_dir):
  with pytest.raises(CheckpointError, match="no such file or directory"):
    Model.from_pretrained(tmp_path / "nope")
  (tmp_path / "empty").mkdir()
  with pytest.raises(CheckpointError, match="no checkpoint"):
    Model.from_pretrained(tmp_path / "empty")


def test_import_maxlm_stays_light():
  code = ("import sys, maxlm; assert 'jax' not in sys.modules; from maxlm import Model; "
          "assert 'jax' in sys.modules and Model.__module__ == 'maxlm.api'")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_atomic_dir_makes_missing_parents_and_leaves_nothing_on_an_error(tmp_path):
  from maxlm.hf.files import atomic_dir
  out = atomic_dir(tmp_path / "a" / "b" / "out", lambda d: (d / "f").write_text("x"))
  assert (out / "f").read_text() == "x" and sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["out"]

  def fail(d):
    (d / "half").write_text("y")
    raise OSError("disk full")
  with pytest.raises(OSError):
    atomic_dir(tmp_path / "c" / "d" / "out", fail)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # c/ and c/d/ made for it are gone again
  with pytest.raises(ConfigError, match="is not a directory"):
    atomic_dir(out / "f", lambda d: None)
