"""The ``moe`` sub-record of the architecture: a Mixture-of-Experts model's settings (names and
defaults of Hugging Face's ``MixtralConfig`` and its kin), owned by the MoE MLP kind
(``models/moe.py``). None on a dense model; ``num_local_experts=0`` (a dense model's value in
older checkpoints and ``--override``) reads as None."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from shardzoo.models import ModelError
from shardzoo.models.component import SubRecord
from shardzoo.models.features import feature
from shardzoo.models.layers import positive

MOE = "moe"  # its name in mlp_layer_types
DENSE_AND_MOE = "dense_and_moe"  # a dense MLP and the routed experts side by side (Gemma 4's MoE block)
EXPERT_TYPES = ("gated", "plain")  # act(x @ wi_gate) * (x @ wi_up), or act(x @ wi_up): the hidden before wo
# how the router picks experts (models/moe_routing.py ``choose_experts``)
ROUTERS = ("softmax", "softmax_groups", "sigmoid_groups", "sigmoid_input", "softmax_bias", "sparsemixer", "sigmoid",
           "scaled_softmax", "logit_bias")
UNGROUPED = ("softmax", "sigmoid_input", "softmax_bias", "sparsemixer", "sigmoid", "scaled_softmax",
             "logit_bias")  # the routers without expert groups
ZERO_EXPERT_ROUTERS = ("softmax", "softmax_bias")  # those that may score zero-computation experts too


@dataclasses.dataclass(frozen=True)
class MoeArch(SubRecord):
    """The MoE layers' settings: a router picks ``num_experts_per_tok`` of ``num_local_experts``
    experts (``moe_intermediate_size`` wide; None: ``intermediate_size``) per token; a shared
    expert beside them (``shared_expert_intermediate_size``)."""

    NAME: ClassVar[str] = "moe"
    FEATURE: ClassVar[str] = "moe"
    OWNERS: ClassVar[tuple[str, ...]] = (MOE, DENSE_AND_MOE)
    FLAT: ClassVar[dict[str, str]] = {n: n for n in (
        "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef",
        "router_jitter_noise", "shared_expert_intermediate_size", "shared_expert_gate", "router_kind", "n_group",
        "topk_group", "routed_scaling_factor", "router_bias", "expert_bias", "swiglu_limit", "swiglu_alpha",
        "expert_type", "sparsemixer_eps", "post_moe_norm", "zero_expert_num")} | {"moe_output_bias": "output_bias"}

    num_local_experts: int = 0  # 0: none (the record of a dense model is None)
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = feature(None, "expert_width")  # None: intermediate_size
    norm_topk_prob: bool = True  # renormalise the chosen experts' probabilities
    router_aux_loss_coef: float = 0.01
    router_jitter_noise: float = feature(0.0, "router_jitter")
    # a dense gated MLP beside the routed experts of every MoE layer, its output added to theirs
    # (Qwen2-MoE's shared_expert; DeepSeek's n_shared_experts x moe_intermediate_size wide)
    shared_expert_intermediate_size: int = feature(0, "shared_experts")  # 0: none
    shared_expert_gate: bool = feature(False, "shared_expert_gate")  # x sigmoid(x . w) (Qwen2-MoE)
    # how the router picks experts (ROUTERS): "softmax" top-k of the softmax; "softmax_groups"
    # top-k within the topk_group of n_group expert groups with the highest probability
    # (DeepSeek-V2's group_limited_greedy); "sigmoid_groups": sigmoid scores, chosen with a
    # correction bias added, groups ranked by the sum of their two best (DeepSeek-V3);
    # "sigmoid_input": top-k of the logits, each chosen expert's INPUT scaled by the sigmoid of
    # its logit and the outputs summed (Llama 4); "softmax_bias": top-k of the softmax plus a
    # correction bias, weighted by the unbiased probabilities (Ernie 4.5 MoE); "sparsemixer": the
    # best expert, then the best of the rest, each weighted by a softmax over the logits within
    # 2 x sparsemixer_eps (relative) of its own (Phi-MoE, top-2 only); "sigmoid": top-k of
    # the sigmoid scores, no correction bias, no groups (Flint); "scaled_softmax":
    # the router reads its input RMS-normalised without a weight, times a learned vector and
    # 1/sqrt(hidden_size), and each chosen expert's weight is times its learned scale (Gemma 4); "logit_bias": top-k of
    # the logits plus a correction bias, weighted by the sigmoid of the chosen logits (Kolibri)
    router_kind: str = feature("softmax", {"softmax_groups": "group_limited_router",
                                           "sigmoid_groups": "sigmoid_router",
                                           "sigmoid_input": "input_scaled_router",
                                           "softmax_bias": "biased_softmax_router",
                                           "sparsemixer": "sparsemixer_router",
                                           "sigmoid": "sigmoid_topk_router",
                                           "scaled_softmax": "scaled_router",
                                           "logit_bias": "biased_logit_router"})
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = feature(1.0, "routed_scaling")  # the routed experts' sum scaled
    router_bias: bool = feature(False, "router_bias")  # the router's logits have a bias (GPT-OSS)
    expert_bias: bool = feature(False, "expert_bias")  # the experts' gate, up and down have biases (GPT-OSS)
    # the experts' clamped SwiGLU (GPT-OSS): gate <= limit, |up| <= limit,
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate); None: act(gate) * up
    swiglu_limit: float | None = feature(None, "clamped_swiglu")
    swiglu_alpha: float = 1.702
    # the routed experts' MLP: "gated" act(x @ wi_gate) * (x @ wi_up), or "plain" act(x @ wi_up)
    # without a gate (Nemotron-H's up, relu2, down); either way then wo
    expert_type: str = feature("gated", {"plain": "plain_experts"})
    sparsemixer_eps: float = 0.01  # the sparsemixer's mask threshold (Phi-MoE's router_jitter_noise)
    # a norm (the model's norm_type) of the MoE layer's output, routed and shared experts summed,
    # before the residual (A.X-K1's post_mlp_layernorm); dense layers have none
    post_moe_norm: bool = feature(False, "moe_output_norm")
    # zero-computation experts (LongCat-Flash): the router scores num_local_experts + zero_expert_num
    # experts; a token's choices among the last zero_expert_num return its input times their weight
    # (no parameters), the others go to the routed experts as ever
    zero_expert_num: int = feature(0, "zero_experts")
    # one bias on the routed experts' weighted sum, shared by all experts (JetMoE's mlp.bias)
    output_bias: bool = feature(False, "moe_output_bias")

    def __post_init__(self):
        self._check_own()
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        # the canonical spelling of equal math
        if not self.shared_expert_intermediate_size:
            set_("shared_expert_gate", False)  # no shared expert, nothing to gate
        if self.router_kind == "softmax_groups" and self.n_group == 1:
            set_("router_kind", "softmax")  # one group: the plain top-k
        if self.router_kind in UNGROUPED or self.n_group == 1:
            set_("n_group", 1)
            set_("topk_group", 1)
        if self.swiglu_limit is None:
            set_("swiglu_alpha", 1.702)  # no clamped SwiGLU, no gain
        if self.router_kind != "sparsemixer":
            set_("sparsemixer_eps", 0.01)

    @classmethod
    def of(cls, value):
        """``SubRecord.of``, a record of no experts as None (a dense model)."""
        record = super().of(value)
        return None if record is not None and record.num_local_experts == 0 else record

    def _check_own(self) -> None:
        """What its fields say by themselves, one ModelError naming the field."""
        for name, allowed in (("router_kind", ROUTERS), ("expert_type", EXPERT_TYPES)):
            if getattr(self, name) not in allowed:
                raise ModelError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        e, g, k = self.num_local_experts, self.n_group, self.num_experts_per_tok
        for name, low in (("num_local_experts", 0), ("shared_expert_intermediate_size", 0), ("n_group", 1),
                          ("topk_group", 1), ("num_experts_per_tok", 1), ("moe_intermediate_size", 1),
                          ("zero_expert_num", 0)):
            value = getattr(self, name)
            if not (value is None and name == "moe_intermediate_size") and (e or name != "num_experts_per_tok") and (
                    not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ModelError(f"{name}={value!r} must be an integer >= {low}")
        for name in ("routed_scaling_factor", "swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if not (value is None and name == "swiglu_limit") and not positive(value):
                raise ModelError(f"{name}={value!r} must be a finite number > 0")
        if not 0 <= self.router_jitter_noise < 1:
            raise ModelError(f"router_jitter_noise={self.router_jitter_noise} must be in [0, 1)")
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ModelError(f"router_aux_loss_coef={self.router_aux_loss_coef!r} must be a finite number >= 0")
        if self.expert_type == "plain" and (self.expert_bias or self.swiglu_limit is not None):
            raise ModelError(f"expert_type='plain' (experts without a gate) takes neither expert_bias nor swiglu_limit "
                             f"(expert_bias={self.expert_bias}, swiglu_limit={self.swiglu_limit})")
        if e and k > e + self.zero_expert_num:
            raise ModelError(f"num_experts_per_tok={k} must be in 1..num_local_experts={e}"
                             + (f" + zero_expert_num={self.zero_expert_num}" if self.zero_expert_num else ""))
        if self.zero_expert_num and self.router_kind not in ZERO_EXPERT_ROUTERS:
            raise ModelError(f"zero_expert_num={self.zero_expert_num} (identity experts) routes by "
                             f"{' or '.join(ZERO_EXPERT_ROUTERS)}, not router_kind={self.router_kind!r}")
        if self.router_kind == "sparsemixer" and (k != 2 or not math.isfinite(self.sparsemixer_eps)
                                                  or self.sparsemixer_eps < 0):
            raise ModelError(f"router_kind sparsemixer picks 2 experts (num_experts_per_tok={k}) with a threshold "
                             f"sparsemixer_eps >= 0 (got {self.sparsemixer_eps!r})")
        if not e or self.router_kind in UNGROUPED:
            return
        if e % g or self.topk_group > g:
            raise ModelError(f"n_group={g} must divide num_local_experts={e} and topk_group="
                             f"{self.topk_group} must be at most n_group")
        if k > self.topk_group * (e // g):
            raise ModelError(f"num_experts_per_tok={k} exceeds the experts of topk_group={self.topk_group} "
                             f"groups of {e // g}")
        if self.router_kind == "sigmoid_groups" and e // g < 2:
            raise ModelError(f"router_kind sigmoid_groups ranks groups by their two best experts: "
                             f"num_local_experts={e} / n_group={g} must be >= 2")

    def check(self, arch) -> None:
        if not self.num_local_experts:
            raise ModelError("mlp_layer_types has moe layers but num_local_experts is 0")
        if arch.hidden_act == "xielu":
            raise ModelError(f"hidden_act='xielu' (learned per-layer scalars) runs in dense MLPs only; "
                             f"num_local_experts={self.num_local_experts}")


NO_MOE = MoeArch()  # a dense model's settings: no experts (what ``arch.moe or NO_MOE`` reads)
