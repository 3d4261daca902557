"""Granite-MoE-SWA: Granite-MoE-Shared's model (models/hf/granitemoeshared.py: Granite's
multipliers, stacked experts, a fused shared MLP) with Granite-SWA's attention
(models/hf/granite_swa.py: sliding layers, GPT-OSS's sinks, a rotary base per layer, 0: NoPE);
the experts' tensors under transformers 5's names (``experts.gate_up_proj``, ``router.weight``).
"""

from __future__ import annotations

from shardzoo.models.hf import granite_swa, granitemoeshared, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight, renamed

# GraniteMoeSWAConfig's fields and defaults (transformers 5.25)
SCHEMA = granitemoeshared.SCHEMA | dict(sliding_window=128, layer_types=None, layer_rope_theta=None)
FEATURES = granitemoeshared.FEATURES | {"sliding_window", "layer_pattern", "attention_sinks", "nope_layers"}


def from_hf(hf: HFConfig) -> dict:
    return granite_swa.swa_fields(hf, granitemoeshared.from_hf(hf))


def to_hf(a) -> dict:
    return granitemoeshared.to_hf(a) | granite_swa.swa_to_hf(a)


# Granite-MoE's expert tensors -> transformers 5's names, which this family's checkpoints use
_NAMES = (("block_sparse_moe.router.layer.", "block_sparse_moe.router."),
          ("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj"),
          ("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj"))


def layer_weights(a, spec) -> list[Weight]:
    return renamed(granitemoeshared.layer_weights(a, spec), _NAMES) + [granite_swa.SINKS]


GRANITEMOE_SWA = Family(
    "granitemoe_swa", ("granitemoe_swa",), "GraniteMoeSWAForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"granite-moe-swa-tiny": granitemoeshared.GRANITEMOESHARED.presets["granite-moe-shared-tiny"] | dict(
        num_hidden_layers=4, sliding_window=8, attention_sinks=True,
        layer_types=("full_attention",) + ("sliding_attention",) * 3)})
