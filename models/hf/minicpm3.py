"""MiniCPM3 (OpenBMB): DeepSeek-V2's latent attention (models/hf/deepseek_v2.py: the query and the
keys and values through low-rank latents, rotary embeddings on ``qk_rope_head_dim`` features of
each head) with rotate-half rotary, not DeepSeek's interleaved pairs, in dense Llama layers, and
Granite's multipliers under MiniCPM's names: embeddings times ``scale_emb``, each residual branch
times ``scale_depth / sqrt(num_hidden_layers)``, logits over ``hidden_size / dim_model_base``.
"""

from __future__ import annotations

import math

from shardzoo.models.hf import deepseek_v2, llama
from shardzoo.models.hf.base import Family, HFConfig

# MiniCPM3Config's fields and defaults (transformers 5.25)
SCHEMA = {k: v for k, v in llama.SCHEMA.items() if k != "head_dim"} | dict(
    vocab_size=73448, hidden_size=2560, intermediate_size=6400, num_hidden_layers=62, num_attention_heads=40,
    num_key_value_heads=40, max_position_embeddings=32768, initializer_range=0.1, rms_norm_eps=1e-5,
    tie_word_embeddings=True, head_dim=None, kv_lora_rank=256, q_lora_rank=768, qk_nope_head_dim=64,
    qk_rope_head_dim=32, v_head_dim=64, scale_emb=12, scale_depth=1.4, dim_model_base=256, qk_head_dim=None)
FEATURES = llama.ROTARY | {"latent_attention", "multipliers"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore("qk_head_dim")  # transformers derives it: nope + rope
    out = deepseek_v2.latent_fields(hf)
    n, hidden = out["num_hidden_layers"], out["hidden_size"]
    depth, base = hf.get("scale_depth"), hf.get("dim_model_base")
    if out["v_head_dim"] is None:
        out["v_head_dim"] = hidden // out["num_attention_heads"]
    return out | dict(embedding_multiplier=float(hf.get("scale_emb")),
                      residual_multiplier=1.0 if depth is None else depth / math.sqrt(n),
                      logits_scaling=1.0 if base is None else hidden / base)


def to_hf(a) -> dict:
    return deepseek_v2.latent_to_hf(a) | dict(
        scale_emb=a.embedding_multiplier, scale_depth=a.residual_multiplier * math.sqrt(a.num_hidden_layers),
        dim_model_base=round(a.hidden_size / a.logits_scaling))  # an integer in MiniCPM3Config


MINICPM3 = Family(
    "minicpm3", ("minicpm3",), "MiniCPM3ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, llama.global_weights,
    deepseek_v2.layer_weights,
    presets={"minicpm3-tiny": {k: v for k, v in deepseek_v2.TINY.items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "max_position_embeddings",
        "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")} | dict(
        num_hidden_layers=2, embedding_multiplier=12.0, residual_multiplier=0.7, logits_scaling=4.0,
        tie_word_embeddings=True)})
