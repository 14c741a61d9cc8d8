"""`maxlm convert` (maxlm/cli/convert.py, maxlm/hf/convert.py): HF golden -> Orbax tree -> fine-tuning run (checkpoint.load_params)
-> HF again, checked against transformers' logits and the original bits; lossless defaults (a float32
run exports float32, an HF tree its source's dtype); one-line errors and exit codes with nothing left on
disk."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from maxlm import Model
from maxlm.cli.convert import main as convert
from maxlm.cli.train import main as train_main
from maxlm.config import load_config
from maxlm.hf.config import from_hf

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
  assert convert(["hf-to-maxlm", f"src={GOLDEN / 'llama3'}", f"out={tmp / 'conv'}"]) == 0
  args = [f"config={tmp / 'conv' / 'model.yml'}", f"checkpoint.load_params={tmp / 'conv'}", "train.steps=1",
          "optim.learning_rate=0", "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=8",
          "model.backend=flax", "checkpoint.enabled=true", "train.eval_every=0", f"output_dir={tmp}",
          "run_name=ft"]
  assert train_main(args) == 0
  return tmp


def test_fine_tunes_of_converted_models_get_their_own_run_names(finetuned):
  """model.yml names the run after the converted directory: two converted models fine-tuned with their
  printed commands do not share runs/model (a resume of the other's run, or a refusal)."""
  cfg = load_config([f"config={finetuned / 'conv' / 'model.yml'}"])
  assert cfg.run_name == "conv-finetune"


def test_an_hf_directory_as_load_params_says_to_convert_it(finetuned, tmp_path, capsys):
  args = [f"config={finetuned / 'conv' / 'model.yml'}", f"checkpoint.load_params={GOLDEN / 'llama3'}",
          "train.steps=1", "data.type=synthetic", "data.seq_len=16", "data.global_batch_size=8",
          "model.backend=flax", f"output_dir={tmp_path}", "run_name=hf"]
  capsys.readouterr()
  assert train_main(args) == 3
  line = one_error_line(capsys)
  assert line.endswith(f"; it is a Hugging Face model: convert it first, `maxlm convert hf-to-maxlm "
                       f"src={GOLDEN / 'llama3'} out=DIR`, then train with config=DIR/model.yml "
                       f"checkpoint.load_params=DIR"), line
  assert not (tmp_path / "hf").exists()


def test_converted_weights_fine_tune_and_match_transformers(finetuned, capsys):
  g = np.load(GOLDEN / "llama3" / "golden.npz")
  logits = Model.from_pretrained(finetuned / "ft", backend="flax").logits(g["tokens"])
  assert np.abs(logits - g["logits"]).max() <= 1e-4  # test_hf's bound: the weights arrived unchanged
  out = finetuned / "hf"
  # the run's weights are fp32 master weights (the default would write float32): bf16 when asked
  assert convert(["maxlm-to-hf", f"src={finetuned / 'ft'}", f"out={out}", "dtype=bfloat16"]) == 0
  assert "maxlm: wrote" in capsys.readouterr().out
  want, have = bits(GOLDEN / "llama3"), bits(out)
  assert have.keys() == want.keys()
  for k in want:  # bf16 -> fp32 master weights -> bf16: bit for bit
    assert have[k][0] == want[k][0] == "bfloat16" and np.array_equal(have[k][1], want[k][1]), k
  original = json.loads((GOLDEN / "llama3" / "config.json").read_text())
  assert from_hf(json.loads((out / "config.json").read_text())) == from_hf(original)


def _kib(n_bytes: int) -> str:
  return f"{n_bytes / 1024:.1f} KiB"  # the size line's unit for these tiny models, formatted by hand


def _fp32_hf(directory: Path) -> None:
  """A float32 HF checkpoint (safetensors' own writer): the llama3 golden's config and shapes, random
  values bf16 cannot hold."""
  directory.mkdir()
  rng = np.random.default_rng(5)
  with safe_open(str(GOLDEN / "llama3" / "model.safetensors"), framework="flax") as st:
    shapes = {k: st.get_slice(k).get_shape() for k in st.keys()}
  save_file({k: (0.1 * rng.standard_normal(v)).astype(np.float32) for k, v in shapes.items()},
            str(directory / "model.safetensors"))
  cfg = json.loads((GOLDEN / "llama3" / "config.json").read_text()) | {"dtype": "float32"}
  (directory / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("source", ["bfloat16", "float32"])
def test_hf_round_trip_keeps_the_source_dtype_and_prints_human_sizes(source, tmp_path, capsys):
  """HF -> maxlm (float32 tree) -> HF with default dtypes gives the original bits back; an existing
  empty output directory is fine; the size line is human (it said "0.00 GiB")."""
  src = GOLDEN / "llama3"
  if source == "float32":
    src = tmp_path / "fp32"
    _fp32_hf(src)
  want = bits(src)
  n = sum(x.size for _, x in want.values())
  (tmp_path / "conv").mkdir()
  assert convert(["hf-to-maxlm", f"src={src}", f"out={tmp_path / 'conv'}"]) == 0
  assert f"{_kib(4 * n)} in float32" in capsys.readouterr().out
  assert convert(["maxlm-to-hf", f"src={tmp_path / 'conv'}", f"out={tmp_path / 'hf'}"]) == 0
  assert f"{_kib({'float32': 4, 'bfloat16': 2}[source] * n)} in {source}" in capsys.readouterr().out
  have = bits(tmp_path / "hf")
  assert have.keys() == want.keys()
  for k in want:
    assert have[k][0] == want[k][0] == source and np.array_equal(have[k][1], want[k][1]), k


def test_float32_run_exports_its_exact_weights_by_default(finetuned, tmp_path, capsys):
  """maxlm-to-hf of a float32 run (model.param_dtype float32) is lossless: every HF tensor is float32
  and holds the run's parameter bits (restored with plain Orbax, laid out by the documented formulas of
  test_hf's weight-table test). test_hf_round_trip's float32 case streams values bf16 cannot hold through
  the same export. Equal weights give equal logits, so the greedy text of the README's run round trip
  no longer changes."""
  run = finetuned / "ft"
  assert convert(["maxlm-to-hf", f"src={run}", f"out={tmp_path / 'hf'}"]) == 0
  # the run trained on synthetic tokens: no tokenizer file, and the line says so
  assert not list((tmp_path / "hf").glob("tokenizer*"))
  assert "; no tokenizer file (synthetic tokens, " in capsys.readouterr().out
  p = jax.tree_util.tree_map(np.asarray, ocp.StandardCheckpointer().restore(run / "checkpoints" / "1" / "params"))
  d, kv, g, dh = 32, 2, 2, 8  # the llama3 golden's d_model, KV heads, queries per KV head, head_dim
  want = {"model.embed_tokens.weight": p["embed"]["embedding"], "model.norm.weight": p["lm_head"]["scale"],
          "lm_head.weight": p["lm_head"]["kernel"].T}
  lay = p["layers"]
  for i in range(2):
    qkv = lay["qkv"]["kernel"][i]  # [D, KV, G+2, Dh]
    pre = f"model.layers.{i}."
    want |= {pre + "input_layernorm.weight": lay["qkv"]["scale"][i],
             pre + "post_attention_layernorm.weight": lay["mlp"]["scale"][i],
             pre + "self_attn.q_proj.weight": qkv[:, :, :g].reshape(d, kv * g * dh).T,
             pre + "self_attn.k_proj.weight": qkv[:, :, g].reshape(d, kv * dh).T,
             pre + "self_attn.v_proj.weight": qkv[:, :, g + 1].reshape(d, kv * dh).T,
             pre + "self_attn.o_proj.weight": lay["out"]["kernel"][i].reshape(kv * g * dh, d).T,
             pre + "mlp.gate_proj.weight": lay["mlp"]["wi_kernel"][i][:, 0].T,
             pre + "mlp.up_proj.weight": lay["mlp"]["wi_kernel"][i][:, 1].T,
             pre + "mlp.down_proj.weight": lay["mlp"]["wo_kernel"][i].T}
  have = bits(tmp_path / "hf")
  assert have.keys() == want.keys()
  for k, x in want.items():
    assert x.dtype == np.float32 and have[k][0] == "float32", k
    assert np.array_equal(have[k][1], np.ascontiguousarray(x).view(np.uint32)), k
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float32"


def test_orbax_tree_restores_with_plain_orbax(tmp_path):
  """The tree written tensor by tensor is a normal Orbax tree: bf16 here, holding the HF bits exactly."""
  assert convert(["hf-to-maxlm", f"src={GOLDEN / 'mistral'}", f"out={tmp_path / 'c'}", "dtype=bfloat16"]) == 0
  params = ocp.StandardCheckpointer().restore(tmp_path / "c" / "params")
  assert str(params["layers"]["qkv"]["kernel"].dtype) == "bfloat16"
  assert params["layers"]["qkv"]["kernel"].shape == (2, 32, 1, 6, 8)  # [L, D, KV, G+2, Dh]
  hf = bits(GOLDEN / "mistral")
  emb = np.asarray(params["embed"]["embedding"]).view(np.uint16)
  assert np.array_equal(emb, hf["model.embed_tokens.weight"][1])
  down = np.asarray(params["layers"]["mlp"]["wo_kernel"][1]).view(np.uint16)  # [F, D] of layer 1
  assert np.array_equal(down, hf["model.layers.1.mlp.down_proj.weight"][1].T)


def test_unrolled_tree_and_sharded_export(tmp_path):
  assert convert(["hf-to-maxlm", f"src={GOLDEN / 'llama_tied'}", f"out={tmp_path / 'c'}", "--unrolled"]) == 0
  g = np.load(GOLDEN / "llama_tied" / "golden.npz")
  m = Model.from_pretrained(tmp_path / "c", backend="flax")  # the converted directory loads directly
  assert "layers_1" in m.params and "lm_head" not in m.params
  assert np.abs(m.logits(g["tokens"]) - g["logits"]).max() <= 1e-4
  out = tmp_path / "hf"
  assert convert(["maxlm-to-hf", f"src={tmp_path / 'c'}", f"out={out}", "max_shard_size=20KB"]) == 0
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  assert all(f.stat().st_size < 20_000 + 4096 for f in out.glob("*.safetensors"))  # + header
  want, have = bits(GOLDEN / "llama_tied"), bits(out)
  assert have.keys() == want.keys() and all(np.array_equal(have[k][1], want[k][1]) for k in want)


def _nothing_left(parent: Path, name: str) -> None:
  assert not (parent / name).exists() and not list(parent.glob(f".{name}*"))


@pytest.mark.parametrize("case", ["missing", "attention_bias", "qwen", "truncated", "not_empty", "shard_size",
                                  "direction", "truncated_into_empty", "positional", "old_option",
                                  "wrong_direction", "no_direction"])
def test_bad_input_one_line_exit_code_nothing_written(case, tmp_path, capsys):
  src = tmp_path / "src"
  shutil.copytree(GOLDEN / "llama3", src)
  cfg = json.loads((src / "config.json").read_text())
  argv, code, words = ["hf-to-maxlm", f"src={src}", f"out={tmp_path / 'out'}"], 2, None
  if case == "missing":
    argv[1], code, words = f"src={tmp_path / 'nope'}", 3, "no such file"
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
  elif case == "not_empty":
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    words = f"output directory {tmp_path / 'out'} already exists and is not empty"
  elif case == "truncated_into_empty":  # an existing empty output directory is fine, and stays empty
    (tmp_path / "out").mkdir()
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    code, words = 3, "not a valid safetensors file"
  elif case == "shard_size":
    argv = ["maxlm-to-hf", f"src={src}", f"out={tmp_path / 'out'}", "max_shard_size=lots"]
    words = "max_shard_size: expected a size"
  elif case == "positional":  # the spelling before the one grammar
    argv, words = ["hf-to-maxlm", str(src), str(tmp_path / "out")], f"argument '{src}' is not key=value"
  elif case == "old_option":
    argv, words = argv + ["--dtype", "bfloat16"], "--dtype is now dtype=VALUE"
  elif case == "wrong_direction":  # an HF model given to the export
    argv[0] = "maxlm-to-hf"
    words = (f"convert maxlm-to-hf: src={src} is a Hugging Face model, not a maxlm run or checkpoint; the other "
             f"direction: maxlm convert hf-to-maxlm src={src} out={tmp_path / 'out'}")
  elif case == "no_direction":
    argv = argv[1:]
    words = (f"unknown subcommand 'src={src}' (subcommands: hf-to-maxlm, maxlm-to-hf; see maxlm convert --help); "
             f"src is a Hugging Face model: maxlm convert hf-to-maxlm src={src} out={tmp_path / 'out'}")
  else:
    argv[0], words = "hf-to-orbax", "unknown subcommand 'hf-to-orbax'"
  assert convert(argv) == code
  assert words in one_error_line(capsys)
  if case == "not_empty":
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]
  elif case == "truncated_into_empty":
    assert list((tmp_path / "out").iterdir()) == []
  else:
    _nothing_left(tmp_path, "out")


def test_a_maxlm_run_given_to_the_import_names_the_export(finetuned, tmp_path, capsys):
  run = finetuned / "ft"
  assert convert(["hf-to-maxlm", f"src={run}", f"out={tmp_path / 'out'}"]) == 2
  assert one_error_line(capsys).endswith(
      f"src={run} is a maxlm run or checkpoint, not a Hugging Face model; the other direction: maxlm convert "
      f"maxlm-to-hf src={run} out={tmp_path / 'out'}")
  _nothing_left(tmp_path, "out")


def test_unreadable_hf_source_record_exits_3(tmp_path, capsys):
  assert convert(["hf-to-maxlm", f"src={GOLDEN / 'llama_tied'}", f"out={tmp_path / 'c'}"]) == 0
  (tmp_path / "c" / "hf_source.json").write_text('{"dtype": "int4"}')
  assert convert(["maxlm-to-hf", f"src={tmp_path / 'c'}", f"out={tmp_path / 'out'}"]) == 3
  assert "hf_source.json: unknown dtype 'int4'" in one_error_line(capsys)
  _nothing_left(tmp_path, "out")


def test_damaged_checkpoint_exits_3(finetuned, tmp_path, capsys):
  run = tmp_path / "run"
  shutil.copytree(finetuned / "ft", run)
  meta = run / "checkpoints" / "1" / "meta" / "metadata"
  data = json.loads(meta.read_text())
  key = ".params['layers']['mlp']['wi_kernel']"
  data["arrays"][key][2] = (data["arrays"][key][2] + 1) % 2**32  # as if one element had changed
  meta.write_text(json.dumps(data))
  assert convert(["maxlm-to-hf", f"src={run}", f"out={tmp_path / 'out'}"]) == 3
  assert "layers/mlp/wi_kernel differs from its saved checksum" in one_error_line(capsys)
  _nothing_left(tmp_path, "out")


def test_help_and_cli_table(capsys):
  from maxlm.cli import main as cli
  assert cli(["convert", "--help"]) == 0
  assert "hf-to-maxlm" in capsys.readouterr().out
