"""Tokenizer loading: SentencePiece (shipped), HF tokenizer.json, tiktoken rank files; bad files."""

import base64
import pickle

import numpy as np
import pytest

from maxlm.config import DataConfig
from maxlm.data import DataError, load_tokenizer, make_train_iterator
from maxlm.data.tokenizer import DEFAULT_TOKENIZER, check_vocab, detect_kind, special_ids

TEXT = "It is a truth universally acknowledged, that the cat sat on the mat."


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([TEXT] * 10, trainer)
  path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
  tok.save(str(path))
  return path


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
  """A tiny Llama 3 style rank file: all 256 bytes, then a few merges."""
  merges = [b"th", b"the", b" t", b" the", b"at", b" c", b" cat"]
  ranks = [bytes([i]) for i in range(256)] + merges
  path = tmp_path_factory.mktemp("tt") / "tokenizer.model"
  path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
  return path


def _roundtrip(tok):
  ids = tok.encode(TEXT)
  assert ids.dtype == np.int32 and len(ids) > 0 and ids.max() < tok.vocab_size
  assert tok.decode(ids) == TEXT
  batch = tok.encode_batch([TEXT, "the cat"], num_threads=2)
  np.testing.assert_array_equal(batch[0], ids)
  np.testing.assert_array_equal(pickle.loads(pickle.dumps(tok)).encode("the cat"), batch[1])


def test_sentencepiece_shipped():
  tok = load_tokenizer()
  assert tok.kind == "sentencepiece" and tok.path == DEFAULT_TOKENIZER
  assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (8192, 1, 2)
  _roundtrip(tok)
  assert load_tokenizer(str(DEFAULT_TOKENIZER), "sentencepiece").vocab_size == 8192


def test_hf_tokenizer_json(hf_json):
  tok = load_tokenizer(hf_json)
  assert tok.kind == "hf" and tok.vocab_size == 300
  assert (tok.bos_id, tok.eos_id) == (0, 1)  # <s>, </s>
  _roundtrip(tok)
  assert 0 not in tok.encode(TEXT)  # specials are added by the pipeline, not the tokenizer
  assert load_tokenizer(hf_json.parent).kind == "hf"  # a directory holding tokenizer.json


def test_tiktoken_rank_file_llama3_layout(tiktoken_file):
  assert detect_kind(tiktoken_file) == "tiktoken"  # despite the .model name
  tok = load_tokenizer(tiktoken_file)
  assert tok.kind == "tiktoken"
  assert tok.vocab_size == 263 + 256
  assert (tok.bos_id, tok.eos_id) == (263, 264)  # <|begin_of_text|>, <|end_of_text|>
  _roundtrip(tok)
  assert 262 in tok.encode(" cat").tolist()  # the " cat" merge applies
  assert tok.encode("<|end_of_text|>").max() < 256  # special-token text stays plain text


@pytest.mark.parametrize("content,kind,match", [
    (b"\x00\x01garbage", "auto", "cannot load tokenizer .* as sentencepiece"),
    (b'{"model": ', "auto", "cannot load tokenizer .* as hf"),
    (b"", "auto", "cannot load tokenizer"),
    (b"not base64! 1\n", "tiktoken", "cannot load tokenizer .* as tiktoken"),
])
def test_wrong_tokenizer_file(tmp_path, content, kind, match):
  bad = tmp_path / "tok.model"
  bad.write_bytes(content)
  with pytest.raises(DataError, match=match) as e:
    load_tokenizer(bad, kind)
  assert "\n" not in str(e.value) and str(bad) in str(e.value)


def test_forced_wrong_kind_and_missing(tmp_path):
  with pytest.raises(DataError, match="as tiktoken"):
    load_tokenizer(DEFAULT_TOKENIZER, "tiktoken")
  with pytest.raises(DataError, match="not found"):
    load_tokenizer(tmp_path / "nope.model")
  with pytest.raises(DataError, match="neither tokenizer.json"):
    load_tokenizer(tmp_path)
  with pytest.raises(DataError, match="offline"):
    load_tokenizer("https://example.com/tokenizer.json")
  with pytest.raises(DataError, match="tokenizer_type"):
    load_tokenizer(DEFAULT_TOKENIZER, "bpe")


def test_special_ids(hf_json):
  tok = load_tokenizer()
  assert special_ids(tok, True, True) == (1, 2)
  assert special_ids(tok, False, True) == (None, 2)
  assert special_ids(tok, True, False, bos_id=5) == (5, None)
  with pytest.raises(DataError, match="outside the tokenizer's vocabulary"):
    special_ids(tok, True, True, eos_id=9000)
  hf = load_tokenizer(hf_json)
  hf.bos_id = -1  # a tokenizer without a BOS token
  with pytest.raises(DataError, match="no BOS token; set data.bos_id"):
    special_ids(hf, True, False)


def test_vocab_too_small_stops_before_training():
  with pytest.raises(DataError, match="8192 tokens but model.vocab_size is 4096"):
    check_vocab(load_tokenizer(), 4096)
  with pytest.raises(DataError, match="model.vocab_size"):
    make_train_iterator(DataConfig(), 4096)
