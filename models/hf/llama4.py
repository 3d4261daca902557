"""Llama 4 text (``llama4_text``, Llama4ForCausalLM) and the text part of ``llama4``
(Llama4ForConditionalGeneration: its ``text_config``, the tensors under ``language_model.``).

Llama's layout with four mechanisms of the shared layers: chunked attention on the rotary
layers (``layer_types`` ``chunked_attention``, chunks of ``attention_chunk_size``; transformers'
default: every rotary layer when a chunk size is set); NoPE layers (``no_rope_layers``: 1
rotary, 0 none; default every ``no_rope_layer_interval``-th layer) whose queries are scaled by
the attention temperature (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``); the
weightless L2 qk-norm on the rotary layers (``use_qk_norm``); and MoE layers
(``moe_layers``, default every ``interleave_moe_layer_step``-th) of ``num_local_experts``
experts ``intermediate_size`` wide, with a top-k sigmoid router that scales each chosen
expert's input, and a shared expert as wide. Dense layers are ``intermediate_size_mlp`` wide
(shardzoo's ``intermediate_size``; the experts' is its ``moe_intermediate_size``). Rotary
embeddings turn interleaved pairs (transformers' complex multiply), in float32. HF's router
applies no jitter (``router_jitter_noise`` is inert) and drops no token.
"""

from __future__ import annotations

import dataclasses

from shardzoo.models.arch import CHUNKED, DENSE, FULL, MOE
from shardzoo.models.hf import llama, mixtral
from shardzoo.models.hf.base import INERT, Family, HFConfig, Weight, layer_types
from shardzoo.models.moe_arch import NO_MOE
from shardzoo.models.query_scaling import TemperatureTuning

THETA = 500000.0  # Llama4TextConfig's default_theta
# Llama4TextConfig's fields and defaults (transformers 5.25)
SCHEMA = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
              num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
              hidden_act="silu", max_position_embeddings=4096 * 32, initializer_range=0.02, rms_norm_eps=1e-5,
              use_cache=True, pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              attention_dropout=0.0, num_experts_per_tok=1, num_local_experts=16, moe_layers=None,
              interleave_moe_layer_step=1, use_qk_norm=True, output_router_logits=False,
              router_aux_loss_coef=0.001, router_jitter_noise=0.0, rope_parameters=None, no_rope_layers=None,
              no_rope_layer_interval=4, attention_chunk_size=8192, layer_types=None, attn_temperature_tuning=True,
              floor_scale=8192, attn_scale=0.1, attention_bias=False)
# Llama4Config's own fields (the vision tower and image tokens do not change the text model)
MM_SCHEMA = dict(vision_config=None, text_config=None, boi_token_index=200080, eoi_token_index=200081,
                 image_token_index=200092, tie_word_embeddings=False)
FEATURES = (llama.ROTARY | {"attention_bias", "attention_out_bias", "rope_interleaved", "nope_layers",
                            "layer_pattern", "chunked_attention", "attention_temperature", "qk_norm_l2", "moe",
                            "moe_pattern", "expert_width", "shared_experts", "input_scaled_router"})


def _int_list(hf: HFConfig, key: str, n: int, allowed=None) -> list[int]:
    value = hf.get(key)
    if not isinstance(value, list) or any(not isinstance(v, int) or isinstance(v, bool) for v in value) or (
            allowed is not None and (len(value) < n or any(v not in allowed for v in value))):
        raise hf.refuse(key, f"must be a list of integers{'' if allowed is None else f' in {allowed}, one per layer'}")
    return value


def from_hf(hf: HFConfig) -> dict:
    n = hf.get("num_hidden_layers")
    hf.ignore(*INERT, "router_jitter_noise", "no_rope_layer_interval", "interleave_moe_layer_step")
    rotates = hf.get("no_rope_layers") or None  # transformers: an empty list means the default
    if rotates is None:
        interval = hf.get("no_rope_layer_interval")
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise hf.refuse("no_rope_layer_interval", "must be an integer >= 1")
        rotates = [int((i + 1) % interval != 0) for i in range(n)]
    else:
        rotates = _int_list(hf, "no_rope_layers", n, (0, 1))[:n]
    chunk = hf.get("attention_chunk_size")
    types = hf.get("layer_types")
    if types is None:
        types = [CHUNKED if r and chunk is not None else FULL for r in rotates]
    moe = hf.get("moe_layers")
    if moe is None:
        step = hf.get("interleave_moe_layer_step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise hf.refuse("interleave_moe_layer_step", "must be an integer >= 1")
        moe = list(range(step - 1, n, step))
    else:
        moe = _int_list(hf, "moe_layers", n)
    experts = hf.get("num_local_experts")
    if moe and not experts:
        raise hf.refuse("num_local_experts", f"moe_layers {moe} need experts")
    bias = hf.get("attention_bias")  # q/k/v and o alike
    out = llama.rotary_fields(hf, theta=THETA) | dict(
        intermediate_size=hf.get("intermediate_size_mlp"), moe_intermediate_size=hf.get("intermediate_size"),
        shared_expert_intermediate_size=hf.get("intermediate_size") if moe else 0,
        num_local_experts=experts if moe else 0, num_experts_per_tok=hf.get("num_experts_per_tok"),
        mlp_layer_types=tuple(MOE if i in moe else DENSE for i in range(n)), router_kind="sigmoid_input",
        norm_topk_prob=False, router_aux_loss_coef=hf.get("router_aux_loss_coef"),
        attention_bias=bias, attention_out_bias=bias, rope_interleaved=True,
        rope_layers=tuple(bool(r) for r in rotates), layer_types=tuple(types),
        attention_chunk_size=chunk if CHUNKED in types else None,
        qk_norm="l2" if hf.get("use_qk_norm") else "none",
        attn_temperature_tuning=bool(hf.get("attn_temperature_tuning")),  # the published config says 4
        floor_scale=float(hf.get("floor_scale")), attn_scale=float(hf.get("attn_scale")))
    return out


def _interval(fits, n: int, default: int):
    """The interval that gives this list (transformers' default first), if any."""
    return next((k for k in (default, *range(1, n + 2)) if fits(k)), None)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    specs, n = a.layer_specs(), a.num_hidden_layers
    moe = [i for i, s in enumerate(specs) if s.mlp == MOE]
    rotates = [int(s.rope != "none") for s in specs]
    step = _interval(lambda k: list(range(k - 1, n, k)) == moe, n, 1)
    interval = _interval(lambda k: [int((i + 1) % k != 0) for i in range(n)] == rotates, n, 4)
    tuning = a.attn_temperature_tuning
    t = tuning or TemperatureTuning()
    out = llama.rotary_to_hf(a) | dict(
        intermediate_size_mlp=a.intermediate_size, intermediate_size=a.expert_size,
        num_local_experts=m.num_local_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_layers=moe, router_aux_loss_coef=m.router_aux_loss_coef,
        attention_bias=a.attention_bias, no_rope_layers=rotates,
        layer_types=layer_types(a), attention_chunk_size=a.attention_chunk_size,
        use_qk_norm=a.qk_norm == "l2", attn_temperature_tuning=bool(tuning),
        floor_scale=int(t.floor_scale) if float(t.floor_scale).is_integer() else t.floor_scale,  # HF: an int
        attn_scale=t.attn_scale)
    if step is not None:  # what moe_layers would default to; no_rope_layers' likewise
        out["interleave_moe_layer_step"] = step
    if interval is not None:
        out["no_rope_layer_interval"] = interval
    return out


# --------------------------------------------------------------------------------- weights
def _named(ws: list[Weight], prefix: str) -> list[Weight]:
    return [dataclasses.replace(w, name=prefix + w.name) for w in ws] if prefix else ws


def global_weights(a, prefix: str = "") -> list[Weight]:
    return _named(llama.global_weights(a), prefix)


def layer_weights(a, spec, prefix: str = "") -> list[Weight]:
    """A dense layer: Llama's with the MLP under ``feed_forward.``; a MoE layer: the router,
    the stacked experts as HF stores them (``gate_up_proj`` [expert, hidden, 2 x width],
    ``down_proj`` [expert, width, hidden]) and the shared expert."""
    x = llama.LAYER + "feed_forward."
    ws = llama.attention_weights(a)
    if spec.mlp != MOE:
        return _named(ws + llama.mlp_weights(a, "feed_forward."), prefix)
    e = a.moe.num_local_experts
    stacked = dict(op="conv1d", experts=e, stacked_experts=True)
    ws += [Weight(("moe", "router", "kernel"), x + "router.weight", "linear"),
           Weight(("moe", "wi_gate"), x + "experts.gate_up_proj", part=(0, 2), **stacked),
           Weight(("moe", "wi_up"), x + "experts.gate_up_proj", part=(1, 2), **stacked),
           Weight(("moe", "wo"), x + "experts.down_proj", **stacked)]
    ws += [Weight(("shared_expert", n, "kernel"), x + f"shared_expert.{n}_proj.weight", "linear")
           for n in ("gate", "up", "down")]
    return _named(ws, prefix)


# ------------------------------------------------------------------ llama4: the text part
LM = "language_model."


def mm_from_hf(hf: HFConfig) -> dict:
    """The ``text_config`` of a ``llama4`` config.json, read as ``llama4_text``."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise hf.refuse("text_config", "a llama4 config.json needs its text_config (a mapping)")
    hf.ignore("vision_config", "boi_token_index", "eoi_token_index", "image_token_index", "tie_word_embeddings")
    view = HFConfig(text, LLAMA4, f"{hf.where}: text_config")
    fields = from_hf(view)
    view.finish()
    return fields


def mm_to_hf(a) -> dict:
    eos = list(a.eos_token_id) if isinstance(a.eos_token_id, tuple) else a.eos_token_id
    text = dict(model_type="llama4_text", vocab_size=a.vocab_size, bos_token_id=a.bos_token_id, eos_token_id=eos,
                tie_word_embeddings=a.tie_word_embeddings, initializer_range=a.initializer_range) | to_hf(a)
    return dict(text_config=text)


# meta-llama/Llama-4-Scout-17B-16E(-Instruct)/config.json's text_config: 16 experts top-1 in
# every layer, every 4th layer NoPE (the others chunked by 8192, qk-normed), llama3 rope x16.
SCOUT = dict(vocab_size=202048, hidden_size=5120, intermediate_size=16384, moe_intermediate_size=8192,
             shared_expert_intermediate_size=8192, num_hidden_layers=48, num_attention_heads=40,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=10485760, rms_norm_eps=1e-5,
             rope_theta=500000.0, rope_interleaved=True, bos_token_id=200000, eos_token_id=(200001, 200007, 200008),
             rope_scaling=dict(rope_type="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                               original_max_position_embeddings=8192),
             rope_layers=tuple((i + 1) % 4 != 0 for i in range(48)), attention_chunk_size=8192,
             layer_types=tuple(CHUNKED if (i + 1) % 4 else FULL for i in range(48)), qk_norm="l2",
             attn_temperature_tuning=True, floor_scale=8192.0, attn_scale=0.1, num_local_experts=16,
             num_experts_per_tok=1, router_kind="sigmoid_input", norm_topk_prob=False, router_aux_loss_coef=0.001)
# 4 layers: layer 3 NoPE (temperature-tuned, full attention), 0-2 chunked by 4 with the L2
# qk-norm; layers 1 and 3 MoE (4 experts top-1 and a shared expert), 0 and 2 dense
TINY = SCOUT | llama.TINY | dict(
    num_hidden_layers=4, head_dim=None, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_local_experts=4, max_position_embeddings=256, rope_scaling=None, attention_chunk_size=4,
    rope_layers=(True, True, True, False), layer_types=(CHUNKED, CHUNKED, CHUNKED, FULL), floor_scale=4.0,
    mlp_layer_types=(DENSE, MOE, DENSE, MOE), bos_token_id=None, eos_token_id=None)

LLAMA4 = Family(
    "llama4_text", ("llama4_text",), "Llama4ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"llama-4-scout-17b-16e": SCOUT, "llama4-tiny": TINY})
LLAMA4_MM = Family(
    "llama4", ("llama4",), "Llama4ForConditionalGeneration", MM_SCHEMA, FEATURES, mm_from_hf, mm_to_hf,
    lambda a: global_weights(a, LM), lambda a, spec: layer_weights(a, spec, LM), execution=mixtral.HF_MOE)
