"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's model (``models/hf/deepseek_v32.py``: latent attention,
the lightning indexer, the sigmoid router with shared experts after a dense prefix) with its own
sizes, one expert group, and the indexer's rotary on interleaved pairs
(``indexer_rope_interleaved``).

Every layer runs its own indexer ("full" in ``indexer_types``, as GLM-5 and GLM-5.1 publish).
GLM-5.2's IndexShare ("shared" layers reusing the previous full layer's selection:
``indexer_types``, ``index_topk_freq``, ``index_topk_pattern``) is refused.
"""

from __future__ import annotations

from shardzoo.models.hf import deepseek_v32, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig

# GlmMoeDsaConfig's fields and defaults (transformers 5.25)
SCHEMA = deepseek_v32.SCHEMA | dict(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78, num_attention_heads=64,
    num_key_value_heads=64, q_lora_rank=2048, v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
    max_position_embeddings=202752, rms_norm_eps=1e-5, index_n_heads=32, indexer_types=None)


def indexer_types(hf: HFConfig) -> list[str]:
    """Each layer's indexer mode as transformers derives it: ``indexer_types``, else
    ``index_topk_pattern`` (F/S), else full where ``max(i - index_skip_topk_offset + 1, 0)`` is a
    multiple of ``index_topk_freq``."""
    types = hf.get("indexer_types")
    if types is not None:
        return list(types)
    pattern = hf.get("index_topk_pattern", None)
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(hf.get("index_topk_freq", 1) or 1, 1), hf.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(hf.get("num_hidden_layers"))]


def from_hf(hf: HFConfig) -> dict:
    if set(indexer_types(hf)) != {"full"}:
        raise hf.refuse("indexer_types", "layers that share another layer's top-k (IndexShare: indexer_types, "
                                         "index_topk_freq, index_topk_pattern) are not implemented; every layer "
                                         "must run its own indexer")
    return deepseek_v32.from_hf(hf) | dict(indexer_rope_interleaved=True)


def to_hf(a) -> dict:
    return deepseek_v32.to_hf(a)


# zai-org/GLM-5/config.json: 78 layers, the first 3 dense, 256 experts top-8 (one group) and one shared,
# 2048 wide; 64 heads (192 + 64 wide queries and keys, 256 wide values), latents of 2048 and 512; an
# indexer of 32 heads of 128 keeping 2048 keys; rotary base 1e6.
GLM5 = dict(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78, num_attention_heads=64,
    max_position_embeddings=202752, rms_norm_eps=1e-5, rope_theta=1000000.0, kv_lora_rank=512, q_lora_rank=2048,
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, rope_interleaved=True, num_local_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=2048, shared_expert_intermediate_size=2048,
    router_kind="sigmoid_groups", n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    router_aux_loss_coef=0.0, mlp_layer_types=("dense",) * 3 + ("moe",) * 75, bos_token_id=0, eos_token_id=1,
    router_z_loss_coef=0.0, index_topk=2048, index_n_heads=32, index_head_dim=128, indexer_rope_interleaved=True,
    layer_types=(deepseek_v32.INDEXED,) * 78)
TINY = deepseek_v32.TINY | dict(indexer_rope_interleaved=True, n_group=1, topk_group=1)
GLM_MOE_DSA = Family(
    "glm_moe_dsa", ("glm_moe_dsa",), "GlmMoeDsaForCausalLM", SCHEMA, deepseek_v32.FEATURES, from_hf, to_hf,
    llama.global_weights, deepseek_v32.layer_weights, execution=mixtral.HF_MOE,
    presets={"glm-5": GLM5, "glm-5-tiny": TINY})
