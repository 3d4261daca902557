"""FlexOlmo: OLMoE's experts and router (models/hf/olmoe.py: softmax top-k, renormalised with
``norm_topk_prob``; qk-norm over the whole q and k projections) with OLMo 2's norms on the
outputs of attention and the MoE (``post_attention_layernorm``, ``post_feedforward_layernorm``;
no pre-norms).
"""

from __future__ import annotations

from shardzoo.models.hf import mixtral, olmoe
from shardzoo.models.hf.base import Family, HFConfig

# FlexOlmoConfig's fields and defaults (transformers 5.25)
SCHEMA = ({k: v for k, v in olmoe.SCHEMA.items() if k != "clip_qkv"}
          | dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-6, pad_token_id=100277,
                 bos_token_id=None, eos_token_id=100257, num_experts_per_tok=5, num_experts=7))
FEATURES = (olmoe.FEATURES - {"pre_norms"}) | {"post_norms"}


def from_hf(hf: HFConfig) -> dict:
    return olmoe.from_hf(hf) | dict(norm_position="post")


def to_hf(a) -> dict:
    """OLMoE's; no pad id unless the imported config.json had one (transformers' default, 100277,
    lies outside a small vocabulary)."""
    return olmoe.to_hf(a) | dict(pad_token_id=None)


FLEX_OLMO = Family(
    "flex_olmo", ("flex_olmo",), "FlexOlmoForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    olmoe.llama.global_weights, olmoe.layer_weights, execution=mixtral.HF_MOE,
    presets={"flex-olmo-tiny": olmoe.OLMOE.presets["olmoe-tiny"] | dict(norm_position="post")})
