"""Grain data pipeline: tokenizers, readers, packing, global batches independent of the process count.

Never imports model code; the trainer uses `make_train_iterator`, `make_eval_iterator`,
`check_inputs` (every input opened and checked up front) and `load_tokenizer`, and treats
`DataError` (a ValueError with a one-line message) as a user error.
"""

from maxlm.data.errors import DataError
from maxlm.data.tokenizer import Tokenizer, load_tokenizer

_PIPELINE = ("BATCH_KEYS", "DataIterator", "check_inputs", "make_eval_iterator", "make_train_iterator",
             "merge_states", "resolve_type", "start_line")

__all__ = ["DataError", "Tokenizer", "load_tokenizer", *_PIPELINE]


def __getattr__(name: str):
  # Lazy on purpose: the pipeline imports Grain (and JAX, ~1-3 s); `maxlm prepare`
  # and other users of readers/tokenizers only should not pay for it.
  if name in _PIPELINE:
    from maxlm.data import pipeline  # noqa: PLC0415
    return getattr(pipeline, name)
  raise AttributeError(f"module 'maxlm.data' has no attribute {name!r}")
