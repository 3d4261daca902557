"""A.X-K1 (SK Telecom, ``axk1``): DeepSeek-V3's model (models/hf/deepseek_v3.py: latent attention,
always through a query latent; the sigmoid router with its correction bias and groups; shared
experts) with dense and MoE layers listed in ``mlp_layer_types`` (GLM-4.7-Flash's reading,
models/hf/glm4_moe_lite.py; by default the first ``first_k_dense_replace``, 1, dense), and one
change: the MoE layers' output (routed plus shared experts) RMSNorm'd before the residual
(``post_mlp_layernorm``, saved at the layer's level: the MoE record's ``post_moe_norm``). Dense
layers have no such norm (released checkpoints store one there, which transformers ignores, as
shardzoo does).
"""

from __future__ import annotations

from shardzoo.models.hf import deepseek_v2, deepseek_v3, glm4_moe_lite, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, HFError, Weight
from shardzoo.models.moe_arch import MOE, NO_MOE

# AXK1Config's fields and defaults (transformers 5.25); first_k_dense_replace as config.json may
# still spell the dense prefix (transformers reads it when mlp_layer_types is absent)
SCHEMA = ({k: v for k, v in deepseek_v3.SCHEMA.items() if k != "num_nextn_predict_layers"}
          | dict(vocab_size=163840, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=192,
                 max_position_embeddings=32768, bos_token_id=163691, eos_token_id=163691, first_k_dense_replace=1,
                 mlp_layer_types=None))
FEATURES = deepseek_v3.FEATURES | {"moe_output_norm"}


def from_hf(hf: HFConfig) -> dict:
    if hf.get("q_lora_rank") is None:
        raise hf.refuse("q_lora_rank", "A.X-K1's queries always pass through their latent: an integer is needed")
    out = deepseek_v3.from_hf(hf)
    return out | dict(mlp_layer_types=glm4_moe_lite.mlp_kinds(hf, hf.get("first_k_dense_replace")),
                      post_moe_norm=True)


def to_hf(a) -> dict:
    if not (a.latent and a.latent.q_lora_rank and (a.moe or NO_MOE).post_moe_norm):
        raise HFError("A.X-K1 has latent attention with a query latent (q_lora_rank) and a norm of each MoE "
                      "layer's output (post_moe_norm)")
    out = deepseek_v3.to_hf(a)
    del out["first_k_dense_replace"]
    return out | dict(mlp_layer_types=glm4_moe_lite.mlp_kinds_to_hf(a))


def layer_weights(a, spec) -> list[Weight]:
    """DeepSeek-V3's, and a MoE layer's ``post_mlp_layernorm``."""
    out = deepseek_v2.layer_weights(a, spec)
    if spec.mlp == MOE:
        out.append(Weight(("post_moe_norm", "scale"), llama.LAYER + "post_mlp_layernorm.weight"))
    return out


AXK1 = Family(
    "axk1", ("axk1",), "AXK1ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"axk1-tiny": deepseek_v3.TINY | dict(q_lora_rank=24, post_moe_norm=True)})
