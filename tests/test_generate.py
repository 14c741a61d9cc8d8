"""`maxlm generate` (maxlm/cli/generate.py over Model.complete): text and JSON output from a run checkpoint, its
tokenizer and stop handling, and one-line errors with exit codes for bad input."""

import json
import os

import jax
import numpy as np
import pytest

from maxlm.cli import generate as gen_cli
from maxlm.data import load_tokenizer
from maxlm.model import Transformer
from tiny_checkpoint import make_checkpoint

PROMPT = "It is a truth universally acknowledged"
SHORT = "Emma"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return make_checkpoint(tmp_path_factory.mktemp("gen"))


def _cli(capsys, *args):
  code = gen_cli.main([str(a) for a in args])
  out, err = capsys.readouterr()
  return code, out, err


def _greedy_reference(cfg, params, ids, n, width=32):
  """Greedy continuation by recomputing the whole sequence with the training model at every step (one
  padded width, so one compilation: causal attention keeps the padding after a token out of its logits)."""
  model = Transformer(cfg.model)
  forward = jax.jit(lambda p, t: model.apply({"params": p}, t))
  seq = list(ids)
  for _ in range(n):
    padded = np.zeros((1, width), np.int32)  # [1, W]
    padded[0, :len(seq)] = seq
    seq.append(int(np.argmax(np.asarray(forward(params, padded))[0, len(seq) - 1])))
  return seq[len(ids):]


def test_json_output_is_the_greedy_continuation(run, capsys):
  """Two prompts (one batch) give one JSON line each: the tokens are the greedy continuation of
  BOS + the prompt's tokens (the run's data.add_bos and shipped tokenizer)."""
  run_dir, cfg, params = run
  code, out, err = _cli(capsys, f"checkpoint={run_dir}", f"prompt={PROMPT}", f"prompt={SHORT}",
                        "max_new_tokens=6", "--json")
  assert code == 0, err
  rows = [json.loads(x) for x in out.strip().splitlines()]
  assert [r["prompt"] for r in rows] == [PROMPT, SHORT]
  tok = load_tokenizer("")  # the run's data.tokenizer is "": the shipped SentencePiece model
  for r, text in zip(rows, (PROMPT, SHORT)):
    ids = [tok.bos_id] + tok.encode(text).tolist()  # data.add_bos is on by default
    assert r["prompt_tokens"] == ids
    assert r["tokens"] == _greedy_reference(cfg, params, ids, 6)
    assert r["finish_reason"] == "length"
    assert r["text"] == tok.decode(ids + r["tokens"])[len(tok.decode(ids)):]
    assert {"load_s", "compile_s", "prefill_s", "decode_s", "tokens_per_s"} <= set(r["timing"])


def test_text_output_stop_string_and_seeds(run, capsys):
  run_dir = run[0]
  args = (f"prompt={PROMPT}", f"prompt={SHORT}", "max_new_tokens=6")
  free = [json.loads(x) for x in _cli(capsys, f"checkpoint={run_dir}/checkpoints", *args, "--json")[1].split("\n")
          if x]
  code, out, err = _cli(capsys, f"checkpoint={run_dir}/checkpoints/0", *args)
  assert code == 0, err
  assert out == PROMPT + free[0]["text"] + "\n" + SHORT + free[1]["text"] + "\n"
  tok = load_tokenizer("")
  stop_id = free[0]["tokens"][2]
  stop = tok.decode([stop_id]).strip()
  assert tok.encode(stop).tolist() == [stop_id], f"pick a token that round-trips through text ({stop!r})"
  code, out, err = _cli(capsys, f"checkpoint={run_dir}", *args, f"stop={stop}", "--json")
  got = json.loads(out.splitlines()[0])
  cut = free[0]["tokens"].index(stop_id)
  assert got["tokens"] == free[0]["tokens"][:cut + 1] and got["finish_reason"] == "stop"
  prompt_text = tok.decode(got["prompt_tokens"])
  assert got["text"] == tok.decode(got["prompt_tokens"] + free[0]["tokens"][:cut])[len(prompt_text):]
  sampled = ("temperature=0.8", "top_k=50", "top_p=0.9", "seed=5", "--json")
  once, again = (_cli(capsys, f"checkpoint={run_dir}", *args, *sampled)[1] for _ in range(2))
  assert [json.loads(x)["tokens"] for x in once.split("\n") if x] == \
      [json.loads(x)["tokens"] for x in again.split("\n") if x]


def test_bad_input_one_line_and_exit_code(run, capsys, tmp_path):
  run_dir = run[0]
  not_ckpt = tmp_path / "empty"
  not_ckpt.mkdir()
  long_prompt = " ".join(["word"] * 80)  # > data.seq_len = 64 tokens
  cases = [
      ([f"checkpoint={tmp_path}/missing", "prompt=a"], 3, "no such file or directory"),
      ([f"checkpoint={not_ckpt}", "prompt=a"], 3, f"checkpoint={not_ckpt}: no checkpoint"),
      ([f"checkpoint={not_ckpt}", "prompt=a"], 3, "a checkpoints directory or a step directory)\n"),  # no runs in it
      ([f"checkpoint={run_dir.parent}", "prompt=a"], 3,  # an output directory: the runs it holds
       f"step directory); it holds run(s) {run_dir.name}: name one, e.g. checkpoint={run_dir}\n"),
      ([f"checkpoint={run_dir}", "prompt=a", "max_new_token=3"], 2, "unknown argument 'max_new_token'"),
      ([f"checkpoint={run_dir}", "prompt=a", "model.n_layer=3"], 2, "unknown config key 'model.n_layer'"),
      ([f"checkpoint={run_dir}", "prompt=a", "temperature=-1"], 2, "temperature must be"),
      ([f"checkpoint={run_dir}", "prompt=a", "top_p=2"], 2, "top_p must be in (0, 1]"),
      ([f"checkpoint={run_dir}", "prompt=a", "max_new_tokens=x"], 2, "max_new_tokens='x' is not an int"),
      ([f"checkpoint={run_dir}"], 2, "prompt=<text> is required"),
      ([f"checkpoint={run_dir}", f"prompt={long_prompt}", "max_new_tokens=4"], 2, "exceeds the model's max length 64"),
      ([f"checkpoint={run_dir}", "prompt=a", "--jsn"], 2, "unknown option --jsn"),
      ([str(run_dir), "prompt=a"], 2, f"argument '{run_dir}' is not key=value (see --help); write checkpoint={run_dir}"),
      ([f"checkpoint={run_dir}", "It is a truth"], 2, "(see --help); write prompt='It is a truth'\n"),
  ]
  before = sorted(os.listdir(tmp_path))
  for args, code, msg in cases:
    got, out, err = _cli(capsys, *args)
    assert got == code, (args, err)
    assert err.count("\n") == 1 and err.startswith("maxlm: error: ") and msg in err, (args, err)
    assert out == ""
  assert sorted(os.listdir(tmp_path)) == before  # nothing created


def test_damaged_checkpoint_exits_3(run, capsys, tmp_path):
  import shutil
  bad = tmp_path / "copy"
  shutil.copytree(run[0], bad)
  arrays = sorted((bad / "checkpoints" / "0" / "params").rglob("*"), key=lambda p: -p.stat().st_size)
  victim = next(p for p in arrays if p.is_file())
  victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  code, out, err = _cli(capsys, f"checkpoint={bad}", "prompt=a", "max_new_tokens=2")
  assert code == 3 and err.count("\n") == 1 and err.startswith("maxlm: error: checkpoint="), err


def test_damaged_checkpoint_is_one_line_until_the_process_exits(run, tmp_path):
  """The same, as a user runs it: a process of its own, whose stderr is read after it exits. Orbax's reads of
  the other arrays outlive the failed one, and their coroutines used to print 12 to 260 lines of tracebacks at
  interpreter exit, after the one-line error (4 runs of 4); two runs here, as that was not every time."""
  import shutil
  import subprocess
  import sys
  bad = tmp_path / "copy"
  shutil.copytree(run[0], bad)
  arrays = sorted((bad / "checkpoints" / "0" / "params").rglob("*"), key=lambda p: -p.stat().st_size)
  victim = next(p for p in arrays if p.is_file())
  victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  for _ in range(2):
    r = subprocess.run([sys.executable, "-m", "maxlm.cli", "generate", f"checkpoint={bad}", "prompt=a",
                        "max_new_tokens=2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 3 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr.startswith("maxlm: error: checkpoint="), r.stderr


def test_help_lists_the_arguments(capsys):
  code, out, _ = _cli(capsys, "--help")
  assert code == 0
  for key in ("checkpoint=", "prompt=", "max_new_tokens=", "temperature=", "top_k=", "top_p=", "seed=",
              "stop=", "--json"):
    assert key in out


def test_hugging_face_directory_with_its_tokenizer(capsys, tmp_path):
  """An HF directory (the Llama 3 golden with a word-level tokenizer.json whose word w<i> is id i): the
  prompt's words are the golden's prompt ids, and the output is transformers' greedy continuation."""
  import shutil

  import numpy as np
  from tokenizers import Tokenizer, models, pre_tokenizers

  golden = os.path.join(os.path.dirname(__file__), "golden", "hf", "llama3")
  hf = tmp_path / "hf"
  shutil.copytree(golden, hf)
  g = np.load(hf / "golden.npz")
  vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 96)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(hf / "tokenizer.json"))
  prompt = [int(t) for t in g["prompts"][2] if t >= 0]
  code, out, err = _cli(capsys, f"checkpoint={hf}", "prompt=" + " ".join(f"w{i}" for i in prompt),
                        f"max_new_tokens={int(g['max_new_tokens'])}", "add_bos=false", "model.backend=flax",
                        "model.dtype=float32", "--json")
  assert code == 0, err
  got = json.loads(out)
  assert got["prompt_tokens"] == prompt
  assert got["tokens"] == g["generated"][2].tolist()
  assert got["text"] == "".join(f" w{i}" for i in got["tokens"])
