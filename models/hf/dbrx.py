"""DBRX (Databricks; ``dbrx``): rotary attention with q|k|v fused in ``Wqkv`` and clipped to
``attn_config.clip_qkv``, LayerNorms without bias (``layernorm_no_bias``, epsilon 1e-5 fixed), no
biases anywhere, and a MoE in every layer: a softmax router's top ``moe_top_k`` experts, their
weights divided by their ``moe_normalize_expert_weights``-norm (1: renormalised; null: as they
are), gated SiLU experts stored merged, ``ffn.experts.mlp.w1`` / ``v1`` / ``w2`` each
``[experts * ffn_hidden_size, d_model]`` (``Weight.merged_experts``; ``w2`` already (in, out)).

The rotary base: transformers 5 reads the top-level ``rope_parameters`` (10000 when absent) and
ignores ``attn_config.rope_theta``, which the published checkpoints set (500000) and
transformers 4 read; shardzoo takes the top-level base where config.json has one, else that one.
HF drops no token and has no router z-loss (the family's ``execution``). ``clip_qkv`` null reads
and writes as no clip, though transformers 5.25's DBRX cannot run it (its clamp takes no null).
"""

from __future__ import annotations

from shardzoo.models.arch import MOE
from shardzoo.models.hf import mixtral
from shardzoo.models.hf.base import INERT, Family, HFConfig, HFError, Weight, rope, special_tokens
from shardzoo.models.moe_arch import NO_MOE

EPS = 1e-5  # torch's nn.LayerNorm default, which DBRX does not change
PREFIX, LAYER = "transformer.", "transformer.blocks.{i}."
# DbrxConfig's fields and defaults (transformers 5.25); attn_config's in ATTN, ffn_config's in FFN
SCHEMA = dict(d_model=2048, n_heads=16, n_layers=24, max_seq_len=2048, vocab_size=32000, resid_pdrop=0.0,
              emb_pdrop=0.0, attn_config=None, ffn_config=None, use_cache=True, initializer_range=0.02,
              output_router_logits=False, rope_parameters=None, pad_token_id=None,
              bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, num_key_value_heads=None)
ATTN = dict(attn_pdrop=0.0, clip_qkv=None, kv_n_heads=1, rope_theta=10000.0)
FFN = dict(ffn_act_fn=None, ffn_hidden_size=3584, moe_num_experts=4, moe_top_k=1, moe_jitter_eps=None,
           moe_loss_weight=0.01, moe_normalize_expert_weights=1.0, hidden_size=None)
ALIASES = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
           "max_position_embeddings": "max_seq_len"}
FEATURES = frozenset({"rope", "rope_scaling:linear", "rope_scaling:llama3", "rope_scaling:yarn",
                      "rope_scaling:dynamic", "layernorm_no_bias", "pre_norms", "gated_mlp", "clip_qkv", "moe",
                      "expert_width", "router_jitter"})


def _sub(hf: HFConfig, key: str, schema: dict) -> dict:
    """``attn_config`` / ``ffn_config`` over transformers' defaults. Their other keys (the
    published files carry a whole PretrainedConfig's: ``top_k``, ``temperature``...) transformers
    ignores too, but for ``uniform_expert_assignment`` (the original code's expert choice)."""
    sub = dict(hf.get(key) or {})
    if sub.get("uniform_expert_assignment"):
        raise hf.refuse(key, "uniform_expert_assignment=true: transformers routes by the router's top-k")
    return dict(schema) | {k: v for k, v in sub.items() if k in schema}


def from_hf(hf: HFConfig) -> dict:
    hf.unalias(ALIASES)
    hf.ignore(*INERT, "emb_pdrop", "num_key_value_heads")  # the kv heads: attn_config's, copied by transformers
    attn, ffn = _sub(hf, "attn_config", ATTN), _sub(hf, "ffn_config", FFN)
    act = (ffn["ffn_act_fn"] or {"name": "silu"}).get("name", "silu")
    if act not in ("silu", "swish"):
        raise hf.refuse("ffn_config", f"ffn_act_fn name {act!r}: shardzoo's DBRX experts are SwiGLU (silu)")
    p = ffn["moe_normalize_expert_weights"]
    if p not in (None, 1, 1.0):
        raise hf.refuse("ffn_config", f"moe_normalize_expert_weights={p!r}: the chosen weights divided by their "
                                      "L1 norm (1) or as they are (null) only")
    hf.require("d_model", "n_heads", "n_layers")
    top = hf.get("rope_parameters") or "rope_theta" in hf or "rope_scaling" in hf  # what transformers 5 reads
    out = rope(hf, None if top else dict(rope_theta=attn["rope_theta"]))
    out.pop("partial_rotary_factor")
    return out | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("d_model"), intermediate_size=ffn["ffn_hidden_size"],
        num_hidden_layers=hf.get("n_layers"), num_attention_heads=hf.get("n_heads"),
        num_key_value_heads=attn["kv_n_heads"], max_position_embeddings=hf.get("max_seq_len"), rms_norm_eps=EPS,
        initializer_range=hf.get("initializer_range"), tie_word_embeddings=hf.get("tie_word_embeddings"),
        norm_type="layernorm_no_bias", clip_qkv=attn["clip_qkv"] or None, hidden_act="silu",
        num_local_experts=ffn["moe_num_experts"], num_experts_per_tok=ffn["moe_top_k"], norm_topk_prob=p is not None,
        router_jitter_noise=ffn["moe_jitter_eps"] or 0.0, router_aux_loss_coef=ffn["moe_loss_weight"],
        **special_tokens(hf))


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    if a.tie_word_embeddings:
        raise HFError("DBRX does not tie its output head to the embeddings (tie_word_embeddings)")
    scaling = {k: list(v) if isinstance(v, tuple) else v for k, v in a.rope_scaling_dict.items()}
    return dict(
        d_model=a.hidden_size, n_heads=a.num_attention_heads, n_layers=a.num_hidden_layers,
        max_seq_len=a.max_position_embeddings, rope_parameters={"rope_type": "default", **scaling,
                                                                "rope_theta": a.rope_theta},
        attn_config=dict(ATTN, clip_qkv=a.clip_qkv, kv_n_heads=a.kv_heads, rope_theta=a.rope_theta),
        ffn_config=dict(FFN, ffn_act_fn={"name": "silu"}, ffn_hidden_size=a.expert_size,
                        moe_num_experts=m.num_local_experts, moe_top_k=m.num_experts_per_tok,
                        moe_jitter_eps=m.router_jitter_noise or None, moe_loss_weight=m.router_aux_loss_coef,
                        moe_normalize_expert_weights=1.0 if m.norm_topk_prob else None, hidden_size=a.hidden_size))


def global_weights(a) -> list[Weight]:
    return [Weight(("embed", "embedding"), PREFIX + "wte.weight"),
            Weight(("final_norm", "scale"), PREFIX + "norm_f.weight"),
            Weight(("lm_head", "kernel"), "lm_head.weight", "linear")]


def layer_weights(a, spec) -> list[Weight]:
    """The norms and fused attention under ``norm_attn_norm``, the router and merged experts under ``ffn``."""
    h, heads = LAYER + "norm_attn_norm.", (a.num_attention_heads, a.kv_heads, a.kv_heads)
    out = [Weight(("attn_norm", "scale"), h + "norm_1.weight"), Weight(("mlp_norm", "scale"), h + "norm_2.weight"),
           Weight(("attn", "o", "kernel"), h + "attn.out_proj.weight", "linear", n_in=2)]
    out += [Weight(("attn", n, "kernel"), h + "attn.Wqkv.weight", "linear", part=(j, 3), widths=heads)
            for j, n in enumerate("qkv")]
    if spec.mlp != MOE:
        raise HFError("DBRX has a MoE in every layer (mlp_layer_types)")
    merged = dict(experts=a.moe.num_local_experts, stacked_experts=True, merged_experts=True)
    x = LAYER + "ffn."
    return out + [Weight(("moe", "router", "kernel"), x + "router.layer.weight", "linear"),
                  Weight(("moe", "wi_gate"), x + "experts.mlp.w1", "linear", **merged),
                  Weight(("moe", "wi_up"), x + "experts.mlp.v1", "linear", **merged),
                  Weight(("moe", "wo"), x + "experts.mlp.w2", **merged)]


# databricks/dbrx-base (and -instruct)/config.json: 40 layers of 6144, 48 heads of 128 (8 kv heads),
# q/k/v clipped at 8, rotary base 500000; 16 experts 10752 wide, top-4, renormalised
BASE = dict(vocab_size=100352, hidden_size=6144, intermediate_size=10752, num_hidden_layers=40,
            num_attention_heads=48, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=EPS,
            rope_theta=500000.0, norm_type="layernorm_no_bias", clip_qkv=8.0, num_local_experts=16,
            num_experts_per_tok=4, router_aux_loss_coef=0.05, router_z_loss_coef=0.0, bos_token_id=None,
            eos_token_id=None)
DBRX = Family(
    "dbrx", ("dbrx",), "DbrxForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights, layer_weights,
    execution=mixtral.HF_MOE,
    presets={"dbrx-132b": BASE,
             "dbrx-tiny": mixtral.MIXTRAL.presets["mixtral-tiny"] | dict(
                 norm_type="layernorm_no_bias", rms_norm_eps=EPS, clip_qkv=8.0, intermediate_size=64,
                 rope_theta=500000.0)})
