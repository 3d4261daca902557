"""Youtu-LLM (Tencent): DeepSeek-V3's latent attention (models/hf/deepseek_v2.py; rotary on
interleaved pairs by ``rope_interleave``) in dense Llama layers, tied embeddings by default."""

from __future__ import annotations

from shardzoo.models.hf import deepseek_v2, llama
from shardzoo.models.hf.base import Family, HFConfig

# YoutuConfig's fields and defaults (transformers 5.25: DeepseekV3Config's without the MoE ones);
# head_dim and qk_head_dim are derived sizes transformers writes
SCHEMA = {k: v for k, v in llama.SCHEMA.items() if k not in ("pretraining_tp", "mlp_bias")} | dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=6144, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, max_position_embeddings=131072, initializer_range=None, bos_token_id=128000,
    eos_token_id=128001, tie_word_embeddings=True, rope_interleave=True, embedding_initializer_range=None,
    qk_head_dim=None)
FEATURES = llama.ROTARY | {"latent_attention", "rope_interleaved"}


def from_hf(hf: HFConfig) -> dict:
    hf.ignore("qk_head_dim", "embedding_initializer_range")  # a derived size; an initialisation setting
    out = deepseek_v2.latent_fields(hf)
    if out["initializer_range"] is None:  # transformers': 2 / sqrt(5 hidden_size)
        out["initializer_range"] = 2.0 / (5.0 * out["hidden_size"]) ** 0.5
    return out | dict(rope_interleaved=bool(hf.get("rope_interleave")))


def to_hf(a) -> dict:
    return deepseek_v2.latent_to_hf(a) | dict(rope_interleave=a.rope_interleaved)


YOUTU = Family(
    "youtu", ("youtu",), "YoutuForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, llama.global_weights,
    deepseek_v2.layer_weights,
    presets={"youtu-tiny": {k: v for k, v in deepseek_v2.TINY.items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "max_position_embeddings",
        "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")} | dict(
        num_hidden_layers=2, rope_interleaved=True, tie_word_embeddings=True)})
