"""VaultGemma: Gemma 2 with its two pre-norms only (``input_layernorm`` before attention,
``pre_feedforward_layernorm`` before the MLP; no post-norms): soft-caps, ``query_pre_attn_scalar``
and its sliding and global layers as Gemma 2.
"""

from __future__ import annotations

import dataclasses

from shardzoo.models.hf import gemma, llama
from shardzoo.models.hf.base import Family, HFConfig, Weight

# VaultGemmaConfig's fields and defaults (Gemma2Config's without use_bidirectional_attention)
SCHEMA = {k: v for k, v in gemma.SCHEMA2.items() if k != "use_bidirectional_attention"}
FEATURES = (gemma.FEATURES2 - {"sandwich_norms"}) | {"pre_norms"}


def from_hf(hf: HFConfig) -> dict:
    return gemma.gemma2_from_hf(hf) | dict(norm_position="pre")


def layer_weights(a, spec) -> list[Weight]:
    """Llama's tensors, the MLP's norm named ``pre_feedforward_layernorm``."""
    mlp_norm = llama.LAYER + "post_attention_layernorm.weight"
    return [dataclasses.replace(w, name=llama.LAYER + "pre_feedforward_layernorm.weight") if w.name == mlp_norm else w
            for w in llama.layer_weights(a, spec)]


VAULTGEMMA = Family(
    "vaultgemma", ("vaultgemma",), "VaultGemmaForCausalLM", SCHEMA, FEATURES, from_hf, gemma.gemma2_to_hf,
    llama.global_weights, layer_weights,
    presets={
        "vaultgemma-tiny": gemma.GEMMA2.presets["gemma2-tiny"] | dict(norm_position="pre"),
    })
