"""The process around a run, below the planner and the trainer: settings applied before the JAX backend starts
(env.py), the one start sequence (startup.py), XLA presets, the compilation cache and the warm start,
jax.distributed and its output prefixes, device facts, and the hang watchdog. It imports only maxlm.config and
maxlm.errors (tests/test_structure.py); import its modules by name, this file imports none of them."""
