"""The hint for an unknown config key: the maxlm key the user most likely meant.

Users come with other frameworks' names in their hands (MaxText's `learning_rate`, `per_device_batch_size`,
`ici_fsdp_parallelism`, `ici_context_parallelism`, `remat_policy`; torchtitan's `lr`, `max_norm`, `dp_shard`,
`context_parallel_degree`; Megatron's `train_iters`, `num_layers`, `tensor_model_parallel_size`,
`context_parallel_size`; Hugging Face's `hidden_size`, `num_key_value_heads`) or put a right name in the wrong
section (`train.learning_rate`). So the hint looks, in this order, at:

1. the last part of the key in PEER_NAMES (case and '-' ignored);
2. maxlm keys in other sections with the same last part (`optim.seed`: data.seed or train.seed);
3. the closest spelling of the whole key (difflib), as a plain typo (`model.n_layre`).
"""

from __future__ import annotations

import difflib

# other frameworks' (and common) names -> the maxlm key; every value is checked to be a key by the tests
PEER_NAMES: dict[str, str] = {
    **dict.fromkeys(("lr", "learning_rate", "max_lr", "peak_lr"), "optim.learning_rate"),
    **dict.fromkeys(("batch_size", "per_device_batch_size", "global_batch_size_to_train_on", "train_batch_size",
                     "global_batch_size"), "data.global_batch_size"),
    **dict.fromkeys(("steps", "max_steps", "train_steps", "train_iters", "iterations", "total_steps"),
                    "train.steps"),
    **dict.fromkeys(("seq_len", "max_seq_len", "seq_length", "sequence_length", "max_target_length",
                     "context_length", "block_size"), "data.seq_len"),
    **dict.fromkeys(("warmup", "warmup_steps", "lr_warmup_steps", "warmup_iters",
                     "warmup_steps_fraction"), "optim.warmup_steps"),
    **dict.fromkeys(("max_norm", "grad_clip", "clip_grad", "max_grad_norm", "gradient_clipping_threshold",
                     "clip_grad_norm"), "optim.clip_grad_norm"),
    **dict.fromkeys(("beta1", "adam_b1", "adam_beta1"), "optim.b1"),
    **dict.fromkeys(("beta2", "adam_b2", "adam_beta2"), "optim.b2"),
    **dict.fromkeys(("adam_eps", "adam_epsilon", "epsilon"), "optim.eps"),
    **dict.fromkeys(("weight_decay", "adam_weight_decay", "wd"), "optim.weight_decay"),
    **dict.fromkeys(("mu_dtype", "opt_state_dtype", "optimizer_state_dtype"), "optim.mu_dtype"),
    **dict.fromkeys(("nu_dtype",), "optim.nu_dtype"),
    **dict.fromkeys(("optimizer_memory_host_offload", "offload_optimizer", "cpu_offload"), "optim.offload"),
    **dict.fromkeys(("dim", "hidden_size", "emb_dim", "base_emb_dim", "n_embd", "d_model"), "model.d_model"),
    **dict.fromkeys(("num_layers", "n_layer", "num_hidden_layers", "base_num_decoder_layers", "n_layers"),
                    "model.n_layers"),
    **dict.fromkeys(("num_heads", "n_head", "num_attention_heads", "base_num_query_heads"), "model.n_heads"),
    **dict.fromkeys(("num_kv_heads", "n_kv_head", "num_key_value_heads", "base_num_kv_heads",
                     "num_query_groups"), "model.n_kv_heads"),
    **dict.fromkeys(("intermediate_size", "mlp_dim", "base_mlp_dim", "ffn_hidden_size", "hidden_dim"),
                    "model.ffn_dim"),
    **dict.fromkeys(("kv_channels", "head_size"), "model.head_dim"),
    **dict.fromkeys(("padded_vocab_size", "vocab"), "model.vocab_size"),
    **dict.fromkeys(("rope_max_timescale", "rotary_base", "rope_base"), "model.rope_theta"),
    **dict.fromkeys(("rms_norm_eps", "normalization_layer_epsilon", "layernorm_epsilon"), "model.norm_eps"),
    **dict.fromkeys(("num_experts", "num_local_experts", "moe_num_experts"), "model.moe.experts"),
    **dict.fromkeys(("num_experts_per_tok", "moe_router_topk"), "model.moe.top_k"),
    **dict.fromkeys(("router_aux_loss_coef", "load_balance_loss_weight", "moe_aux_loss_coeff"),
                    "model.moe.aux_loss_coef"),
    **dict.fromkeys(("moe_z_loss_coeff", "router_z_loss_coef"), "model.moe.z_loss_coef"),
    **dict.fromkeys(("remat_policy", "activation_checkpointing", "recompute_granularity", "ac_mode"),
                    "model.remat"),
    **dict.fromkeys(("weight_dtype",), "model.param_dtype"),
    **dict.fromkeys(("quantization", "fp8", "float8"), "model.precision"),
    **dict.fromkeys(("gradient_accumulation_steps", "grad_accum_steps", "grad_accum",
                     "accumulate_grad_batches"), "train.grad_accum"),
    **dict.fromkeys(("eval_interval", "eval_period", "eval_freq"), "train.eval_every"),
    **dict.fromkeys(("log_period", "log_interval", "log_freq", "logging_steps"), "train.log_every"),
    **dict.fromkeys(("checkpoint_period", "save_every", "save_interval", "checkpoint_interval",
                     "save_steps"), "checkpoint.every"),
    **dict.fromkeys(("enable_checkpointing",), "checkpoint.enabled"),
    **dict.fromkeys(("load_parameters_path", "init_from", "pretrained_checkpoint", "load"),
                    "checkpoint.load_params"),
    **dict.fromkeys(("dataset_path", "data_path", "data_paths", "train_data_paths", "dataset"), "data.paths"),
    **dict.fromkeys(("tokenizer_path", "tokenizer_model"), "data.tokenizer"),
    **dict.fromkeys(("base_output_directory", "out_dir", "dump_folder", "save"), "output_dir"),
    **dict.fromkeys(("ici_fsdp_parallelism", "dp_shard", "data_parallel_shard_degree"), "mesh.fsdp"),
    **dict.fromkeys(("ici_tensor_parallelism", "tp", "tensor_parallel_degree", "tensor_parallel_size",
                     "tensor_model_parallel_size"), "mesh.tensor"),
    **dict.fromkeys(("ici_data_parallelism", "dp_replicate", "data_parallel_replicate_degree"), "mesh.data"),
    **dict.fromkeys(("ici_context_parallelism", "context_parallel_degree", "context_parallel_size", "cp"),
                    "mesh.context"),
    **dict.fromkeys(("dcn_context_parallelism",), "mesh.dcn_context"),
    **dict.fromkeys(("context_parallel_strategy", "cp_comm_type", "context_parallel_rotate_method"),
                    "mesh.context_strategy"),
    **dict.fromkeys(("dcn_fsdp_parallelism",), "mesh.dcn_fsdp"),
    **dict.fromkeys(("ici_expert_parallelism", "expert_parallel_degree", "expert_model_parallel_size", "ep"),
                    "mesh.expert"),
    **dict.fromkeys(("dcn_expert_parallelism",), "mesh.dcn_expert"),
    **dict.fromkeys(("dcn_data_parallelism",), "mesh.dcn_data"),
    **dict.fromkeys(("ici_pipeline_parallelism", "pp", "pipeline_parallel_degree", "pipeline_parallel_size",
                     "pipeline_model_parallel_size"), "mesh.pipeline"),
    **dict.fromkeys(("dcn_pipeline_parallelism",), "mesh.dcn_pipeline"),
    **dict.fromkeys(("num_pipeline_microbatches",), "train.grad_accum"),
}


# keys maxlm no longer has -> what replaced them (the error line says it instead of a guess)
REPLACED: dict[str, str] = {
    "optim.state_dtype": "the two Adam moments have their own keys, optim.mu_dtype and optim.nu_dtype "
                         "(state_dtype=bfloat16 was optim.mu_dtype=bfloat16 optim.nu_dtype=bfloat16)",
}


def upgrade(data: dict) -> dict:
  """A resolved config dict written by an older maxlm (a run's config.yml, a checkpoint's config item) in
  today's keys: optim.state_dtype becomes optim.mu_dtype and optim.nu_dtype. Config files and overrides a
  person writes are not upgraded: the old key is an error there (REPLACED)."""
  optim = data.get("optim")
  if not isinstance(optim, dict) or "state_dtype" not in optim:
    return data
  optim = dict(optim)
  dtype = optim.pop("state_dtype")
  optim.setdefault("mu_dtype", dtype)
  optim.setdefault("nu_dtype", dtype)
  optim.setdefault("moment_rounding", "nearest")  # what every run before the key did
  return {**data, "optim": optim}


def suggest(key: str, known: list[str]) -> list[str]:
  """The known keys the unknown `key` most likely meant (several when its last part names a key in several
  sections), or none."""
  leaf = key.rsplit(".", 1)[-1].lower().replace("-", "_")
  if PEER_NAMES.get(leaf) in known:
    return [PEER_NAMES[leaf]]
  same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
  return same_leaf or difflib.get_close_matches(key, known, n=1, cutoff=0.5)


def hint(key: str, known: list[str]) -> str:
  """' (did you mean 'a'?)', ' (did you mean 'a' or 'b'?)', or ''."""
  meant = suggest(key, known)
  return f" (did you mean {' or '.join(repr(k) for k in meant)}?)" if meant else ""
