"""Grain data pipeline: tokenizers, readers, packing, deterministic per-process batches.

Never imports model code; the trainer uses `make_train_iterator`, `make_eval_iterator` and
`load_tokenizer`, and treats `DataError` (a ValueError with a one-line message) as a user error.
"""

from maxlm.data.errors import DataError
from maxlm.data.pipeline import BATCH_KEYS, DataIterator, make_eval_iterator, make_train_iterator
from maxlm.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["BATCH_KEYS", "DataError", "DataIterator", "Tokenizer", "load_tokenizer",
           "make_eval_iterator", "make_train_iterator"]
