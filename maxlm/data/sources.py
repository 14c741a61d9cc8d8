"""From `DataConfig` to Grain MapDatasets of token arrays: sources, held-out split, epoch orders.

A *component* is one source of documents (the embedded corpus, a set of text/JSONL/Parquet files
read into memory, or prepared ArrayRecord shards read lazily); `data.type=mixture` has several.
The held-out split is by document index (every k-th document, k = round(1/eval_fraction)), so it
does not depend on the number of hosts; training streams (streams.py) divide the rest. With
`data.eval_paths` set there is no split: eval reads those files and training every document.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from pathlib import Path

import grain
import numpy as np

from maxlm.config import DataConfig
from maxlm.data.errors import DataError, Skips
from maxlm.data.readers import file_format, read_documents, resolve_files, split_list
from maxlm.data.shards import ShardSource, load_meta, read_meta
from maxlm.data.tokenizer import ASSETS, Tokenizer, check_vocab, load_tokenizer, special_ids, vocab_hint

EMBEDDED_CORPUS = ASSETS / "austen.txt.xz"  # one paragraph per line; built by scripts/build_assets.py
DOCS_PER_READ = 64  # documents read and tokenized per call
TYPES = ("auto", "embedded", "synthetic", "text", "jsonl", "parquet", "arrayrecord", "mixture")
_FILE_TYPES = "text|jsonl|parquet|arrayrecord|mixture"


def resolve_type(cfg: DataConfig) -> DataConfig:
  """`cfg` with `data.type=auto` made concrete: the embedded corpus without data.paths, else the format the
  file names give (one format: that type; several entries of different formats, or data.weights: a mixture).
  A type that reads no files (embedded, synthetic) with data.paths set is refused: the paths would be
  ignored."""
  entries = split_list(cfg.paths)
  if cfg.type in ("embedded", "synthetic") and entries:
    raise DataError(f"data.paths is set, but data.type={cfg.type} does not read files (it would train on "
                    f"{'the shipped corpus' if cfg.type == 'embedded' else 'random tokens'}); leave data.type "
                    f"out (auto: the format from the file names) or set data.type={_FILE_TYPES}")
  if cfg.type != "auto":
    return cfg
  if not entries:
    return dataclasses.replace(cfg, type="embedded")
  formats = []
  for entry in entries:
    found = {_named_format(f) for e in split_list(entry) for f in resolve_files(e)}
    if "" in found:
      unnamed = next(f for e in split_list(entry) for f in resolve_files(e) if not _named_format(f))
      raise DataError(f"data.type=auto cannot tell the format of '{unnamed}' from its name; set "
                      f"data.type=text (or jsonl, parquet)")
    formats.append(found)
  flat = set().union(*formats)
  if cfg.weights or (len(entries) > 1 and len(flat) > 1):
    if any(len(f) > 1 for f in formats):
      raise DataError(f"data.paths mixes formats ({', '.join(sorted(flat))}) inside one entry; give one "
                      f"entry per format (data.type=auto then makes a mixture)")
    return dataclasses.replace(cfg, type="mixture")
  if len(flat) > 1:
    raise DataError(f"data.paths mixes formats ({', '.join(sorted(flat))}); give one entry per format "
                    f"(comma-separated) to mix them, or set data.type")
  return dataclasses.replace(cfg, type=flat.pop())


def eval_every(fraction: float) -> int:
  """k such that documents i with i % k == 0 are held out (0: none)."""
  if not 0 <= fraction <= 0.5:
    raise DataError(f"config key 'data.eval_fraction' must be in [0, 0.5], got {fraction}")
  return round(1 / fraction) if fraction > 0 else 0


def split_every(cfg: DataConfig) -> int:
  """The held-out split's k for `cfg`: 0 (none) when data.eval_paths names separate eval files."""
  k = eval_every(cfg.eval_fraction)  # validated either way
  return 0 if cfg.eval_paths else k


class DocIndex:
  """Random-access view: the train or eval part of `source`."""

  def __init__(self, source, k: int, part: str):
    n = len(source)
    n_eval = -(-n // k) if k else 0
    self.source, self.k, self.part = source, k, part
    self.length = {"train": n - n_eval, "eval": n_eval, "all": n}[part]

  def __len__(self) -> int:
    return self.length

  def index(self, m: int) -> int:
    """Position m in this view -> index in the source."""
    if not 0 <= m < self.length:
      raise IndexError(m)
    j = m
    if self.part == "eval":
      return j * self.k
    if self.part == "train" and self.k:
      return j + j // (self.k - 1) + 1  # skip every k-th document (i % k == 0)
    return j

  def __getitem__(self, m: int):
    return self.source[self.index(m)]


@dataclasses.dataclass
class Component:
  name: str
  fmt: str  # text | jsonl | parquet | arrayrecord
  source: object  # random access: a list of str, or a ShardSource of token bytes
  meta: dict | None = None  # prepared shards' maxlm_data.json
  files: int = 1  # how many files `name` (a file, glob, directory or list) names

  @property
  def label(self) -> str:
    """The name for a run's data line: a glob, directory or list with the count of files it matched."""
    single = self.files == 1 and not any(c in self.name for c in "*?[,") and not Path(self.name).is_dir()
    return self.name if single else f"{self.name} ({self.files} file{'s' if self.files != 1 else ''})"


@functools.lru_cache(maxsize=8)
def _read_texts(files: tuple[tuple[str, float], ...], fmt: str, field: str, text_split: str,
                skip_bad: bool) -> tuple[list[str], Skips]:
  skips = Skips(skip_bad)
  docs = [d for f, _ in files for d in read_documents(Path(f), fmt, skips, field=field,
                                                       text_split=text_split)]
  return docs, skips


def _named_format(path: Path) -> str:
  try:
    return file_format(path)
  except DataError:
    return ""  # any name goes for text


def load_component(entry: str, fmt: str, cfg: DataConfig, skips: Skips) -> Component:
  """One source: the files of a comma-separated `entry` list, read as `fmt` ('' = by extension)."""
  files = [f for e in split_list(entry) for f in resolve_files(e)]
  if not files:
    raise DataError("config key 'data.paths' is empty; give files, globs or directories")
  fmt = fmt or file_format(files[0])
  for f in files:
    named = _named_format(f)
    if named not in ("", fmt):
      raise DataError(f"'{f}' looks like {named} but is read as {fmt}; set data.type={named} "
                      f"(or data.type=mixture to combine formats)")
  if fmt == "arrayrecord":
    if any(_named_format(f) != "arrayrecord" for f in files):
      raise DataError(f"'{entry}' mixes ArrayRecord shards (.array_record) with other files")
    meta, expected = load_meta(files)
    source = ShardSource(files, meta["dtype"], meta["tokenizer"]["vocab_size"], expected)
    return Component(entry, fmt, source, meta, files=len(files))
  split = cfg.text_split if cfg.type != "embedded" else "line"
  stamp = tuple((str(f), f.stat().st_mtime) for f in files)
  docs, file_skips = _read_texts(stamp, fmt, cfg.field, split, cfg.skip_bad_records)
  skips.merge(file_skips)
  return Component(entry, fmt, docs, files=len(files))


def load_components(cfg: DataConfig, part: str) -> tuple[list[Component], list[float], Skips]:
  """The training (part='train') or eval (part='eval') sources and their mixture weights."""
  if cfg.type not in TYPES:
    raise DataError(f"config key 'data.type' must be one of {', '.join(TYPES)}; got {cfg.type!r}")
  cfg = resolve_type(cfg)
  skips = Skips(cfg.skip_bad_records)
  if part == "eval" and cfg.eval_paths:
    try:
      return _eval_components(cfg, skips)
    except DataError as e:
      raise DataError(f"data.eval_paths: {e}") from None
  if cfg.type == "embedded":
    entries, fmt = [str(EMBEDDED_CORPUS)], "text"
  elif cfg.type == "mixture":
    entries, fmt = split_list(cfg.paths), ""
  else:
    entries, fmt = [cfg.paths], cfg.type
  if not any(split_list(e) for e in entries):
    raise DataError(f"data.type={cfg.type} needs data.paths (comma-separated files, globs or directories)")
  comps = [load_component(e, fmt, cfg, skips) for e in entries]
  weights = [1.0] * len(comps)
  if cfg.type == "mixture" and part == "train" and cfg.weights:
    try:
      weights = [float(w) for w in split_list(cfg.weights)]
    except ValueError:
      raise DataError(f"config key 'data.weights' must be comma-separated numbers, "
                      f"got {cfg.weights!r}") from None
    if len(weights) != len(comps) or min(weights) <= 0:
      raise DataError(f"data.weights needs {len(comps)} positive numbers (one per data.paths entry), "
                      f"got {cfg.weights!r}")
  return comps, weights, skips


def _eval_components(cfg: DataConfig, skips: Skips) -> tuple[list[Component], list[float], Skips]:
  """data.eval_paths: one source per entry for a mixture, else one; each file's format is the one
  its name gives (so prepared shards serve any data.type), else data.type's."""
  if cfg.type == "mixture":
    comps = [load_component(e, "", cfg, skips) for e in split_list(cfg.eval_paths)]
  else:
    named = {_named_format(f) for e in split_list(cfg.eval_paths) for f in resolve_files(e)} - {""}
    fmt = named.pop() if len(named) == 1 else {"embedded": "text"}.get(cfg.type, cfg.type)
    comps = [load_component(cfg.eval_paths, fmt, cfg, skips)]
  return comps, [1.0] * len(comps), skips


def train_shards_tokenizer(cfg: DataConfig) -> dict | None:
  """The tokenizer record (`maxlm_data.json`'s) of training's shards when training reads only shards;
  None when it tokenizes raw text (with data.tokenizer). Reads metadata only."""
  cfg = resolve_type(cfg)
  entries = split_list(cfg.paths) if cfg.type == "mixture" else [cfg.paths]
  if cfg.type not in ("arrayrecord", "mixture") or not any(split_list(e) for e in entries):
    return None
  files = [f for e in entries for p in split_list(e) for f in resolve_files(p)]
  if any(_named_format(f) != "arrayrecord" for f in files):
    return None
  return read_meta(files[0].parent)["tokenizer"]


@dataclasses.dataclass(frozen=True)
class Vocab:
  """What every component's tokens must agree on."""

  tokenizer: Tokenizer | None
  bos: int | None
  eos: int | None
  desc: str
  sha256: str  # of the tokenizer file (loaded, or as the shards record it)


def resolve_vocab(cfg: DataConfig, comps: list[Component], vocab_size: int, part: str = "train") -> Vocab:
  """Load the tokenizer (or trust the shards' record of it) and check it fits `vocab_size`.

  Shards must have been made with the tokenizer in use: data.tokenizer when set or when raw text
  is tokenized (for part='eval': by training), else the one all (training) shards record.
  """
  metas = [c.meta for c in comps if c.meta is not None]
  for c in comps:  # shards record their vocabulary: check it before anything is read
    n = c.meta["tokenizer"]["vocab_size"] if c.meta is not None else 0
    if n > vocab_size:
      raise DataError(f"shards '{c.name}' use a {n}-token tokenizer ({c.meta['tokenizer'].get('path')}) "
                      f"but model.vocab_size is {vocab_size}; {vocab_hint(n)}")
  trained = train_shards_tokenizer(cfg) if part == "eval" else None  # None: training reads raw text
  tok = None
  if cfg.tokenizer or len(metas) < len(comps) or (part == "eval" and trained is None):
    tok = load_tokenizer(cfg.tokenizer, cfg.tokenizer_type)
    check_vocab(tok, vocab_size)
  if tok is not None and trained is not None and trained["sha256"] != tok.sha256:
    raise DataError(f"the training shards were tokenized with {trained.get('path')}, not with {tok.path} "
                    f"(data.tokenizer), which would tokenize data.eval_paths; point data.tokenizer there")
  for c in comps:
    m = c.meta["tokenizer"] if c.meta is not None else None
    if m is not None and trained is not None and m["sha256"] != trained["sha256"]:
      raise DataError(f"shards '{c.name}' were tokenized with {m.get('path')} but the training shards "
                      f"with {trained.get('path')}; prepare both with the same tokenizer=")
    if m is not None and tok is not None and m["sha256"] != tok.sha256:
      raise DataError(f"shards '{c.name}' were tokenized with {m.get('path')}, not with {tok.path} "
                      f"(data.tokenizer); re-prepare them or point data.tokenizer there")
    if m is not None and m["sha256"] != metas[0]["tokenizer"]["sha256"]:
      raise DataError(f"shards '{c.name}' and '{comps[0].name}' were tokenized with different tokenizers "
                      f"({m.get('path')}, {metas[0]['tokenizer'].get('path')}); re-prepare one of them")
  if tok is not None:
    bos, eos = special_ids(tok, cfg.add_bos, cfg.add_eos, cfg.bos_id, cfg.eos_id)
    return Vocab(tok, bos, eos, repr(tok), tok.sha256)
  m = metas[0]["tokenizer"]
  n = int(m["vocab_size"])
  shadow = Tokenizer(Path(str(m.get("path", "?"))))
  shadow.vocab_size, shadow.bos_id, shadow.eos_id = n, int(m.get("bos_id", -1)), int(m.get("eos_id", -1))
  bos, eos = special_ids(shadow, cfg.add_bos, cfg.add_eos, cfg.bos_id, cfg.eos_id)
  return Vocab(None, bos, eos, f"{m.get('kind', '?')} tokenizer {m.get('path')} (from the shards, vocab {n})",
               m["sha256"])


class ReadDocs(grain.transforms.Map):
  """A block of positions in `view` -> their documents as int32 ids with BOS/EOS as configured.

  Blocks make ArrayRecord reads and tokenization batched calls (one Python call per block).
  """

  def __init__(self, comp: Component, view: DocIndex, vocab: Vocab):
    self.view, self.fmt = view, comp.fmt
    self.tok, self.bos, self.eos = vocab.tokenizer, vocab.bos, vocab.eos

  def map(self, positions: np.ndarray) -> list[np.ndarray]:
    idx = [self.view.index(int(m)) for m in positions]
    src = self.view.source
    if self.fmt == "arrayrecord":  # each record checked: whole ids < vocab (else names shard + record)
      return [_wrap(ids, self.bos, self.eos) for ids in src.tokens(idx)]
    return [_wrap(ids, self.bos, self.eos) for ids in self.tok.encode_batch([src[i] for i in idx])]


def _wrap(ids: np.ndarray, bos: int | None, eos: int | None) -> np.ndarray:
  out = np.empty(len(ids) + (bos is not None) + (eos is not None), np.int32)  # [n]
  out[int(bos is not None):len(out) - int(eos is not None)] = ids
  if bos is not None:
    out[0] = bos
  if eos is not None:
    out[-1] = eos
  return out


class EpochShuffle(grain.MapDataset):
  """Positions 0..n-1 in a new seeded order each epoch, for `epochs` epochs (None: forever).

  Holds numpy permutations (4 bytes a document) of the epochs in use: Grain's index_shuffle costs
  10-100 us per element (10 ms for tiny n); beyond MAX_DOCS documents it is used instead. Streams
  read one order at slightly different places, so a few recent epochs are kept (up to KEEP_BYTES).
  """

  MAX_DOCS = 1 << 26
  KEEP_BYTES = 1 << 26

  def __init__(self, n: int, seed: int, epochs: int | None):
    super().__init__([])
    self.n, self.seed = n, seed
    self.length = n * epochs if epochs else sys.maxsize
    self._lock, self._perms = threading.Lock(), {}

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, i = divmod(index, self.n)
    return int(self._perm(epoch)[i])

  def _perm(self, epoch: int) -> np.ndarray:
    with self._lock:
      if epoch not in self._perms:
        perm = np.random.default_rng((self.seed, epoch)).permutation(self.n).astype(np.int32)  # [n]
        keep = max(2, self.KEEP_BYTES // (4 * self.n))
        self._perms = {e: self._perms[e] for e in sorted(self._perms)[-(keep - 1):]} | {epoch: perm}
      return self._perms[epoch]

  def __getstate__(self):
    return {**self.__dict__, "_lock": None, "_perms": {}}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def __str__(self) -> str:
    return f"EpochShuffle(n={self.n}, seed={self.seed})"


def doc_blocks(comp: Component, vocab: Vocab, view: DocIndex, *, shuffle_seed: int | None = None,
               epochs: int | None = 1) -> grain.MapDataset:
  """MapDataset of blocks (lists) of `view`'s documents as token arrays: seeded shuffle
  (a new order every epoch), `epochs` passes (None = forever), then `DOCS_PER_READ` per block."""
  n = len(view)
  if shuffle_seed is not None and n <= EpochShuffle.MAX_DOCS:
    ds = EpochShuffle(n, shuffle_seed, epochs)
  else:
    ds = grain.MapDataset.range(n)
    if shuffle_seed is not None:
      ds = ds.shuffle(seed=shuffle_seed)
    if epochs != 1:
      ds = ds.repeat(epochs)
  return ds.batch(DOCS_PER_READ).map(ReadDocs(comp, view, vocab))


class Concat(grain.MapDataset):
  """Several finite MapDatasets one after the other (the eval parts of a mixture)."""

  def __init__(self, parents: list[grain.MapDataset]):
    super().__init__(parents)
    self._ends = np.cumsum([len(p) for p in parents])

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    i = int(np.searchsorted(self._ends, index, side="right"))
    return self.parents[i][index - (int(self._ends[i - 1]) if i else 0)]

  def __str__(self) -> str:
    return f"Concat({len(self.parents)} parents)"

