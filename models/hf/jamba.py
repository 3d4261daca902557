"""Jamba (``jamba``): Mamba1 layers (``models/mamba1.py``, with weighted RMSNorms of dt, B and
C at ``rms_norm_eps``) and attention layers without positions (no rotary embedding: the mamba
layers order the tokens), each followed by a dense MLP or Mixtral's MoE (softmax top-k, the
chosen weights not renormalised). Layer ``i`` attends where ``i % attn_layer_period ==
attn_layer_offset`` and has the MoE where ``i % expert_layer_period == expert_layer_offset``
(and num_experts > 1); export writes the largest period and offset that give the pattern.
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, FULL, MOE
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, renamed, special_tokens
from shardzoo.models.hf.mamba import mamba1_fields, mamba1_to_hf, mamba1_weights
from shardzoo.models.mamba1 import MAMBA1
from shardzoo.models.moe_arch import NO_MOE

# JambaConfig's fields and transformers' defaults (ai21labs/Jamba-v0.1's)
SCHEMA = dict(vocab_size=65536, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
              initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, output_router_logits=False,
              router_aux_loss_coef=0.001, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              max_position_embeddings=262144, attention_dropout=0.0, num_experts_per_tok=2, num_experts=16,
              expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8, attn_layer_offset=4,
              use_mamba_kernels=True, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto",
              mamba_conv_bias=True, mamba_proj_bias=False, use_mambapy=False, use_associative_scan=True, head_dim=None)
FEATURES = frozenset({"rope", "nope_layers", "rmsnorm", "pre_norms", "gated_mlp", "moe", "moe_pattern",
                      "layer_pattern", "mamba1", "mamba1_bcdt_norm", "mamba1_bcdt_norm_weights"})
NAMES = dict(inner=None, expand="mamba_expand", state="mamba_d_state", conv="mamba_d_conv", rank="mamba_dt_rank",
             conv_bias="mamba_conv_bias", proj_bias="mamba_proj_bias", act="hidden_act")


def _every(hf: HFConfig, period: str, offset: str, n: int) -> list[bool]:
    p, o = hf.get(period), hf.get(offset)
    if not (isinstance(p, int) and isinstance(o, int) and 0 <= o < p):
        raise hf.refuse(offset, f"{offset} must be an integer in [0, {period}={p})")
    return [i % p == o for i in range(n)]


def _period(marked: list[bool]) -> tuple[int, int]:
    """The largest (period, offset) whose layers i % period == offset are ``marked`` (none: a
    period past the last layer); (0, 0) if no period gives them."""
    n = len(marked)
    if not any(marked):
        return n + 1, n
    for p in range(n, 0, -1):
        for o in range(p):
            if [i % p == o for i in range(n)] == marked:
                return p, o
    return 0, 0


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "use_mamba_kernels", "use_mambapy", "use_associative_scan", "output_router_logits")
    hf.require("hidden_size", "num_hidden_layers", "num_attention_heads")
    n, experts = hf.get("num_hidden_layers"), hf.get("num_experts")
    attends = _every(hf, "attn_layer_period", "attn_layer_offset", n)
    moe = _every(hf, "expert_layer_period", "expert_layer_offset", n) if experts > 1 else [False] * n
    return special_tokens(hf) | mamba1_fields(hf, NAMES) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"), num_hidden_layers=n,
        intermediate_size=hf.get("intermediate_size"), num_attention_heads=hf.get("num_attention_heads"),
        num_key_value_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
        max_position_embeddings=hf.get("max_position_embeddings"), rms_norm_eps=hf.get("rms_norm_eps"),
        initializer_range=hf.get("initializer_range"), tie_word_embeddings=hf.get("tie_word_embeddings"),
        rope_layers=(False,) * n, layer_types=tuple(FULL if a else MAMBA1 for a in attends),
        mlp_layer_types=tuple(MOE if m else DENSE for m in moe), num_local_experts=experts if any(moe) else 0,
        num_experts_per_tok=hf.get("num_experts_per_tok"), norm_topk_prob=False,
        router_aux_loss_coef=hf.get("router_aux_loss_coef"), mamba1_bcdt_rms_eps=hf.get("rms_norm_eps"),
        mamba1_bcdt_norm_weights=True)


def to_hf(a) -> dict:
    specs = a.layer_specs()
    attn = _period([s.mixer != MAMBA1 for s in specs])
    experts = _period([s.mlp == MOE for s in specs])
    m = a.moe or NO_MOE
    return mamba1_to_hf(a, NAMES) | dict(
        hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads, num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.max_position_embeddings, rms_norm_eps=a.rms_norm_eps, hidden_act=a.hidden_act,
        attn_layer_period=attn[0], attn_layer_offset=attn[1], expert_layer_period=experts[0],
        expert_layer_offset=experts[1], num_experts=m.num_local_experts or 1,
        num_experts_per_tok=m.num_experts_per_tok, router_aux_loss_coef=m.router_aux_loss_coef,
        **({"head_dim": a.head_dim} if a.head_dim else {}))


def global_weights(a) -> list[Weight]:
    return renamed(llama.global_weights(a), (("model.norm.", "model.final_layernorm."),))


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER
    out = [Weight(("attn_norm", "scale"), h + "input_layernorm.weight"),
           Weight(("mlp_norm", "scale"), h + "pre_ff_layernorm.weight")]
    if spec.mixer == MAMBA1:
        out += mamba1_weights(a, h + "mamba.")
    else:
        out += [w for w in llama.attention_weights(a) if w.path[0] == "attn"]
    if spec.mlp == MOE:
        return out + mixtral.moe_weights(a, "feed_forward.", ("gate_proj", "up_proj", "down_proj"), "router")
    return out + llama.mlp_weights(a, "feed_forward.")


# --------------------------------------------------------------------------------- presets
# ai21labs/Jamba-v0.1: 32 layers of 4096, attention on every 8th from 4 (32 heads, 8 kv), MoE of
# 16 experts top-2 on every odd layer, mamba inner 8192, state 16, dt rank 256
def _jamba(n: int, attn: tuple[int, int], experts: tuple[int, int], **fields) -> dict:
    return dict(num_hidden_layers=n, rope_layers=(False,) * n,
                layer_types=tuple(FULL if i % attn[0] == attn[1] else MAMBA1 for i in range(n)),
                mlp_layer_types=tuple(MOE if i % experts[0] == experts[1] else DENSE for i in range(n)),
                norm_topk_prob=False, router_aux_loss_coef=0.001, rms_norm_eps=1e-6,
                mamba1_bcdt_rms_eps=1e-6, mamba1_bcdt_norm_weights=True) | fields


JAMBA = Family(
    "jamba", ("jamba",), "JambaForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    execution=mixtral.HF_MOE,
    presets={
        "jamba-v0.1": _jamba(32, (8, 4), (2, 1), vocab_size=65536, hidden_size=4096, intermediate_size=14336,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=262144,
                             num_local_experts=16, num_experts_per_tok=2, mamba1_intermediate_size=8192,
                             mamba1_dt_rank=256, bos_token_id=1, eos_token_id=2),
        "jamba-tiny": _jamba(4, (4, 2), (2, 1), vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             num_local_experts=4, num_experts_per_tok=2, mamba1_intermediate_size=128,
                             mamba1_dt_rank=4, mamba1_state_size=8, bos_token_id=None, eos_token_id=None),
    })
