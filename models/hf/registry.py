"""The Hugging Face families shardzoo reads and writes, and the config.json <-> config mapping
that dispatches to them. A new family is a module like ``llama.py`` and one line in FAMILIES."""

from __future__ import annotations

import os

from shardzoo.models.hf import gemma, gpt2, llama, mixtral, olmo2, phi3, qwen3, qwen3_moe
from shardzoo.models.hf.base import Family, HFError, read_hf_config

# In order of preference: a config two families express exports as the first (llama over mistral).
FAMILIES: tuple[Family, ...] = (
    llama.LLAMA,
    llama.MISTRAL,
    llama.QWEN2,
    qwen3.QWEN3,
    olmo2.OLMO2,
    phi3.PHI3,
    gemma.GEMMA, gemma.GEMMA2, gemma.GEMMA3,
    mixtral.MIXTRAL,
    qwen3_moe.QWEN3_MOE,
    gpt2.GPT2,
)

REFUSED = gemma.REFUSED  # model_types a family module names as unsupported, with why
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
BY_NAME = {f.name: f for f in FAMILIES}
SUPPORTED = tuple(BY_MODEL_TYPE)
if len(BY_MODEL_TYPE) != sum(len(f.model_types) for f in FAMILIES) or len(BY_NAME) != len(FAMILIES):
    raise ImportError("models/hf/registry.py: two families claim one model_type or name")


def family_of_model_type(model_type, where: str = "config.json") -> Family:
    """The family that reads config.json's ``model_type``; an HFError naming the supported ones."""
    if model_type in REFUSED:
        raise HFError(f"{where}: {REFUSED[model_type]}")
    if model_type not in BY_MODEL_TYPE:
        raise HFError(f"{where}: unsupported model_type {model_type!r}; "
                      f"supported: {', '.join(SUPPORTED)}")
    return BY_MODEL_TYPE[model_type]


def family_named(name: str) -> Family | None:
    """The family a checkpoint recorded by name (None for a name this version does not know)."""
    return BY_NAME.get(name)


def family_of_config(config, name: str | None = None) -> Family:
    """The first family that expresses ``config`` exactly (or family ``name``, e.g. the one a
    checkpoint recorded: Phi-3's config is also Llama's); an HFError naming what stops the
    closest ones if none does."""
    problems = {}
    for family in FAMILIES if name is None else [BY_NAME.get(name)]:
        if family is None:
            raise HFError(f"unknown Hugging Face family {name!r}; known: {', '.join(BY_NAME)}")
        if isinstance(config, family.config_class):
            problems[family.name] = family.obstacles(config)
            if not problems[family.name]:
                return family
    if not problems:
        raise HFError(f"no Hugging Face family exports a {type(config).__name__}")
    fewest = min(len(p) for p in problems.values())
    closest = "; ".join(f"{n} cannot express {', '.join(p)}"
                        for n, p in problems.items() if len(p) == fewest)
    raise HFError(f"no Hugging Face family expresses this config: {closest}")


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The config fields (a dict) of an HF ``config.json``, by its family's mapping."""
    return family_of_model_type(hf.get("model_type"), where).from_hf(hf, where)


def config_to_hf(config, dtype: str | None = None, family: str | None = None) -> dict:
    """An HF ``config.json`` dict for ``config``, in ``family`` or the first that expresses it."""
    family, c = family_of_config(config, family), config
    eos = list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id
    shared = dict(architectures=[family.architecture], model_type=family.model_types[0],
                  vocab_size=c.vocab_size, bos_token_id=c.bos_token_id, eos_token_id=eos,
                  tie_word_embeddings=c.tie_word_embeddings,
                  initializer_range=c.initializer_range, torch_dtype=dtype or c.param_dtype)
    return shared | family.to_hf(config)


def load_hf_config(hf_dir: str, dtype=None, scan_layers: bool = True, overrides=None):
    """The config of an HF model directory, built by its family's config class.

    ``dtype`` ("float32" | "bfloat16") sets both the parameter and the compute dtype (default
    float32); ``overrides`` are further config fields (e.g. ``moe_dispatch``).
    """
    from shardzoo.models import apply_overrides

    where = os.path.join(hf_dir, "config.json")
    hf = read_hf_config(hf_dir)
    family = family_of_model_type(hf.get("model_type"), where)
    fields = family.from_hf(hf, where) | dict(scan_layers=scan_layers)
    if dtype is not None:
        fields.update(dtype=str(dtype), param_dtype=str(dtype))
    return apply_overrides(family.config_class(**fields), dict(overrides or {}), where=hf_dir)
