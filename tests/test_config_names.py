"""The hint for an unknown config key (maxlm/config/names.py): peers' names, right names in the wrong section,
and typos, through the one-line error a user sees."""

import pytest

from maxlm.config import Config, ConfigError, load_config
from maxlm.config.names import PEER_NAMES, hint, suggest
from maxlm.config.schema import leaf_fields

KEYS = [k for k, _, _ in leaf_fields(Config)]


def test_every_peer_name_points_at_a_key():
  assert sorted(v for v in set(PEER_NAMES.values()) if v not in KEYS) == []


@pytest.mark.parametrize("typed,meant", [
    # MaxText
    ("learning_rate", "optim.learning_rate"), ("per_device_batch_size", "data.global_batch_size"),
    ("max_target_length", "data.seq_len"), ("remat_policy", "model.remat"), ("mu_dtype", "optim.state_dtype"),
    ("ici_fsdp_parallelism", "mesh.fsdp"), ("base_num_decoder_layers", "model.n_layers"),
    ("ici_context_parallelism", "mesh.context"), ("dcn_context_parallelism", "mesh.dcn_context"),
    ("context_parallel_strategy", "mesh.context_strategy"),
    ("ici_pipeline_parallelism", "mesh.pipeline"), ("dcn_pipeline_parallelism", "mesh.dcn_pipeline"),
    ("num_pipeline_microbatches", "train.grad_accum"), ("parallelism.pipeline_parallel_degree", "mesh.pipeline"),
    ("pipeline-model-parallel-size", "mesh.pipeline"),
    # torchtitan (its sections, dotted as in its TOML)
    ("optimizer.lr", "optim.learning_rate"), ("training.max_norm", "optim.clip_grad_norm"),
    ("parallelism.tensor_parallel_degree", "mesh.tensor"), ("parallelism.context_parallel_degree", "mesh.context"),
    ("parallelism.context_parallel_rotate_method", "mesh.context_strategy"),
    # Megatron, Hugging Face
    ("train_iters", "train.steps"), ("context_parallel_size", "mesh.context"), ("cp_comm_type", "mesh.context_strategy"),
    ("model.num_key_value_heads", "model.n_kv_heads"),
    ("model.intermediate_size", "model.ffn_dim"), ("Gradient-Accumulation-Steps", "train.grad_accum"),
    # a right name in the wrong section, or none
    ("train.learning_rate", "optim.learning_rate"), ("model.seq_len", "data.seq_len"), ("steps", "train.steps"),
    ("data.clip_grad_norm", "optim.clip_grad_norm"),
    # typos
    ("model.n_layre", "model.n_layers"), ("trian.steps", "train.steps"), ("data.eval_pahts", "data.eval_paths"),
])
def test_suggest(typed, meant):
  assert suggest(typed, KEYS) == [meant]


def test_a_leaf_in_several_sections_names_each_and_nonsense_gets_nothing():
  assert hint("optim.seed", KEYS) == " (did you mean 'data.seed' or 'train.seed'?)"
  assert suggest("zzz.qqqqqq", KEYS) == [] and hint("zzz.qqqqqq", KEYS) == ""


def test_the_error_line_carries_the_hint():
  with pytest.raises(ConfigError, match=r"^unknown config key 'train\.lr' \(did you mean 'optim\.learning_rate'\?\)$"):
    load_config(["train.lr=0.1"])
