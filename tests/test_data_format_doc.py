"""docs/data_format.md stays true: its Python snippet reads real shards, its table covers the metadata."""

import re
from pathlib import Path

import numpy as np

from maxlm.data import load_tokenizer
from maxlm.data.prepare import SHARD_PATTERN, WRITER_OPTIONS, prepare
from maxlm.data.shards import token_dtype

DOC = Path(__file__).resolve().parent.parent / "docs" / "data_format.md"


def _snippet(text: str) -> str:
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert len(blocks) == 1, "the page has one python block: the shard reader"
  return blocks[0]


def test_snippet_reads_prepared_shards(tmp_path):
  """The snippet, run as written, gives the tokenizer's ids of the first shard's documents."""
  docs = [f"Document {i}: " + "It is a truth universally acknowledged. " * (i % 7) for i in range(60)]
  (tmp_path / "a.txt").write_text("\n".join(docs) + "\n")
  meta = prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), shard_tokens=300, progress=False)
  assert len(meta["shards"]) > 1
  code = _snippet(DOC.read_text())
  assert len(code.strip().splitlines()) == 6
  scope = {"DIR": str(tmp_path / "out")}
  exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 - the documented snippet itself
  n0 = meta["shards"][0]["documents"]
  tok = load_tokenizer()
  assert len(scope["docs"]) == n0
  for got, doc in zip(scope["docs"], docs[:n0]):
    np.testing.assert_array_equal(got, tok.encode(doc))  # raw ids: no BOS/EOS


def test_documented_fields_and_rules_match_prepare(tmp_path):
  """Every key prepare writes is in the field table, and the stated dtype rule, shard names and writer
  options are the ones the code uses."""
  text = DOC.read_text()
  (tmp_path / "a.txt").write_text("one\ntwo\n")
  meta = prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), progress=False)
  first_column = re.findall(r"^\| ([^|]+) \|", text, re.M)
  table = {name for cell in first_column for name in re.findall(r"`([a-z0-9_.]+)`", cell)}
  keys = set(meta) | {f"tokenizer.{k}" for k in meta["tokenizer"]}
  assert keys <= table, keys - table
  for k in list(meta["shards"][0]) + list(meta["inputs"][0]):
    assert f"`{k}`" in text
  assert token_dtype(65_536) == "uint16" and token_dtype(65_537) == "uint32"
  assert "`uint16` when the tokenizer's vocabulary has at most 65,536 tokens, else `uint32`" in text
  assert f"`{WRITER_OPTIONS}`" in text and SHARD_PATTERN.format(0) in text and SHARD_PATTERN.format(1) in text
