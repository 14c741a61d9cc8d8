"""maxlm/evaluate.py: the one eval loop (the trainer's and `maxlm eval`'s) weights by tokens, not by batch."""

import math

import numpy as np

from maxlm.evaluate import token_weighted


def test_loss_is_summed_token_loss_over_tokens_not_a_mean_of_batches():
  # Four batches of (summed token loss, tokens): batch means 1, 2, 2 and 10; by tokens the loss is 53 / 24.
  batches = [{"loss_sum": np.float32(3.0), "tokens": np.float32(3)}, {"loss_sum": 20.0, "tokens": 10.0},
             {"loss_sum": 20.0, "tokens": 10.0}, {"loss_sum": 10.0, "tokens": 1.0}]
  seen = []
  sums = token_weighted(lambda b: b, batches[:3] + batches[3:], on_batch=seen.append)
  assert (sums.loss_sum, sums.tokens, sums.batches) == (53.0, 24.0, 4) and len(seen) == 4
  assert sums.loss == 53.0 / 24.0 != np.mean([1.0, 2.0, 2.0, 10.0])
  assert math.isclose(sums.perplexity, math.exp(53.0 / 24.0))
  first_two = token_weighted(lambda b: b, iter(batches), max_batches=2)
  assert (first_two.loss_sum, first_two.tokens, first_two.batches) == (23.0, 13.0, 2)
