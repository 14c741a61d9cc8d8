"""maxlm: config-driven LLM pretraining. `from maxlm import Model` gives the Python API (maxlm.api)."""


def __getattr__(name: str):
  # Lazy on purpose: `import maxlm` (e.g. for the `maxlm` command's help) must not start JAX; only
  # touching `maxlm.Model` imports the API and with it JAX.
  if name == "Model":
    from maxlm.api import Model  # noqa: PLC0415 - `import maxlm` must not start JAX
    return Model
  raise AttributeError(f"module 'maxlm' has no attribute {name!r}")


__all__ = ["Model"]
