"""A tiny run checkpoint (step 0, freshly initialized, 8192-token vocabulary for the shipped tokenizer)
for the inference command tests (test_generate.py, test_eval.py)."""

from pathlib import Path

import jax

from maxlm.checkpoint import Checkpointer
from maxlm.config import CheckpointConfig, dump_yaml, load_config, to_dict
from maxlm.trainer import Trainer

# fp32 compute (references compare in fp32); init_std 0.2 so logits are far from uniform.
TINY = ["model.backend=flax", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8",
        "model.ffn_dim=48", "model.n_layers=2", "model.vocab_size=8192", "model.dtype=float32",
        "model.remat=none", "model.init_std=0.2", "data.type=synthetic", "data.seq_len=64",
        "data.global_batch_size=8"]


def make_checkpoint(root: Path, extra: tuple[str, ...] = ()):
  """(run directory, its config, its parameters as numpy) of a run whose checkpoint step 0 is saved."""
  cfg = load_config(TINY + [f"output_dir={root}", "run_name=tiny", *extra])
  t = Trainer(cfg)
  t.build()
  cfg.run_dir.mkdir(parents=True, exist_ok=True)
  (cfg.run_dir / "config.yml").write_text(dump_yaml(cfg))
  ckpt = Checkpointer(cfg.run_dir / "checkpoints", CheckpointConfig(enabled=True, async_save=False))
  ckpt.save(0, t.state, t.train_data.get_state(), to_dict(cfg))
  ckpt.close()
  return cfg.run_dir, cfg, jax.device_get(t.state.params)
