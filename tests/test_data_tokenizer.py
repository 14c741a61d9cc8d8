"""Tokenizer loading: SentencePiece (shipped), HF tokenizer.json, tiktoken rank files; bad files."""

import base64
import pickle

import numpy as np
import pytest

from maxlm.config import DataConfig
from maxlm.data import DataError, load_tokenizer, make_train_iterator
from maxlm.data.tokenizer import DEFAULT_TOKENIZER, SMALL_TOKENIZER, check_vocab, detect_kind, special_ids

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


def test_shipped_small_tokenizer_by_bare_name(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # no such file here: the bare name is the shipped asset
  tok = load_tokenizer("austen_sp512.model")
  assert tok.kind == "sentencepiece" and tok.path == SMALL_TOKENIZER
  assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (512, 1, 2)
  _roundtrip(tok)
  (tmp_path / "austen_sp512.model").write_bytes(DEFAULT_TOKENIZER.read_bytes())  # a file here comes first
  assert load_tokenizer("austen_sp512.model").vocab_size == 8192
  with pytest.raises(DataError, match="'nosuch.model' not found"):  # not shipped either: named as given
    load_tokenizer("nosuch.model")


def test_hf_tokenizer_json(hf_json):
  tok = load_tokenizer(hf_json)
  assert tok.kind == "hf" and tok.vocab_size == 300
  assert (tok.bos_id, tok.eos_id) == (0, 1)  # <s>, </s>
  _roundtrip(tok)
  assert 0 not in tok.encode(TEXT)  # specials are added by the pipeline, not the tokenizer
  assert load_tokenizer(hf_json.parent).kind == "hf"  # a directory holding tokenizer.json


def test_tiktoken_rank_file_small(tiktoken_file):
  assert detect_kind(tiktoken_file) == "tiktoken"  # despite the .model name
  tok = load_tokenizer(tiktoken_file)
  assert tok.kind == "tiktoken"
  assert tok.vocab_size == 263 + 2  # only BOS and EOS follow a rank file that is not Llama 3's
  assert (tok.bos_id, tok.eos_id) == (263, 264)  # <|begin_of_text|>, <|end_of_text|>
  _roundtrip(tok)
  assert 262 in tok.encode(" cat").tolist()  # the " cat" merge applies
  assert tok.encode("<|end_of_text|>").max() < 256  # special-token text stays plain text


def _rank_file(path, n):
  """A rank file of n ranks: the 256 bytes, then distinct 2- and 3-byte tokens."""
  extra = [bytes([a, b]) for a in range(97, 123) for b in range(256)]
  extra += [bytes([a, b, c]) for a in range(97, 123) for b in range(97, 123) for c in range(256)]
  ranks = [bytes([i]) for i in range(256)] + extra[:n - 256]
  assert len(set(ranks)) == n
  path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
  return path


def test_tiktoken_8190_ranks_fit_the_default_model(tmp_path):
  """8190 ranks + BOS + EOS = 8192 tokens: trains with the default model.vocab_size (8192)."""
  tok = load_tokenizer(_rank_file(tmp_path / "ranks.tiktoken", 8190), "tiktoken")
  assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (8192, 8190, 8191)
  (tmp_path / "a.txt").write_text("the cat sat\non the mat\n")
  cfg = DataConfig(type="text", paths=str(tmp_path / "a.txt"), tokenizer=str(tmp_path / "ranks.tiktoken"),
                   eval_fraction=0, seq_len=16, global_batch_size=2)
  b = next(make_train_iterator(cfg, 8192))
  assert b["inputs"][0, 0] == 8190 and 8191 in b["targets"]  # BOS first; EOS ends each document


def test_tiktoken_llama3_sized_rank_file_gets_llama3_specials(tmp_path):
  """128,000 ranks: Llama 3's 256 specials at their Llama 3 ids (vocabulary 128,256)."""
  tok = load_tokenizer(_rank_file(tmp_path / "tokenizer.model", 128_000))
  assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (128_256, 128_000, 128_001)
  enc = tok._enc  # the chat-template tokens Llama 3 checkpoints were trained with
  for name, i in (("<|start_header_id|>", 128_006), ("<|end_header_id|>", 128_007), ("<|eot_id|>", 128_009)):
    assert enc.encode(name, allowed_special="all") == [i]
  assert len(enc.special_tokens_set) == 256


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


@pytest.mark.parametrize("tokens,need,suggest", [(300, 300, 384), (8192, 8192, 8192), (8446, 8446, 8448),
                                                 (128_256, 128_256, 128_256), (129, 129, 256)])
def test_vocab_message_names_the_size_to_set(tokens, need, suggest):
  """The message gives the exact model.vocab_size to set: rounded up to a multiple of 128 (values worked
  out by hand above), and the minimum."""
  tok = load_tokenizer()
  tok.vocab_size = tokens
  with pytest.raises(DataError) as e:
    check_vocab(tok, 128)
  msg = str(e.value)
  assert f"set model.vocab_size={suggest} " in msg and f"at least {need}" in msg


def test_hf_sparse_ids_size_the_vocabulary(tmp_path):
  """A WordLevel vocabulary with gaps: the size is the largest id + 1, not the number of entries."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  t = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 70_000, "world": 69_999}, unk_token="[UNK]"))
  t.pre_tokenizer = pre_tokenizers.Whitespace()
  t.save(str(tmp_path / "tokenizer.json"))
  tok = load_tokenizer(tmp_path / "tokenizer.json")
  assert tok.vocab_size == 70_001
  np.testing.assert_array_equal(tok.encode("hello world"), [70_000, 69_999])
