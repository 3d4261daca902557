"""Granite-MoE-Shared: Granite-MoE with a shared expert beside the routed ones in every layer
(``shared_mlp``: a gated MLP ``shared_intermediate_size`` wide, its gate | up rows fused in
``input_linear``, as the experts'); none when that width is 0.
"""

from __future__ import annotations

from shardzoo.models.hf import granite, mixtral
from shardzoo.models.hf.base import Family, HFConfig, Weight
from shardzoo.models.moe_arch import NO_MOE

# GraniteMoeSharedConfig's fields and defaults (transformers 5.25)
SCHEMA = granite.MOE_SCHEMA | dict(shared_intermediate_size=0)
FEATURES = granite.GRANITE_MOE.features | {"shared_experts"}


def from_hf(hf: HFConfig) -> dict:
    return granite.moe_from_hf(hf) | dict(shared_expert_intermediate_size=hf.get("shared_intermediate_size"))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    return granite.moe_to_hf(a) | dict(shared_intermediate_size=m.shared_expert_intermediate_size)


def shared_mlp_weights(slot: str = "shared_expert") -> list[Weight]:
    """The ``shared_mlp``'s fused ``input_linear`` (gate | up) and ``output_linear`` as leaves of
    ``slot`` (Granite 4's dense layers: "mlp")."""
    x = granite.llama.LAYER + "shared_mlp."
    return [Weight((slot, "gate", "kernel"), x + "input_linear.weight", "linear", part=(0, 2)),
            Weight((slot, "up", "kernel"), x + "input_linear.weight", "linear", part=(1, 2)),
            Weight((slot, "down", "kernel"), x + "output_linear.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    """Granite-MoE's, and the shared expert's."""
    return granite.moe_layer_weights(a, spec) + (shared_mlp_weights() if a.moe.shared_expert_intermediate_size else [])


GRANITEMOESHARED = Family(
    "granitemoeshared", ("granitemoeshared",), "GraniteMoeSharedForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    granite.llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"granite-moe-shared-tiny": granite.GRANITE_MOE.presets["granite-moe-tiny"]
             | dict(shared_expert_intermediate_size=32)})
