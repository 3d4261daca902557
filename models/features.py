"""Features: the named mechanisms an architecture uses, read off its record's fields.

Each field of an architecture record may belong to a feature (``feature(default, name)``):
``name`` is a string (the feature is used when the field differs from its default), a dict
from values to feature names (an enumeration whose every value is a mechanism: ``norm_type``),
or a function of the value (``rope_scaling``: its type). A Hugging Face family declares the
features it expresses; exporting a config that uses one it does not declare is refused, naming
the fields (``models/hf/registry.py``). No family lists what it cannot do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

FEATURE = "shardzoo_feature"

# Every feature, and what it is (the names families declare; README lists them).
FEATURES = {
    "rope": "rotary position embeddings (rope_theta)",
    "learned_positions": "a learned position table (GPT-2)",
    "sinusoidal_positions": "fixed sinusoidal position embeddings added to the token embeddings (XGLM)",
    "position_offset": "the position table read at position + position_offset (OPT, XGLM: 2)",
    "alibi": "ALiBi: no position embedding, each head's attention logits biased by slope x (key - query "
             "position) (BLOOM, MPT)",
    "embedding_norm": "a norm of the token embeddings before the first layer (BLOOM)",
    "no_first_attn_norm": "the first layer's attention reads its input without a pre-norm of its own (ModernBERT's "
                          "decoder: the embeddings' norm serves)",
    "head_transform": "the output head reads norm(act(x @ dense)) (ModernBERT's prediction head)",
    "partial_rotary": "rotary embeddings on a fraction of each head (partial_rotary_factor)",
    "local_rope": "a second rotary base for local (sliding) layers (rope_local_base_freq)",
    "nope_layers": "layers without rotary embeddings (NoPE) among rotary ones (rope_layers: SmolLM3, EXAONE 4)",
    "rmsnorm": "RMSNorm", "rmsnorm_plus_one": "RMSNorm scaled by (1 + weight) (Gemma)",
    "rmsnorm_no_weight": "RMSNorm without weight (nanochat)",
    "layernorm": "LayerNorm with bias", "layernorm_no_bias": "LayerNorm without bias (Cohere)",
    "layernorm_plus_one": "LayerNorm with bias scaled by (1 + weight) (Nemotron's LayerNorm1P)",
    "layernorm_no_weight": "LayerNorm without weight or bias (OLMo 1)",
    "pre_norms": "norms before attention and MLP", "post_norms": "norms after attention and MLP (OLMo 2)",
    "sandwich_norms": "norms before and after attention and MLP (Gemma 2/3)",
    "norm_position_pattern": "per-layer norm positions (norm_positions: OLMo hybrid's post-norm attention layers "
                             "beside pre-norm Gated DeltaNet layers)",
    "qk_norm_head": "a norm of each query/key head (one weight for all heads)",
    "qk_norm_heads": "a norm of each query/key head, with a weight per head (Cohere)",
    "qk_norm_projection": "a norm of the whole q/k projection",
    "parallel_residual": "attention and MLP side by side from one norm: x + attn(n) + mlp(n) (block_form parallel: "
                         "Phi, Cohere)",
    "parallel_two_norms": "attention and MLP side by side, each from its own norm: x + attn(n1) + mlp(n2) "
                          "(block_form parallel_two_norms: GPT-NeoX, Falcon-40B)",
    "post_residual_norms": "the norms on the residual stream after each addition: norm(x + attn(x)), norm(x + "
                           "mlp(x)), no final norm (block_form post_residual: GPT-1)",
    "shortcut_moe": "layers of two pre-norm halves (attention, dense MLP) and a MoE of the first half's normed MLP "
                    "input added after the second (block_form shortcut_moe: LongCat-Flash)",
    "clip_qkv": "q, k and v clipped to [-clip_qkv, clip_qkv] after their projections (OLMo 1, MPT)",
    "rope_interleaved": "rotary embeddings turning interleaved pairs (2i, 2i+1) (Cohere, DeepSeek)",
    "lm_head_bias": "a bias on the output head (Phi)", "logit_scale": "logits multiplied by logit_scale (Cohere)",
    "qk_norm_after_rope": "the q/k norm applied after the rotary embedding (HunYuan), not before",
    "qk_norm_no_bias": "the q/k norm a LayerNorm without bias where the model's LayerNorms have one (StableLM)",
    "attention_bias": "q/k/v biases", "attention_out_bias": "output projection bias",
    "attention_out_bias_layers": "an output projection bias on some layers only (attention_out_bias_layers: "
                                 "GPT-NeoX-Japanese's last layer)", "mlp_bias": "MLP biases",
    "gated_mlp": "gated MLP (SwiGLU, GeGLU)",
    "xielu": "the xIELU activation (hidden_act=xielu) with learned alpha_p, alpha_n (through softplus), beta and eps "
             "per layer's MLP (Apertus)", "plain_mlp": "plain MLP (up, activation, down)",
    "sliding_window": "sliding-window attention", "layer_pattern": "per-layer attention kinds (layer_types)",
    "query_pre_attn_scalar": "attention scale from query_pre_attn_scalar (Gemma 2/3)",
    "attention_softcap": "soft-capped attention logits",
    "attention_sinks": "a learned logit per head in the softmax's denominator (attention sinks: GPT-OSS)",
    "final_softcap": "soft-capped output logits",
    "scale_embeddings": "embeddings scaled by sqrt(hidden_size) (Gemma)",
    "multipliers": "embedding, residual, attention and logits multipliers (Granite)",
    "moe": "Mixture-of-Experts MLPs", "moe_pattern": "dense and MoE layers mixed (mlp_layer_types)",
    "expert_width": "experts of their own width (moe_intermediate_size)",
    "zero_experts": "zero-computation experts beside the routed ones: chosen by the router like them, each returns "
                    "its input times its weight (zero_expert_num: LongCat-Flash)",
    "router_jitter": "router input jitter while training",
    "shared_experts": "a dense MLP beside the routed experts (shared_expert_intermediate_size)",
    "shared_expert_gate": "the shared expert's output scaled by sigmoid(x . w) (Qwen2-MoE)",
    "group_limited_router": "top-k within the best topk_group of n_group expert groups (DeepSeek-V2)",
    "sigmoid_router": "sigmoid router scores with a correction bias for the choice, group-limited (DeepSeek-V3)",
    "routed_scaling": "the routed experts' weights scaled by routed_scaling_factor (DeepSeek)",
    "router_bias": "a bias on the router's logits (GPT-OSS)",
    "expert_bias": "biases on the experts' gate, up and down projections (GPT-OSS)",
    "plain_experts": "routed experts without a gate: act(x @ up) @ down (expert_type plain: Nemotron-H)",
    "clamped_swiglu": "the experts' clamped SwiGLU: (clip(up) + 1) * g * sigmoid(alpha g), g = min(gate, "
                      "swiglu_limit) (GPT-OSS)",
    "chunked_attention": "attention within chunks of attention_chunk_size tokens (chunked_attention layers: "
                         "Llama 4)",
    "attention_temperature": "queries of the NoPE layers scaled by 1 + attn_scale * log(1 + floor((p + 1) / "
                             "floor_scale)) (Llama 4's attn_temperature_tuning)",
    "llama_4_scaling": "queries of every layer scaled by 1 + beta * log(1 + floor(p / "
                       "original_max_position_embeddings)) (Ministral 3's llama_4_scaling_beta)",
    "qk_norm_l2": "queries and keys of the rotary layers RMS-normalised per head without a weight (Llama 4)",
    "biased_softmax_router": "top-k of the softmax plus a correction bias, weighted by the unbiased probabilities "
                             "(Ernie 4.5 MoE)",
    "sparsemixer_router": "SparseMixer's top-2 (Phi-MoE): the best expert, then the best of the rest, each weighted "
                          "by a softmax over the logits within a relative 2 x sparsemixer_eps of its own",
    "sigmoid_topk_router": "top-k of the sigmoid router scores, no correction bias, no groups (Flint)",
    "moe_output_norm": "a norm of each MoE layer's output (routed and shared experts summed) before the residual "
                       "(A.X-K1's post_mlp_layernorm)",
    "layer_norm_eps": "the layers' norms with an epsilon of their own, the final norm with rms_norm_eps (JetMoE)",
    "moe_output_bias": "one bias on each MoE layer's output, the experts' weighted sum (JetMoE)",
    "mixture_of_attention": "a mixture of attention heads (moa layer_types: JetMoE): per token a router picks "
                            "num_experts_per_tok of num_experts query/output projection pairs, keys and values "
                            "shared",
    "biased_logit_router": "top-k of the router logits plus a correction bias, weighted by the sigmoid of the chosen "
                           "logits (Kolibri)",
    "input_scaled_router": "top-k of the router logits, each chosen expert's input scaled by the sigmoid of its "
                           "logit (Llama 4)",
    "short_conv": "gated short-convolution blocks beside attention (LFM2's conv layers of layer_types): "
                  "y = C * conv(B * x), a causal depthwise convolution of conv_kernel taps",
    "conv_bias": "biases on the short convolution's projections and taps (conv_bias)",
    "mamba2": "Mamba2 state-space mixers (the mamba layers of layer_types): in_proj to z, x, B, C, dt; a causal "
              "conv of x, B, C; the selective scan (chunked for training, a recurrence for decoding); the gated "
              "RMSNorm; out_proj (mamba_num_heads, mamba_head_dim, mamba_n_groups, ssm_state_size, ...)",
    "mamba_proj_bias": "biases on the mamba mixers' in_proj and out_proj (mamba_proj_bias)",
    "time_step_limit": "the mamba mixers' dt clamped to time_step_limit (other than [0, inf])",
    "mamba_norm_before_gate": "the mamba mixers' output RMSNorm'd before the gate: RMSNorm(y) * silu(z) "
                              "(Falcon-H1's mamba_norm_before_gate)",
    "mamba_no_norm": "the mamba mixers' output gated without a norm: y * silu(z) (Falcon-H1's mamba_rms_norm false)",
    "shared_block": "weight-shared attention + MLP blocks run at several layers on the stream beside the token "
                    "embeddings, each use with its own low-rank adapters and output projection, added to the next "
                    "mixer's input (Zamba2: models/shared_block.py)",
    "mup_multipliers": "muP multipliers (Falcon-H1): on the attention's input, keys and output, the mamba mixer's "
                       "input, in_proj outputs (z, x, B, C, dt) and output, the MLP's gate and output",
    "mamba1": "Mamba1 state-space mixers (the mamba1 layers of layer_types): in_proj to x, z; a causal conv of x; "
              "x_proj to dt, B, C; dt_proj; the selective scan with a decay per channel and state entry (chunked "
              "for training, a recurrence for decoding); y * silu(z); out_proj",
    "mamba1_bcdt_norm": "the Mamba1 mixers' dt, B and C RMS-normalised without weights (Falcon-Mamba's "
                        "mixer_rms_eps)",
    "mamba1_bcdt_norm_weights": "those norms of dt, B and C with weights (Jamba's dt_layernorm, b_layernorm, "
                                "c_layernorm)",
    "rglru": "RecurrentGemma's recurrent blocks (the recurrent layers of layer_types): gelu(linear_y(h)) times "
             "linear_x(h) through a causal depthwise conv and the RG-LRU (block-diagonal input and recurrence gates, "
             "a decay per channel; an associative scan for training, the recurrence for decoding), then linear_out "
             "(lru_width, conv1d_width)",
    "mlp_free_layers": "layers without an MLP (mlp_layer_types 'none': Mamba2, Nemotron-H)",
    "kimi_delta": "Kimi delta attention blocks (Kimi-Linear's linear_attention layers: the kimi_delta layers of "
                  "layer_types): Gated DeltaNet with a decay per key channel, low-rank decay and output-gate "
                  "projections, a sigmoid-gated norm",
    "kda_full_rank_gate": "KDA's decay and output-gate projections each one hidden -> heads x head_dim matrix, not "
                          "low-rank pairs (Ling's bailing_hybrid)",
    "kda_gate_lower_bound": "KDA's log decay lower_bound * sigmoid(exp(A_log) (f + dt_bias)) (fla's safe gate: "
                            "Ling's kda_lower_bound)",
    "attention_head_gate": "attention's output times sigmoid(x . w) per head, a scalar gate of each head projected "
                           "from the layer's input (Ling's head-wise gated attention, LFM3's use_attention_gate)",
    "gated_deltanet": "Gated DeltaNet blocks beside attention (Qwen3-Next's linear_attention layers of "
                      "layer_types): a convolution of q, k, v and the gated delta rule, a recurrent state per head",
    "sub_norms": "a norm of attention's output before its o projection and of the MLP's hidden features before its "
                 "down projection (BitNet's subln: sub_norms)",
    "bitlinear": "attention's and the MLP's projections through BitLinear: weights ternary times their mean |w|, "
                 "inputs 8-bit per token by their largest |x|, straight-through gradients (BitNet b1.58's online "
                 "quantization: bitlinear)",
    "differential_attention": "differential attention: two softmaxes' difference over paired value heads, "
                              "RMS-normalised per head pair (diff_attention: DiffLlama)",
    "delta_negative_eigenvalues": "the Gated DeltaNet's rate beta = 2 sigmoid(b), in [0, 2] (OLMo hybrid's "
                                  "linear_allow_neg_eigval)",
    "delta_norm_eps": "the Gated DeltaNet's gated norm with its own epsilon (linear_norm_eps; OLMo hybrid: 1e-5)",
    "attention_output_gate": "attention's output times the sigmoid of a gate projected with the queries "
                             "(Qwen3-Next)",
    "scaled_router": "the router's input RMS-normalised without a weight, times a learned vector and "
                     "1/sqrt(hidden_size); each chosen expert's weight times its learned scale (Gemma 4)",
    "moe_beside_dense": "a dense MLP and the routed experts side by side, each between norms of its own, the "
                        "router reading the residual stream (mlp_layer_types dense_and_moe: Gemma 4's MoE block)",
    "v_norm": "the values RMS-normalised per head without a weight (Gemma 4)",
    "attention_k_eq_v": "keys serve as values: one projection for both (attention_k_eq_v)",
    "global_attention": "the full-attention layers with a head size, key/value heads, keys-as-values and sinks of "
                        "their own (Gemma 4's global_head_dim, num_global_key_value_heads, attention_k_eq_v; "
                        "MiMo-V2-Flash's)",
    "value_heads": "values shaped apart from the queries and keys: their own head width and a scale "
                   "(MiMo-V2-Flash's v_head_dim, attention_value_scale)",
    "layer_scalar": "each layer's output times a fixed scalar of its own (Gemma 4's layer_scalar)",
    "rope_scaling:proportional": "Gemma 4's proportional rotary: the first partial_rotary_factor of the pairs turn "
                                 "at the whole head's frequencies, the rest not at all",
    "latent_lora_scaling": "latent attention's queries times sqrt(hidden_size / q_lora_rank) and its normed kv "
                           "latent times sqrt(hidden_size / kv_lora_rank) (LongCat-Flash's mla_scale_q_lora, "
                           "mla_scale_kv_lora)",
    "latent_attention": "multi-head latent attention: keys and values from a compressed latent (DeepSeek, "
                        "kv_lora_rank)",
    "gemma3n_layers": "Gemma 3n's layer mechanisms (the per_layer record, models/per_layer.py): layers unrolled",
    "per_layer_inputs": "per-layer input embeddings: a table row per layer and token plus a normed projection of "
                        "the embeddings, gated by each layer's output and added back (hidden_size_per_layer_input)",
    "kv_sharing": "the last num_kv_shared_layers layers attend the keys and values of the last earlier layer of "
                  "their attention kind (Gemma 3n)",
    "altup": "AltUp: altup_num_inputs parallel residual streams, predicted from each other by routed coefficients "
             "before each layer and corrected by its output after (Gemma 3n)",
    "laurel": "Laurel: a low-rank residual branch (laurel_rank) beside attention, averaged in (Gemma 3n)",
    "activation_sparsity": "the MLP's gate minus its mean + std x the normal quantile of the layer's share, "
                           "through relu (Gemma 3n's activation_sparsity_pattern)",
    "sparse_attention": "DeepSeek Sparse Attention: a lightning indexer beside latent attention picks each query's "
                        "index_topk keys (DeepSeek-V3.2, GLM-5; index_n_heads, index_head_dim)",
}


def feature(default, name: str | dict | Callable):
    """A dataclass field of ``default`` belonging to feature ``name`` (see the module doc)."""
    return dataclasses.field(default=default, metadata={FEATURE: name})


def used_features(record) -> dict[str, list[str]]:
    """``{feature: ["field=value", ...]}`` of the features ``record`` uses."""
    used: dict[str, list[str]] = {}
    for f in dataclasses.fields(record):
        kind = f.metadata.get(FEATURE)
        if kind is None:
            continue
        value = getattr(record, f.name)
        if isinstance(kind, str):
            name = kind if value != f.default else None
        elif isinstance(kind, dict):
            name = kind.get(value)
        else:
            name = kind(value)
        sub = dataclasses.is_dataclass(value)  # a sub-record: shown by its fields' flat names
        if name is not None:
            used.setdefault(name, []).extend(_record_fields(f.name, value) if sub else [f"{f.name}={_shown(value)}"])
        if sub:  # and its own fields' features
            names = getattr(value, "FLAT", {})
            for inner, fields in used_features(value).items():
                flat = {v: k for k, v in names.items()}
                used.setdefault(inner, []).extend(flat.get(shown.split("=")[0], f"{f.name}." + shown.split("=")[0])
                                                  + "=" + shown.split("=", 1)[1] for shown in fields)
    return used


def _record_fields(name: str, record) -> list[str]:
    """A sub-record's fields away from their defaults, by their flat names ("name=true" if none)."""
    default = type(record)()
    shown = [f"{flat}={_shown(getattr(record, field))}" for flat, field in getattr(record, "FLAT", {}).items()
             if getattr(record, field) != getattr(default, field)]
    return shown or [f"{name}=true"]


def _shown(value) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):  # sorted pairs: a dict
        return repr(dict(value))
    return repr(list(value)) if isinstance(value, tuple) else repr(value)
