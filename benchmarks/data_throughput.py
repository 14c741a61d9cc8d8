"""Data pipeline throughput per host: prepared ArrayRecord vs on-the-fly tokenization.

  python benchmarks/data_throughput.py [--seq-len 4096] [--batch 4] [--seconds 8]
      [--threads 1,2] [--workers 0,2] [--packing-bins 64] [--corpus FILE,...] [--step-tokens-per-s 80000]

Corpus: the embedded Austen novels plus, when present, ../shared/data/treasury_of_david.txt.xz
(one paragraph per line = one document; 4.2M tokens with the shipped 8k tokenizer). They are
prepared once into ArrayRecord shards in a temp dir (timed), then each configuration runs for
--seconds after two warm-up batches. "first" is the time from making the iterator to its first batch:
every row of the batch is its own stream that packs data.packing_bins rows before it gives one, so
it grows with batch x packing_bins x seq_len (one process here holds every row). "tokens/s" counts
whole rows (what the train step consumes: batch x seq_len per batch); "fill" is the share of
non-padding positions; "cores" is CPU time of this process and its Grain workers divided by wall
time; "rss" is the resident memory of this process and its workers after the measurement. "x step"
compares with the 8B train step on one H200.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from maxlm.config import DataConfig
from maxlm.data import make_train_iterator
from maxlm.data.prepare import prepare
from maxlm.data.sources import EMBEDDED_CORPUS

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def _children(pid: str):
  """(stat fields, /proc dir) of every live child process of `pid`."""
  for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if fields[1] == pid:  # ppid
      yield fields, stat.parent


def rss_gib() -> float:
  """Resident memory of this process and its live children (Grain workers), GiB."""
  dirs = [Path("/proc/self")] + [d for _, d in _children(str(os.getpid()))]
  total = 0
  for d in dirs:
    try:
      total += int((d / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
      continue
  return total / 2**30


def cpu_seconds() -> float:
  """CPU time of this process and its live children (Grain worker processes), from /proc."""
  t = os.times()
  total = t.user + t.system
  tick = os.sysconf("SC_CLK_TCK")
  for fields, _ in _children(str(os.getpid())):
    total += (int(fields[11]) + int(fields[12])) / tick
  return total


def measure(cfg: DataConfig, vocab: int, seconds: float) -> dict:
  t0 = time.perf_counter()
  it = make_train_iterator(cfg, vocab)
  next(it)
  first = time.perf_counter() - t0
  next(it)
  n = used = 0
  c0, t0 = cpu_seconds(), time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    b = next(it)
    n += b["inputs"].size
    used += int(np.count_nonzero(b["segment_ids"]))
  wall = time.perf_counter() - t0
  cores = (cpu_seconds() - c0) / wall
  rss = rss_gib()
  it.close()
  return {"tok_s": n / wall, "fill": used / max(n, 1), "cores": cores, "first": first, "rss": rss}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq-len", type=int, default=4096)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seconds", type=float, default=8.0)
  ap.add_argument("--threads", default="1,2", help="data.read_threads values")
  ap.add_argument("--workers", default="0,2", help="data.worker_count values")
  ap.add_argument("--max-segments", type=int, default=DataConfig().max_segments_per_row)
  ap.add_argument("--packing-bins", type=int, default=DataConfig().packing_bins, help="per row (stream)")
  ap.add_argument("--corpus", default="", help="comma-separated text files (one document per line)")
  ap.add_argument("--step-tokens-per-s", type=float, default=80_000,
                  help="what the train step consumes (8B shape, one H200)")
  args = ap.parse_args()
  corpus = args.corpus.split(",") if args.corpus else [str(EMBEDDED_CORPUS)] + [
      str(p) for p in [SHARED / "treasury_of_david.txt.xz"] if p.is_file()]
  threads = [int(x) for x in args.threads.split(",")]
  workers = [int(x) for x in args.workers.split(",")]
  print(f"host: {os.cpu_count()} CPU cores; python {sys.version.split()[0]}; corpus: "
        f"{', '.join(Path(c).name for c in corpus)}; batch {args.batch} x {args.seq_len}; "
        f"max_segments_per_row {args.max_segments}; packing_bins {args.packing_bins}")
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    meta = prepare(corpus, tmp, progress=False)
    dt = time.perf_counter() - t0
    print(f"prepare: {meta['documents']:,} documents, {meta['tokens']:,} tokens in {dt:.1f} s "
          f"({meta['tokens'] / dt:,.0f} tokens/s, {os.cpu_count()} tokenizer threads)\n")
    base = dict(seq_len=args.seq_len, global_batch_size=args.batch, eval_fraction=0.0,
                max_segments_per_row=args.max_segments, packing_bins=args.packing_bins)
    rows = [("synthetic", 0, 0, DataConfig(type="synthetic", **base))]
    for w in workers:
      for t in threads:
        rows.append(("arrayrecord", t, w, DataConfig(type="arrayrecord", paths=tmp, read_threads=t,
                                                     worker_count=w, **base)))
        rows.append(("text (tokenize)", t, w, DataConfig(type="text", paths=",".join(corpus),
                                                         read_threads=t, worker_count=w, **base)))
    head = (f"{'source':16s} {'threads':>7s} {'workers':>7s} {'first':>6s} {'tokens/s':>11s} {'fill':>5s} "
            f"{'cores':>5s} {'rss':>6s} {'x step':>6s}")
    print(head)
    print("-" * len(head))
    for name, t, w, cfg in rows:
      r = measure(cfg, 8192, args.seconds)
      print(f"{name:16s} {t:7d} {w:7d} {r['first']:5.1f}s {r['tok_s']:11,.0f} {r['fill']:5.2f} "
            f"{r['cores']:5.2f} {r['rss']:4.2f}GB {r['tok_s'] / args.step_tokens_per_s:6.1f}", flush=True)


if __name__ == "__main__":
  main()
