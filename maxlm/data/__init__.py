"""Grain data pipeline: tokenizers, readers, packing, global batches independent of the process count.

Never imports model code; the trainer uses `make_train_iterator`, `make_eval_iterator`,
`check_inputs` (every input opened and checked up front) and `load_tokenizer`, and treats
`DataError` (a ValueError with a one-line message) as a user error.
"""

import importlib

from maxlm.data.errors import DataError
from maxlm.data.tokenizer import Tokenizer, load_tokenizer

# name -> the module that defines it
_LAZY = {**dict.fromkeys(("BATCH_KEYS", "DataIterator", "check_inputs", "make_eval_iterator", "make_train_iterator",
                          "merge_states", "start_line"), "pipeline"), "resolve_type": "sources"}

__all__ = ["DataError", "Tokenizer", "load_tokenizer", *_LAZY]


def __getattr__(name: str):
  # Lazy on purpose: the pipeline imports Grain (and JAX, ~1-3 s); `maxlm prepare`
  # and other users of readers/tokenizers only should not pay for it.
  if name in _LAZY:
    return getattr(importlib.import_module(f"maxlm.data.{_LAZY[name]}"), name)
  raise AttributeError(f"module 'maxlm.data' has no attribute {name!r}")
