"""A fuzz of what users type and point at: every config key given junk, and damaged data files.

The rule under test: bad input ends in exactly one line naming the culprit (a key, a file) through the
project's error types, before anything is written; input that is not bad starts normally. A case
"holds" when it ends one of those two ways; anything else (another exception, a multi-line message, a
message naming neither the key nor the value, a file written) is a failure. Counts are printed
(`pytest -s tests/test_fuzz.py`) for the issue notes.
"""

import bz2
import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxlm.checkpoint import CheckpointError
from maxlm.config import Config, ConfigError, load_config
from maxlm.config.schema import leaf_fields
from maxlm.data import DataError, check_inputs, make_train_iterator
from maxlm.layers import PrecisionError
from maxlm.trainer import Trainer

ERRORS = (ConfigError, DataError, PrecisionError, CheckpointError)
JUNK = ["", " ", "abc", "nan", "-inf", "1e400", "-1", "0", "-2", "0.5", "1e30", "99999999999999999999999",
        "true", "[1, 2]", "{a: 1}", "..", "/", "null", "~", "0x10", "'3'", "\u00e9\u4e2d", "1,2", "a\tb"]
# A small model, so that every configuration the fuzz leaves valid can be built quickly.
BASE = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16", "model.ffn_dim=64",
        "model.n_layers=1", "data.seq_len=16", "data.global_batch_size=8", "train.steps=2"]
ROOT = Path(__file__).resolve().parent.parent


def _one_line(msg: str) -> bool:
  return bool(msg) and "\n" not in msg and "\r" not in msg


def _config_case(key: str, junk: str, out: Path) -> str | None:
  """None when the case holds, else what went wrong."""
  args = [*BASE, f"output_dir={out}", f"{key}={junk}"]
  try:
    cfg = load_config(args)
  except ConfigError as e:
    msg = str(e)
    if not _one_line(msg):
      return f"multi-line message {msg!r}"
    if key.split(".")[-1] not in msg and (junk.strip() == "" or junk not in msg):
      return f"message names neither the key nor the value: {msg!r}"
    return None
  except Exception as e:
    return f"{type(e).__name__} from load_config: {e}"
  try:
    trainer = Trainer(cfg)  # everything the run checks before it writes anything
  except ERRORS as e:
    return None if _one_line(str(e)) else f"multi-line message {str(e)!r}"
  except Exception as e:
    return f"{type(e).__name__} from the trainer's checks: {e}"
  trainer.train_data.close()
  return None


def test_every_config_key_given_junk(tmp_path):
  out = tmp_path / "out"
  keys = [k for k, _, _ in leaf_fields(Config) if k != "output_dir"]
  rng = random.Random(0)
  tried, failures = 0, []
  for key in keys:
    for junk in rng.sample(JUNK, 8):  # 8 junk values per key keeps this under a minute
      tried += 1
      why = _config_case(key, junk, out)
      if why:
        failures.append(f"{key}={junk!r}: {why}")
  print(f"\nconfig fuzz: {tried} cases over {len(keys)} keys, {tried - len(failures)} held")
  assert not out.exists() or not any(out.iterdir()), "the checks wrote files"
  assert not failures, "\n".join(failures[:20])


def _texts(rng, n=300):
  words = "the of and to a in that it was her she not be his as for had you with".split()
  return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(n)]


def _valid_files(tmp: Path) -> dict[str, Path]:
  rng = random.Random(1)
  docs = _texts(rng)
  files = {"text": tmp / "a.txt", "jsonl": tmp / "a.jsonl", "parquet": tmp / "a.parquet",
           "text-gz": tmp / "b.txt.gz", "jsonl-bz2": tmp / "b.jsonl.bz2"}
  files["text"].write_text("\n".join(docs) + "\n")
  files["jsonl"].write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  pq.write_table(pa.table({"text": docs}), files["parquet"], row_group_size=50)
  files["text-gz"].write_bytes(gzip.compress(("\n".join(docs) + "\n").encode()))
  files["jsonl-bz2"].write_bytes(bz2.compress("".join(json.dumps({"text": d}) + "\n" for d in docs).encode()))
  shards = tmp / "shards"
  r = subprocess.run([sys.executable, "-m", "maxlm.cli", "prepare", str(files["text"]), f"out={shards}",
                      "shard_tokens=2000"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  files["arrayrecord"] = shards
  return files


def _damage(data: bytes, how: str, rng: random.Random) -> bytes:
  n = len(data)
  if how == "empty":
    return b""
  if how == "truncate":
    return data[:rng.randint(1, n - 1)]
  if how == "flip":
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
      b[rng.randrange(n)] ^= 1 << rng.randrange(8)
    return bytes(b)
  if how == "zero-block":
    start = rng.randrange(n)
    return data[:start] + b"\0" * min(512, n - start) + data[start + 512:]
  if how == "garbage":
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 4096)))
  if how == "bad-utf8":
    at = rng.randrange(n)
    return data[:at] + b"\xff\xfe" + data[at:]
  raise ValueError(how)


DAMAGE = ["empty", "truncate", "truncate", "flip", "flip", "flip", "zero-block", "garbage", "bad-utf8"]


def _data_case(kind: str, path: Path, target: Path, outcomes: list | None = None) -> str | None:
  dtype = {"text": "text", "text-gz": "text", "jsonl": "jsonl", "jsonl-bz2": "jsonl", "parquet": "parquet",
           "arrayrecord": "arrayrecord"}[kind]
  args = [*BASE, f"data.type={dtype}", f"data.paths={path}", "data.eval_fraction=0"]
  cfg = load_config(args)
  try:
    check_inputs(cfg.data, cfg.model.vocab_size)
    it = make_train_iterator(cfg.data, cfg.model.vocab_size)
    try:
      for _ in range(3):
        next(it)
    finally:
      it.close()
  except ERRORS as e:
    msg = str(e)
    if outcomes is not None:
      outcomes.append("rejected")
    if not _one_line(msg):
      return f"multi-line message {msg!r}"
    if target.name not in msg and str(path) not in msg:
      return f"message does not name the damaged file {target.name}: {msg!r}"
    return None
  except Exception as e:
    return f"{type(e).__name__}: {e}"
  if outcomes is not None:
    outcomes.append("accepted")
  return None  # the damage left valid input (e.g. a flipped bit inside a word)


def test_damaged_data_files(tmp_path):
  files = _valid_files(tmp_path)
  rng = random.Random(2)
  tried, failures, outcomes = 0, [], []
  for kind, path in files.items():
    for i, how in enumerate(DAMAGE):
      if kind == "arrayrecord":
        shard = sorted(path.glob("*.array_record"))[1]
        case_dir = tmp_path / f"case-{kind}-{i}"
        case_dir.mkdir()
        for f in path.iterdir():
          (case_dir / f.name).write_bytes(f.read_bytes())
        target = case_dir / shard.name
        target.write_bytes(_damage(shard.read_bytes(), how, rng))
        case_path = case_dir
      else:
        target = case_path = tmp_path / f"case-{i}-{path.name}"
        target.write_bytes(_damage(path.read_bytes(), how, rng))
      tried += 1
      why = _data_case(kind, case_path, target, outcomes)
      if why:
        failures.append(f"{kind} {how}: {why}")
  print(f"\ndata fuzz: {tried} damaged files, {tried - len(failures)} held "
        f"({outcomes.count('rejected')} rejected in one line, {outcomes.count('accepted')} still valid)")
  assert outcomes.count("rejected") >= tried // 2, "most damage must be detected, or the fuzz tests little"
  assert not failures, "\n".join(failures)


@pytest.mark.parametrize("seed", [3])
def test_valid_files_are_accepted(tmp_path, seed):
  """The fuzz's baseline: the undamaged files load and give batches (so a rejection is the damage's)."""
  files = _valid_files(tmp_path)
  for kind, path in files.items():
    assert _data_case(kind, path, path) is None
    cfg = load_config([*BASE, f"data.type={'text' if 'text' in kind else kind.split('-')[0]}",
                       f"data.paths={path}", "data.eval_fraction=0"])
    it = make_train_iterator(cfg.data, cfg.model.vocab_size)
    batch = next(it)
    it.close()
    assert np.asarray(batch["segment_ids"]).max() >= 1
