"""Granite 4 (``granitemoehybrid``): Mamba2 layers beside attention layers (``layer_types``
"mamba" | "attention", in transformers 5 "linear_attention" | "full_attention"; older configs
``layers_block_type``), each then Granite-MoE-Shared's MLP (models/hf/granitemoeshared.py:
stacked experts beside the fused ``shared_mlp``) or, with ``num_local_experts`` 0, the
``shared_mlp`` alone as a dense MLP ``shared_intermediate_size`` wide. Granite's multipliers
(embedding, residual on every block, attention scale, logits); attention with rotary
embeddings on every attention layer when ``position_embedding_type`` is "rope", else none
(NoPE, Granite-4.0-H's). The mixer is Bamba's (models/hf/bamba.py NAMES, ``models/ssm.py``).
"""

from __future__ import annotations

import math

from shardzoo.models.arch import FULL, MAMBA, MOE
from shardzoo.models.hf import bamba, granitemoeshared, llama, mamba2, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight
from shardzoo.models.moe_arch import NO_MOE

# GraniteMoeHybridConfig's fields and defaults (transformers 5.25), and layers_block_type, the
# older name of layer_types it still reads
SCHEMA = granitemoeshared.SCHEMA | dict(
    hidden_size=4096, intermediate_size=11008, num_key_value_heads=32, rms_norm_eps=1e-6,
    router_aux_loss_coef=0.001, shared_intermediate_size=1024, position_embedding_type=None, layer_types=None,
    layers_block_type=None, mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256, mamba_d_head="auto",
    mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
    time_step_limit=[0.0, math.inf])
FEATURES = granitemoeshared.FEATURES | {"layer_pattern", "nope_layers", "mamba2", "mamba_proj_bias",
                                        "time_step_limit"}
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": FULL, "full_attention": FULL}


def from_hf(hf: HFConfig) -> dict:
    out = granitemoeshared.from_hf(hf) | mamba2.mamba_fields(hf, bamba.NAMES)
    n = out["num_hidden_layers"]
    key = "layers_block_type" if hf.get("layer_types") is None and "layers_block_type" in hf else "layer_types"
    hf.ignore("layer_types", "layers_block_type")
    types = hf.raw.get(key) or ["mamba"] * n
    if len(types) != n or any(t not in _KINDS for t in types):
        raise hf.refuse(key, f"each of the {n} layers must be one of {', '.join(_KINDS)}")
    position = hf.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise hf.refuse("position_embedding_type", "Granite 4's attention rotates ('rope') or has no positions "
                                                   "(null, 'nope')")
    if not out["num_local_experts"]:  # the shared MLP is the layer's dense MLP
        out |= dict(intermediate_size=out["shared_expert_intermediate_size"], shared_expert_intermediate_size=0)
    return out | dict(layer_types=tuple(_KINDS[t] for t in types), rope_layers=None if position == "rope" else (False,) * n)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    out = granitemoeshared.to_hf(a) | mamba2.mamba_to_hf(a, bamba.NAMES) | dict(
        layer_types=["mamba" if s.mixer == MAMBA else "attention" for s in a.layer_specs()],
        position_embedding_type=None if a.rope_layers else "rope")  # NoPE: as transformers' default spells it
    if not m.num_local_experts:
        out["shared_intermediate_size"] = a.intermediate_size
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    out = [Weight(("attn_norm", "scale"), h + "input_layernorm.weight"),
           Weight(("mlp_norm", "scale"), h + "post_attention_layernorm.weight")]
    if spec.mixer == MAMBA:
        out += mamba2.mamba_weights(a, h + "mamba.")
    else:
        out += [w for w in llama.attention_weights(a) if w.path[0] == "attn"]
    if spec.mlp != MOE:
        return out + granitemoeshared.shared_mlp_weights("mlp")
    return out + [w for w in granitemoeshared.layer_weights(a, spec) if w.path[0] in ("moe", "shared_expert")]


# ibm-granite/granite-4.0-h-tiny/config.json: its sizes and layer_types; its multipliers, rms_norm_eps and special
# tokens as the published GGUF conversion (ollama granite4:tiny-h) carries them; no positions (NoPE)
_H_TINY_TYPES = (MAMBA,) * 5 + (FULL,) + ((MAMBA,) * 9 + (FULL,)) * 3 + (MAMBA,) * 4
GRANITE_4_H_TINY = dict(
    vocab_size=100352, hidden_size=1536, intermediate_size=512, num_hidden_layers=40, num_attention_heads=12,
    num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=100257, eos_token_id=100257, embedding_multiplier=12.0, residual_multiplier=0.22,
    attention_multiplier=0.0078125, logits_scaling=6.0, num_local_experts=64, num_experts_per_tok=6,
    shared_expert_intermediate_size=1024, layer_types=_H_TINY_TYPES, rope_layers=(False,) * 40, mamba_num_heads=48,
    mamba_head_dim=64, mamba_n_groups=1, ssm_state_size=128, mamba_conv_kernel=4, mamba_chunk_size=256,
    router_aux_loss_coef=0.001)  # transformers' default (the training loss only)
GRANITEMOEHYBRID = Family(
    "granitemoehybrid", ("granitemoehybrid",), "GraniteMoeHybridForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"granite-4-hybrid-tiny": granitemoeshared.GRANITEMOESHARED.presets["granite-moe-shared-tiny"] | dict(
        num_hidden_layers=4, layer_types=(MAMBA, FULL, MAMBA, MAMBA), rope_layers=(False,) * 4, mamba_num_heads=8,
        mamba_head_dim=16, mamba_n_groups=2, ssm_state_size=16, mamba_chunk_size=64),
        "granite-4.0-h-tiny": GRANITE_4_H_TINY})
