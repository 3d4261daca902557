"""Hugging Face interop: config.json and safetensors <-> shardzoo configs and param trees.

One module per family declares its ``model_type``s, its config mapping both ways and its weight
map (``llama.py``: llama, mistral, qwen2; ``qwen3.py``; ``olmo2.py``; ``phi3.py``; ``mixtral.py``;
``gemma.py``: gemma, gemma2, gemma3_text; ``gpt2.py``; ``granite.py``; ``starcoder2.py``;
``phi.py``; ``cohere.py``); ``registry.py`` lists them. ``base.py`` holds the records and config.json reading, ``tensors.py`` the safetensors
import (straight into each parameter's sharding) and export.
"""

from shardzoo.models.hf.base import (
    ROPE_TYPES,
    Family,
    HFError,
    Weight,
    is_hf_dir,
    read_hf_config,
)
from shardzoo.models.hf.registry import (
    FAMILIES,
    SUPPORTED,
    config_from_hf,
    config_to_hf,
    family_named,
    family_of_config,
    family_of_model_type,
    load_hf_config,
    write_hf_config,
)
from shardzoo.models.hf.tensors import (
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsReader,
    export_hf,
    hf_to_leaf,
    leaf_to_hf,
    load_hf_params,
    put_leaf,
)

__all__ = [
    "FAMILIES", "INDEX_FILE", "ROPE_TYPES", "SINGLE_FILE", "SUPPORTED", "Family", "HFError",
    "SafetensorsReader", "Weight", "config_from_hf", "config_to_hf", "export_hf", "family_named",
    "family_of_config", "family_of_model_type", "hf_to_leaf", "is_hf_dir", "leaf_to_hf",
    "load_hf_config", "load_hf_params", "put_leaf", "read_hf_config", "write_hf_config",
]
