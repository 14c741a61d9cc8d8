"""Hugging Face Llama/Mistral/Mixtral import and export: config mapping (`config`), the one weight table
(`weights`), streaming safetensors and Orbax I/O (`safetensors_io`, `orbax_io`) and the transfers
between them (`transfer`)."""

from maxlm.hf.config import ARCHITECTURES, HFConfigError, from_hf, read_config_json, to_hf

__all__ = ["ARCHITECTURES", "HFConfigError", "from_hf", "read_config_json", "to_hf"]
