"""Zamba2 (Zyphra): Mamba2 layers (no MLP), and at the "hybrid" layers of ``layers_block_type``
a weight-shared attention + MLP block (``num_mem_blocks`` of them in turn) reading the stream
beside the original embeddings, its output added to that layer's mamba input
(``models/shared_block.py``). Attention heads are 2 x hidden_size / heads wide, the logits
scaled by (head_dim / 2)^-0.5; the MLP's gate|up has a per-use low-rank adapter always, q, k, v
with ``use_shared_attention_adapter``; rotary with ``use_mem_rope``. The mamba mixer is
transformers' Bamba mixer: conv bias always, dt clamped below at ``time_step_min``, its gated
norm's epsilon fixed at 1e-5.

transformers stores block b once, under the first hybrid layer that runs it (the others are
tied), with the adapters of every use of b; each hybrid layer's own ``linear`` and its mamba
under ``mamba_decoder``.
"""

from __future__ import annotations

import math

from shardzoo.models.arch import MAMBA
from shardzoo.models.components import NONE
from shardzoo.models.hf import llama, mamba2
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, rope, rope_to_hf, sizes

# Zamba2Config's fields (and the derived ones its config.json also holds) with transformers' defaults
SCHEMA = dict(vocab_size=32000, max_position_embeddings=4096, hidden_size=2560, num_hidden_layers=54,
              layers_block_type=None, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
              time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, n_mamba_heads=8, use_mamba_kernels=True,
              use_conv_bias=True, chunk_size=256, use_mem_eff_path=False, add_bias_linear=False, intermediate_size=None,
              hidden_act="gelu", num_attention_heads=32, num_key_value_heads=None, attention_dropout=0.0,
              num_mem_blocks=1, use_shared_attention_adapter=False, adapter_rank=128, use_mem_rope=False,
              rope_parameters=None, initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, num_logits_to_keep=1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, use_long_context=False, tie_word_embeddings=True,
              attention_hidden_size=None, attention_head_dim=None, mamba_headdim=None, kv_channels=None,
              num_query_groups=None, hybrid_layer_ids=None)
FEATURES = llama.ROTARY | {"mamba2", "time_step_limit", "mlp_free_layers", "layer_pattern", "shared_block",
                          "query_pre_attn_scalar"}
MAMBA_TYPES, HYBRID = ("mamba", "linear_attention"), "hybrid"


def from_hf(hf: HFConfig) -> dict:
    hf.ignore(*INERT, "num_logits_to_keep", "use_mamba_kernels", "use_mem_eff_path", "time_step_max",
              "time_step_floor", "use_conv_bias", "attention_hidden_size", "attention_head_dim", "mamba_headdim",
              "kv_channels", "num_query_groups", "hybrid_layer_ids")  # init only, kernels, or derived
    for key, why in (("add_bias_linear", "biases on the mamba and shared MLP projections are not implemented"),
                     ("use_long_context", "the long-context rotary variant is not implemented")):
        if hf.get(key):
            raise hf.refuse(key, why)
    if hf.get("rms_norm_eps") != 1e-5:
        raise hf.refuse("rms_norm_eps", "the mamba mixers' gated norm has epsilon 1e-5; the model's norms share it")
    out = sizes(hf) | rope(hf)
    d, heads = out["hidden_size"], out["num_attention_heads"]
    out["intermediate_size"] = out["intermediate_size"] or 4 * d
    out["head_dim"] = 2 * d // heads
    out["query_pre_attn_scalar"] = out["head_dim"] / 2
    n, types = out["num_hidden_layers"], hf.get("layers_block_type")
    if types is None or len(types) != n or any(t not in (*MAMBA_TYPES, HYBRID) for t in types):
        raise hf.refuse("layers_block_type", f"must name {n} layers, each mamba (linear_attention) or hybrid")
    mheads, expand = hf.get("n_mamba_heads"), hf.get("mamba_expand")
    if expand * d % mheads:
        raise hf.refuse("n_mamba_heads", f"must divide mamba_expand x hidden_size = {expand * d}")
    return out | dict(
        layer_types=(MAMBA,) * n, mlp_layer_types=(NONE,) * n, mamba_num_heads=mheads,
        mamba_head_dim=expand * d // mheads, mamba_n_groups=hf.get("mamba_ngroups"), ssm_state_size=hf.get("mamba_d_state"),
        mamba_conv_kernel=hf.get("mamba_d_conv"), mamba_chunk_size=hf.get("chunk_size"), mamba_conv_bias=True,
        mamba_proj_bias=False, time_step_limit=(hf.get("time_step_min"), math.inf),
        shared_block_layers=tuple(i for i, t in enumerate(types) if t == HYBRID),
        num_mem_blocks=hf.get("num_mem_blocks"), adapter_rank=hf.get("adapter_rank"),
        use_shared_attention_adapter=hf.get("use_shared_attention_adapter"), use_mem_rope=hf.get("use_mem_rope"))


def to_hf(a) -> dict:
    s, hybrid = a.shared_block, set(a.shared_block.layers)
    return dict(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
                num_key_value_heads=a.kv_heads, max_position_embeddings=a.max_position_embeddings,
                rms_norm_eps=a.rms_norm_eps, hidden_act=a.hidden_act,
                layers_block_type=[HYBRID if i in hybrid else "mamba" for i in range(a.num_hidden_layers)],
                mamba_d_state=a.mamba.state_size, mamba_d_conv=a.mamba.conv_kernel,
                mamba_expand=a.mamba.inner // a.hidden_size, mamba_ngroups=a.mamba.n_groups,
                n_mamba_heads=a.mamba.num_heads, chunk_size=a.mamba.chunk_size,
                time_step_min=a.mamba.time_step_limit[0], num_mem_blocks=s.num_blocks, adapter_rank=s.adapter_rank,
                use_shared_attention_adapter=s.attention_adapters, use_mem_rope=s.rope) | rope_to_hf(a)


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "model.embed_tokens.weight"),
           Weight(("final_norm", "scale"), "model.final_layernorm.weight")]
    if not a.tie_word_embeddings:
        out.append(Weight(("lm_head", "kernel"), "lm_head.weight", "linear"))
    s = a.shared_block
    for b in range(s.num_blocks):
        p, h = f"shared_{b}", f"model.layers.{s.layers[b]}.shared_transformer."
        out += [Weight((p, "attn_norm", "scale"), h + "input_layernorm.weight"),
                Weight((p, "mlp_norm", "scale"), h + "pre_ff_layernorm.weight"),
                Weight((p, "attn", "o", "kernel"), h + "self_attn.o_proj.weight", "linear", n_in=2),
                Weight((p, "down", "kernel"), h + "feed_forward.down_proj.weight", "linear")]
        out += [Weight((p, "attn", n, "kernel"), h + f"self_attn.{n}_proj.weight", "linear") for n in "qkv"]
        out += [Weight((p, n, "kernel"), h + "feed_forward.gate_up_proj.weight", "linear", part=(j, 2))
                for j, n in enumerate(("gate", "up"))]
        for k in range(b, len(s.layers), s.num_blocks):  # the uses of block b
            ad = h + f"feed_forward.gate_up_proj_adapter_list.{k}."
            out += [Weight((p, f"out_{k}", "kernel"), f"model.layers.{s.layers[k]}.linear.weight", "linear"),
                    Weight((p, f"mlp_adapter_{k}", "kernel"), ad + "0.weight", "linear")]
            out += [Weight((p, f"{n}_adapter_{k}", "kernel"), ad + "1.weight", "linear", part=(j, 2))
                    for j, n in enumerate(("gate", "up"))]
            if s.attention_adapters:
                out += [Weight((p, "attn", f"{n}_adapter_{k}_{ab}", "kernel"),
                               h + f"self_attn.linear_{n}_adapter_list.{k}.{j}.weight", "linear")
                        for n in "qkv" for j, ab in enumerate("ab")]
    return out


def layer_weights(a, spec) -> list[Weight]:
    h = llama.LAYER + ("mamba_decoder." if spec.shared is not None else "")
    return [Weight(("attn_norm", "scale"), h + "input_layernorm.weight")] + mamba2.mamba_weights(a, h + "mamba.")


# --------------------------------------------------------------------------------- presets
# Zamba2-7B: its config.json as published before transformers took the family in (transformers
# 4.43.0.dev0 key names, e.g. in NX-AI/mlstm_kernels' benchmark: ffn_hidden_size, lora_rank,
# state_size, conv_dimension, expansion_factor, use_shared_attention_lora false, mamba_headdim 64 so
# 2 x 3584 / 64 = 112 mamba heads); hidden_act and tie_word_embeddings it does not name: transformers'
# defaults. 81 layers: a shared block after 6 mamba layers, then after 4, then after every 5, 3 at the end.
_7B_HYBRID = (6, 11, *range(17, 78, 6))
ZAMBA2_7B = dict(
    vocab_size=32000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=81, num_attention_heads=32,
    head_dim=224, query_pre_attn_scalar=112.0, max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="gelu",
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, layer_types=(MAMBA,) * 81, mlp_layer_types=(NONE,) * 81,
    mamba_num_heads=112, mamba_head_dim=64, mamba_n_groups=2, ssm_state_size=64, mamba_conv_kernel=4,
    mamba_chunk_size=256, mamba_conv_bias=True, time_step_limit=(0.001, math.inf), shared_block_layers=_7B_HYBRID,
    num_mem_blocks=2, adapter_rank=128, use_mem_rope=True)
ZAMBA2 = Family("zamba2", ("zamba2",), "Zamba2ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf, global_weights,
                layer_weights, presets={"zamba2-7b": ZAMBA2_7B})
