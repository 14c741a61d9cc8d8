"""Grain data pipeline: tokenizers, readers, packing, deterministic per-process batches.

Never imports model code; the trainer uses `make_train_iterator`, `make_eval_iterator` and
`load_tokenizer`, and treats `DataError` (a ValueError with a one-line message) as a user error.
"""

from maxlm.data.errors import DataError
from maxlm.data.pipeline import BATCH_KEYS, DataIterator, make_eval_iterator, make_train_iterator

__all__ = ["BATCH_KEYS", "DataError", "DataIterator", "load_tokenizer", "make_eval_iterator",
           "make_train_iterator"]


def load_tokenizer(*args, **kwargs):
  from maxlm.data.tokenizer import load_tokenizer as _load  # noqa: PLC0415
  return _load(*args, **kwargs)
