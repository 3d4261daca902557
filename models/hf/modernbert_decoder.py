"""ModernBERT's decoder (``modernbert-decoder``): pre-LayerNorm layers (bias by ``norm_bias``)
whose first reads the embeddings' LayerNorm without one of its own (``first_attn_norm`` false),
full and sliding layers by ``layer_types`` (else every ``global_attn_every_n_layers``-th full,
from layer 0), each kind with its rotary base (``rope_parameters`` per kind: the sliding one as
``rope_local_base_freq``), a window of ``local_attention // 2`` (``sliding_window``), a GeGLU MLP
whose ``Wi`` holds the activated half first, and the prediction head (``lm_head``: dense,
``classifier_activation``, LayerNorm: ``head_transform``) before the ``decoder`` (tied to the
embeddings, with a bias by ``decoder_bias``). Refused: ``classifier_bias`` (the head's dense
without a bias only).
"""

from __future__ import annotations

from shardzoo.models.arch import FULL, SLIDING
from shardzoo.models.hf.base import (
    INERT,
    Family,
    HFConfig,
    HFError,
    Weight,
    layer_types,
    rope,
    special_tokens,
)

THETA_FULL, THETA_SLIDING = 160000.0, 10000.0  # transformers' default bases

# ModernBertDecoderConfig's fields and defaults (transformers 5.25); global_attn_every_n_layers,
# which it reads from config.json when layer_types is absent, and the bases older config.json files
# give without rope_parameters (global_rope_theta, local_rope_theta)
SCHEMA = dict(vocab_size=50368, hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12,
              hidden_activation="gelu", max_position_embeddings=8192, initializer_range=0.02,
              initializer_cutoff_factor=2.0, norm_eps=1e-5, norm_bias=False, pad_token_id=50283,
              eos_token_id=50282, bos_token_id=50281, cls_token_id=50281, sep_token_id=50282, attention_bias=False,
              attention_dropout=0.0, embedding_dropout=0.0, mlp_bias=False, mlp_dropout=0.0, decoder_bias=True,
              classifier_dropout=0.0, classifier_bias=False, classifier_activation="gelu", use_cache=True,
              local_attention=128, layer_types=None, tie_word_embeddings=True, rope_parameters=None,
              global_attn_every_n_layers=3, global_rope_theta=THETA_FULL, local_rope_theta=THETA_SLIDING)
FEATURES = frozenset({"rope", "rope_scaling:linear", "rope_scaling:llama3", "rope_scaling:yarn",
                      "rope_scaling:longrope", "rope_scaling:dynamic", "layernorm", "layernorm_no_bias", "pre_norms",
                      "gated_mlp", "attention_bias", "attention_out_bias", "mlp_bias", "sliding_window",
                      "layer_pattern", "local_rope", "embedding_norm", "no_first_attn_norm", "head_transform",
                      "lm_head_bias"})


def _types(hf: HFConfig) -> tuple[str, ...]:
    n, types, every = hf.get("num_hidden_layers"), hf.get("layer_types"), hf.get("global_attn_every_n_layers")
    if types is None:
        types = [SLIDING if i % every else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (FULL, SLIDING) for t in types):
        raise hf.refuse("layer_types", f"must list {FULL!r} or {SLIDING!r} for each of the {n} layers")
    return tuple(types)


def from_hf(hf: HFConfig) -> dict:
    hf.require("hidden_size", "num_hidden_layers", "num_attention_heads")
    hf.ignore(*INERT, "initializer_cutoff_factor", "cls_token_id", "sep_token_id", "embedding_dropout", "mlp_dropout",
              "classifier_dropout")
    types, local = _types(hf), hf.get("local_attention")
    params = hf.get("rope_parameters") or {}
    full = rope(hf, dict(params.get(FULL) or {}), theta=hf.get("global_rope_theta"))
    sliding = rope(hf, dict(params.get(SLIDING) or {}), theta=hf.get("local_rope_theta"))
    if sliding["rope_scaling"] is not None:
        raise hf.refuse("rope_parameters", "the sliding layers' rotary base is unscaled (rope_type default only)")
    if SLIDING in types and not local:
        raise hf.refuse("local_attention", f"layer_types has {SLIDING} layers but no window")
    bias, heads = hf.get("attention_bias"), hf.get("num_attention_heads")
    return special_tokens(hf) | dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"),
        intermediate_size=hf.get("intermediate_size"), num_hidden_layers=hf.get("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=hf.get("max_position_embeddings"),
        rms_norm_eps=hf.get("norm_eps"), initializer_range=hf.get("initializer_range"),
        hidden_act=hf.get("hidden_activation"), tie_word_embeddings=hf.get("tie_word_embeddings"),
        rope_theta=full["rope_theta"], rope_scaling=full["rope_scaling"], rope_local_base_freq=sliding["rope_theta"],
        norm_type="layernorm" if hf.get("norm_bias") else "layernorm_no_bias", attention_bias=bias,
        attention_out_bias=bias, mlp_bias=hf.get("mlp_bias"), lm_head_bias=hf.get("decoder_bias"),
        sliding_window=local // 2 if SLIDING in types else None, layer_types=types if SLIDING in types else None,
        embedding_norm=True, first_attn_norm=False, head_transform=hf.get("classifier_activation"))


def to_hf(a) -> dict:
    if not (a.embedding_norm and not a.first_attn_norm and a.head_transform and a.norm_type.startswith("layernorm")
            and a.attention_bias == a.attention_out_bias and a.kv_heads == a.num_attention_heads
            and a.head_size * a.num_attention_heads == a.hidden_size):
        raise HFError("ModernBERT's decoder has LayerNorms, the embeddings' norm in place of the first layer's, "
                      "the prediction head (head_transform), one bias flag for q/k/v/o and heads of "
                      "hidden_size / num_attention_heads, as many for keys and values")
    types = layer_types(a)
    scaling = dict(a.rope_scaling_dict)
    full = {"rope_type": "default", **scaling, "rope_theta": a.rope_theta}
    sliding = {"rope_type": "default", "rope_theta": a.rope_local_base_freq or a.rope_theta}
    window = a.sliding_window or 64
    return dict(
        hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads, hidden_activation=a.hidden_act,
        max_position_embeddings=a.max_position_embeddings, norm_eps=a.rms_norm_eps,
        norm_bias=a.norm_type == "layernorm", attention_bias=a.attention_bias, mlp_bias=a.mlp_bias,
        decoder_bias=a.lm_head_bias, classifier_activation=a.head_transform, layer_types=types,
        local_attention=2 * window, sliding_window=window,
        rope_parameters={FULL: full, SLIDING: sliding},
        # ints (no effect on the logits): the embedding's padding row, and the classifier's tokens as
        # transformers' defaults pair them, cls the bos token and sep the eos one
        pad_token_id=SCHEMA["pad_token_id"] if SCHEMA["pad_token_id"] < a.vocab_size else 0,
        cls_token_id=a.bos_token_id, sep_token_id=a.eos_token_id)


def _norm(path: tuple[str, ...], name: str, a) -> list[Weight]:
    out = [Weight((*path, "scale"), name + ".weight")]
    return out + ([Weight((*path, "bias"), name + ".bias", "vec")] if a.norm_type == "layernorm" else [])


def global_weights(a) -> list[Weight]:
    out = [Weight(("embed", "embedding"), "model.embeddings.tok_embeddings.weight"),
           *_norm(("embed_norm",), "model.embeddings.norm", a), *_norm(("final_norm",), "model.final_norm", a),
           Weight(("head_dense", "kernel"), "lm_head.dense.weight", "linear"), *_norm(("head_norm",), "lm_head.norm", a)]
    if not a.tie_word_embeddings:
        out.append(Weight(("lm_head", "kernel"), "decoder.weight", "linear"))
    if a.lm_head_bias:
        out.append(Weight(("lm_head", "bias") if not a.tie_word_embeddings else ("lm_head_bias",), "decoder.bias",
                          "vec"))
    return out


def layer_weights(a, spec) -> list[Weight]:
    """``attn_norm`` (not on the first layer), ``attn.{q,k,v}_proj``, ``attn.Wo``, ``mlp_norm``,
    ``mlp.Wi`` (the activated half, then the other) and ``mlp.Wo``."""
    h = "model.layers.{i}."
    out = (_norm(("attn_norm",), h + "attn_norm", a) if spec.attn_norm else []) + _norm(("mlp_norm",), h + "mlp_norm", a)
    projections = [(("attn", n), h + f"attn.{n}_proj", {}, a.attention_bias) for n in "qkv"]
    projections += [(("attn", "o"), h + "attn.Wo", dict(n_in=2), a.attention_bias),
                    (("mlp", "gate"), h + "mlp.Wi", dict(part=(0, 2)), a.mlp_bias),
                    (("mlp", "up"), h + "mlp.Wi", dict(part=(1, 2)), a.mlp_bias),
                    (("mlp", "down"), h + "mlp.Wo", {}, a.mlp_bias)]
    for path, name, kw, bias in projections:
        out.append(Weight((*path, "kernel"), name + ".weight", "linear", **kw))
        if bias:
            out.append(Weight((*path, "bias"), name + ".bias", "vec", part=kw.get("part", (0, 1))))
    return out


# full, sliding (a window of 8), full layers; bases 160k and 10k
_TINY_TYPES = (FULL, SLIDING, FULL)
MODERNBERT_DECODER = Family(
    "modernbert-decoder", ("modernbert-decoder",), "ModernBertDecoderForCausalLM", SCHEMA, FEATURES, from_hf,
    to_hf, global_weights, layer_weights,
    presets={"modernbert-decoder-tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=256, rms_norm_eps=1e-5, hidden_act="gelu", tie_word_embeddings=True,
        rope_theta=160000.0, rope_local_base_freq=10000.0, norm_type="layernorm_no_bias", lm_head_bias=True,
        sliding_window=8, layer_types=_TINY_TYPES, embedding_norm=True, first_attn_norm=False,
        head_transform="gelu", bos_token_id=1, eos_token_id=2)})
