"""`maxlm convert` (maxlm/convert.py): HF golden -> Orbax tree -> fine-tuning run (checkpoint.load_params)
-> HF again, checked against transformers' logits and the original bits; one-line errors and exit codes
with nothing left on disk."""

import json
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors import safe_open

from maxlm import Model
from maxlm.convert import main as convert
from maxlm.hf.config import from_hf
from maxlm.train import main as train_main

GOLDEN = Path(__file__).resolve().parent / "golden" / "hf"


def bits(directory: Path) -> dict[str, tuple[str, np.ndarray]]:
  """{tensor: (dtype, raw bits)} of a safetensors directory, read by safetensors itself."""
  out = {}
  for f in sorted(directory.glob("*.safetensors")):
    with safe_open(str(f), framework="flax") as st:
      for k in st.keys():
        x = np.asarray(st.get_tensor(k))
        out[k] = (str(x.dtype), x.view(f"uint{8 * x.dtype.itemsize}"))
  return out


def one_error_line(capsys) -> str:
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("maxlm: error: "), err
  return err[0]


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
  """llama3 golden converted, then one training step at learning rate 0 from it (so the run's
  checkpoint holds the converted weights, through the trainer's own load_params path)."""
  tmp = tmp_path_factory.mktemp("convert")
  assert convert(["hf-to-maxlm", str(GOLDEN / "llama3"), str(tmp / "conv")]) == 0
  args = [f"config={tmp / 'conv' / 'model.yml'}", f"checkpoint.load_params={tmp / 'conv'}", "train.steps=1",
          "optim.learning_rate=0", "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=8",
          "model.backend=flax", "checkpoint.enabled=true", "train.eval_every=0", f"output_dir={tmp}",
          "run_name=ft"]
  assert train_main(args) == 0
  return tmp


def test_converted_weights_fine_tune_and_match_transformers(finetuned, capsys):
  g = np.load(GOLDEN / "llama3" / "golden.npz")
  logits = Model.from_pretrained(finetuned / "ft", backend="flax").logits(g["tokens"])
  assert np.abs(logits - g["logits"]).max() <= 1e-4  # test_hf's bound: the weights arrived unchanged
  out = finetuned / "hf"
  assert convert(["maxlm-to-hf", str(finetuned / "ft"), str(out)]) == 0
  assert "maxlm: wrote" in capsys.readouterr().out
  want, have = bits(GOLDEN / "llama3"), bits(out)
  assert have.keys() == want.keys()
  for k in want:  # bf16 -> fp32 master weights -> bf16: bit for bit
    assert have[k][0] == want[k][0] == "bfloat16" and np.array_equal(have[k][1], want[k][1]), k
  original = json.loads((GOLDEN / "llama3" / "config.json").read_text())
  assert from_hf(json.loads((out / "config.json").read_text())) == from_hf(original)


def test_orbax_tree_restores_with_plain_orbax(tmp_path):
  """The tree written tensor by tensor is a normal Orbax tree: bf16 here, holding the HF bits exactly."""
  assert convert(["hf-to-maxlm", str(GOLDEN / "mistral"), str(tmp_path / "c"), "--dtype", "bfloat16"]) == 0
  params = ocp.StandardCheckpointer().restore(tmp_path / "c" / "params")
  assert str(params["layers"]["qkv"]["kernel"].dtype) == "bfloat16"
  assert params["layers"]["qkv"]["kernel"].shape == (2, 32, 1, 6, 8)  # [L, D, KV, G+2, Dh]
  hf = bits(GOLDEN / "mistral")
  emb = np.asarray(params["embed"]["embedding"]).view(np.uint16)
  assert np.array_equal(emb, hf["model.embed_tokens.weight"][1])
  down = np.asarray(params["layers"]["mlp"]["wo_kernel"][1]).view(np.uint16)  # [F, D] of layer 1
  assert np.array_equal(down, hf["model.layers.1.mlp.down_proj.weight"][1].T)


def test_unrolled_tree_and_sharded_export(tmp_path):
  assert convert(["hf-to-maxlm", str(GOLDEN / "llama_tied"), str(tmp_path / "c"), "--unrolled"]) == 0
  g = np.load(GOLDEN / "llama_tied" / "golden.npz")
  m = Model.from_pretrained(tmp_path / "c", backend="flax")  # the converted directory loads directly
  assert "layers_1" in m.params and "lm_head" not in m.params
  assert np.abs(m.logits(g["tokens"]) - g["logits"]).max() <= 1e-4
  out = tmp_path / "hf"
  assert convert(["maxlm-to-hf", str(tmp_path / "c"), str(out), "--max-shard-size", "20KB"]) == 0
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  assert all(f.stat().st_size < 20_000 + 4096 for f in out.glob("*.safetensors"))  # + header
  want, have = bits(GOLDEN / "llama_tied"), bits(out)
  assert have.keys() == want.keys() and all(np.array_equal(have[k][1], want[k][1]) for k in want)


def _nothing_left(parent: Path, name: str) -> None:
  assert not (parent / name).exists() and not list(parent.glob(f".{name}*"))


@pytest.mark.parametrize("case", ["missing", "attention_bias", "qwen", "truncated", "exists", "shard_size",
                                  "direction"])
def test_bad_input_one_line_exit_code_nothing_written(case, tmp_path, capsys):
  src = tmp_path / "src"
  shutil.copytree(GOLDEN / "llama3", src)
  cfg = json.loads((src / "config.json").read_text())
  argv, code, words = ["hf-to-maxlm", str(src), str(tmp_path / "out")], 2, None
  if case == "missing":
    argv[1], code, words = str(tmp_path / "nope"), 3, "no such file"
  elif case == "attention_bias":
    (src / "config.json").write_text(json.dumps(cfg | {"attention_bias": True}))
    words = "attention_bias: true"
  elif case == "qwen":
    (src / "config.json").write_text(json.dumps(cfg | {"architectures": ["Qwen2ForCausalLM"]}))
    words = "Qwen2ForCausalLM"
  elif case == "truncated":
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    code, words = 3, "model.safetensors: not a valid safetensors file"
  elif case == "exists":
    (tmp_path / "out").mkdir()
    words = "already exists"
  elif case == "shard_size":
    argv = ["maxlm-to-hf", str(src), str(tmp_path / "out"), "--max-shard-size", "lots"]
    words = "--max-shard-size"
  else:
    argv[0], words = "hf-to-orbax", "invalid choice"
  assert convert(argv) == code
  assert words in one_error_line(capsys)
  if case != "exists":
    _nothing_left(tmp_path, "out")


def test_damaged_checkpoint_exits_3(finetuned, tmp_path, capsys):
  run = tmp_path / "run"
  shutil.copytree(finetuned / "ft", run)
  meta = run / "checkpoints" / "1" / "meta" / "metadata"
  data = json.loads(meta.read_text())
  key = ".params['layers']['mlp']['wi_kernel']"
  data["arrays"][key][2] = (data["arrays"][key][2] + 1) % 2**32  # as if one element had changed
  meta.write_text(json.dumps(data))
  assert convert(["maxlm-to-hf", str(run), str(tmp_path / "out")]) == 3
  assert "layers/mlp/wi_kernel differs from its saved checksum" in one_error_line(capsys)
  _nothing_left(tmp_path, "out")


def test_help_and_cli_table(capsys):
  from maxlm.cli import main as cli
  assert cli(["convert", "--help"]) == 0
  assert "hf-to-maxlm" in capsys.readouterr().out
