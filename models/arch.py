"""The architecture record of a decoder Transformer: what a checkpoint is, field for field.

``TransformerArch`` mirrors the ``config.json`` of the Hugging Face families (their field names
and meanings; where families name one thing differently it has one canonical form here, that
each family maps both ways). It says nothing of how the model runs (dtypes, scan, remat, MoE
dispatch, LoRA: ``models/execution.py``). Every field that switches a mechanism on belongs to a
feature (``models/features.py``).

Layer patterns are data: ``layer_types`` gives each layer's attention kind (Hugging Face's
names), ``mlp_layer_types`` each layer's MLP kind, ``rope_layers`` which layers rotate (the
others have no positions: NoPE); ``layer_specs()`` turns them into one ``LayerSpec`` per layer,
from which the model builds its blocks and ``models/layout.py`` its scan.
A mechanism's settings are a sub-record owned by its component (``models/components.py``
``RECORDS``: ``latent``, ``moe``, ``mamba``, ``conv``, ``linear_attention``, ``multipliers``,
``attn_temperature_tuning``...), a field that is None where no layer uses it; ``arch_of`` and
``nest`` read their flat names. A record is canonical: equal math, equal record (``kv heads ==
heads`` is spelled None, a uniform pattern None, a dense model's ``moe`` None), so two families that read
the same model agree, and export can compare.
"""

from __future__ import annotations

import dataclasses
import math

from shardzoo.models import ModelError, check_fields
from shardzoo.models.attention import CHUNKED, FULL, SLIDING
from shardzoo.models.blocks import BLOCK_FORMS
from shardzoo.models.components import MIXER_OF_LAYER_TYPE, MIXERS, MLPS, NONE, RECORDS
from shardzoo.models.conv_mixer import CONV  # noqa: F401  (the layer kinds' names, which the families import from here)
from shardzoo.models.differential import lambda_init
from shardzoo.models.features import feature
from shardzoo.models.layers import DENSE, positive
from shardzoo.models.linear_attention import LINEAR  # noqa: F401
from shardzoo.models.moe_arch import DENSE_AND_MOE, MOE
from shardzoo.models.norms import NORMS
from shardzoo.models.per_layer import kv_sources
from shardzoo.models.positions import KINDS as POSITION_KINDS
from shardzoo.models.rope import checked_rope_scaling
from shardzoo.models.ssm import ATTENTION_MAMBA, MAMBA  # noqa: F401

ATTENTION = "attention"  # LayerSpec.mixer: what mixes the tokens of a layer
ACTIVATIONS = ("silu", "swish", "relu", "relu2", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "xielu")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer's block: its token mixer (attention or a short convolution), attention window,
    rotary embedding and MLP kind."""

    window: int | None = None  # a query at i sees keys j with i - j < window (None: all before)
    chunk: int | None = None  # a query at i sees keys j with i // chunk == j // chunk (None: all)
    rope: str = "global"  # "global", "local" (the local rotary base), "none" (no positions here)
    mlp: str = DENSE  # "dense", "moe" or "none" (no MLP)
    norm: str = "pre"  # where its norms sit: "pre", "post" or "both" (models/blocks.py sequential)
    # "attention", "conv" (a gated short convolution: LFM2), "linear_attention" (Gated DeltaNet),
    # "mamba" (Mamba2), "attention+mamba" (both side by side: Falcon-H1) or "none" (no mixer)
    mixer: str = ATTENTION
    attn_norm: bool = True  # a norm before the mixer (false: ModernBERT's first layer reads the embeddings' norm)
    out_bias: bool | None = None  # attention's output projection has a bias (None: as attention_out_bias says)
    lambda_init: float | None = None  # differential attention's lambda_init (models/differential.py); None: off
    shared: int | None = None  # its use of a shared block (models/shared_block.py: Zamba2); None: none
    shares_kv: bool = False  # attends an earlier layer's keys and values (KV sharing: models/per_layer.py)


def _mlp_pattern_feature(value):
    """mlp_layer_types: layers without an MLP beside dense ones ("mlp_free_layers"), else a MoE
    model's pattern of dense and MoE layers."""
    if value is None:
        return None
    if DENSE_AND_MOE in value:
        return "moe_beside_dense"
    return "mlp_free_layers" if NONE in value and MOE not in value else "moe_pattern"


def _scaling_feature(value):
    return None if value is None else f"rope_scaling:{dict(value).get('rope_type')}"


@dataclasses.dataclass(frozen=True)
class ArchCore:
    """A decoder LM's architecture, but for its sub-records (``TransformerArch`` below); names and
    defaults follow Hugging Face (``LlamaConfig``)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as query heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6  # also LayerNorm's epsilon
    initializer_range: float = 0.02
    # "xielu": xIELU with its four learned scalars per layer's MLP (Apertus; models/layers.py XIELU)
    hidden_act: str = feature("silu", lambda v: "xielu" if v == "xielu" else None)
    tie_word_embeddings: bool = False
    # a scalar ``score`` head in place of the LM head: a reward model (HF's *ForSequenceClassification)
    score_head: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    # positions
    # rotary (models/rope.py), a learned table or sinusoids (models/positions.py), ALiBi (models/alibi.py)
    position_embedding: str = feature("rope", {"rope": "rope", "learned": "learned_positions",
                                               "sinusoidal": "sinusoidal_positions", "alibi": "alibi"})
    # the learned or sinusoidal table's rows before position 0 (OPT, XGLM: 2)
    position_offset: int = feature(0, "position_offset")
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = feature(None, _scaling_feature)  # HF's dict, as sorted pairs
    partial_rotary_factor: float = feature(1.0, "partial_rotary")
    rope_local_base_freq: float | None = feature(None, "local_rope")  # sliding layers' base, unscaled
    rope_layers: tuple[bool, ...] | None = feature(None, "nope_layers")  # per layer: rotates; None: all
    rope_interleaved: bool = feature(False, "rope_interleaved")  # turn pairs (2i, 2i+1), not halves
    # norms
    norm_type: str = feature("rmsnorm", {name: name for name in NORMS})  # a kind of models/norms.py NORMS
    norm_position: str = feature("pre", {"pre": "pre_norms", "post": "post_norms", "both": "sandwich_norms"})
    # per layer: its norm_position (OLMo hybrid: "post" on attention layers, "pre" on linear ones); None: all alike
    norm_positions: tuple[str, ...] | None = feature(None, "norm_position_pattern")
    # qk-norm, of norm_type: "head" each head's features (one weight for all heads), "heads"
    # each head's features with a weight per head (Cohere), "projection" all heads' features;
    # "l2": each head's features RMS-normalised without a weight (rms_norm_eps), on the rotary
    # layers only (Llama 4's use_qk_norm; it commutes with the rotation, so no placement)
    qk_norm: str = feature("none", {"head": "qk_norm_head", "heads": "qk_norm_heads",
                                    "projection": "qk_norm_projection", "l2": "qk_norm_l2"})
    # how a layer joins attention and MLP to the residual (models/blocks.py BLOCK_FORMS): "sequential";
    # "parallel" x + attn(norm(x)) + mlp(norm(x)) (Phi, Cohere); "parallel_two_norms" x + attn(norm1(x))
    # + mlp(norm2(x)) (GPT-NeoX, Falcon-40B); "post_residual" norm(x + attn(x)), norm(x + mlp(x)) and no
    # final norm (GPT-1); "shortcut_moe" two attention+MLP halves, the MoE of the first's beside (LongCat-Flash);
    # older checkpoints' flag parallel_residual reads as one (nest)
    block_form: str = feature("sequential", {"parallel": "parallel_residual", "parallel_two_norms": "parallel_two_norms",
                                             "post_residual": "post_residual_norms", "shortcut_moe": "shortcut_moe"})
    qk_norm_after_rope: bool = feature(False, "qk_norm_after_rope")  # HunYuan: rotary, then the norm
    # the qk-norm a LayerNorm without bias where the model's LayerNorms have one (StableLM)
    qk_norm_no_bias: bool = feature(False, "qk_norm_no_bias")
    # biases and MLP
    attention_bias: bool = feature(False, "attention_bias")  # q, k, v
    attention_out_bias: bool = feature(False, "attention_out_bias")
    # per layer: attention's output projection has a bias (GPT-NeoX-Japanese: the last layer's only);
    # None: every layer as attention_out_bias says
    attention_out_bias_layers: tuple[bool, ...] | None = feature(None, "attention_out_bias_layers")
    clip_qkv: float | None = feature(None, "clip_qkv")  # q, k and v clipped to [-clip_qkv, clip_qkv] (OLMo 1, MPT)
    mlp_bias: bool = feature(False, "mlp_bias")
    mlp_type: str = feature("gated", {"gated": "gated_mlp", "plain": "plain_mlp"})
    # attention kinds and scales
    sliding_window: int | None = feature(None, "sliding_window")
    attention_chunk_size: int | None = feature(None, "chunked_attention")  # chunked_attention layers' chunk
    layer_types: tuple[str, ...] | None = feature(None, "layer_pattern")  # per layer; None: uniform
    query_pre_attn_scalar: float | None = feature(None, "query_pre_attn_scalar")  # scale scalar**-0.5
    attn_logit_softcapping: float | None = feature(None, "attention_softcap")
    # a learned logit per head in the softmax's denominator, attended by no value (GPT-OSS's sinks)
    attention_sinks: bool = feature(False, "attention_sinks")
    final_logit_softcapping: float | None = feature(None, "final_softcap")
    lm_head_bias: bool = feature(False, "lm_head_bias")  # the output head's bias (Phi)
    logit_scale: float = feature(1.0, "logit_scale")  # logits x logit_scale (Cohere)
    scale_embeddings: bool = feature(False, "scale_embeddings")  # x sqrt(hidden_size)
    embedding_norm: bool = feature(False, "embedding_norm")  # a norm of the embeddings (BLOOM)
    # the first layer's mixer reads its input unnormed (ModernBERT's decoder: the embeddings' norm serves)
    first_attn_norm: bool = feature(True, {False: "no_first_attn_norm"})
    # the output head reads norm(act(x @ dense)), act this activation (ModernBERT's prediction head); None: x
    head_transform: str | None = feature(None, "head_transform")
    # Granite's multipliers
    embedding_multiplier: float = feature(1.0, "multipliers")
    residual_multiplier: float = feature(1.0, "multipliers")  # x + multiplier * block(x)
    attention_multiplier: float | None = feature(None, "multipliers")  # the attention scale
    logits_scaling: float = feature(1.0, "multipliers")  # logits / logits_scaling
    mlp_layer_types: tuple[str, ...] | None = feature(None, _mlp_pattern_feature)  # per layer; None: uniform
    # attention's output times sigmoid(gate), the gate a second half of each query head (Qwen3-Next)
    attn_output_gate: bool = feature(False, "attention_output_gate")
    # the values RMS-normalised per head without a weight (rms_norm_eps) (Gemma 4)
    v_norm: bool = feature(False, "v_norm")
    # the key projection's output serves as the values too: no v projection (Gemma 4's full layers,
    # through the global_attention record)
    attention_k_eq_v: bool = feature(False, "attention_k_eq_v")
    # each layer's output (the residual stream) times a scalar of its own, which transformers keeps
    # as a buffer: read and written, not trained (Gemma 4)
    layer_scalar: bool = feature(False, "layer_scalar")
    # attention's output times the sigmoid of one gate per head, projected from the layer's input (LFM3)
    attn_head_gate: bool = feature(False, "attention_head_gate")
    # a norm (norm_type) of attention's output before its o projection and of the MLP's hidden features
    # before its down projection (BitNet's subln: attn_sub_norm, ffn_sub_norm)
    sub_norms: bool = feature(False, "sub_norms")
    # the projections of attention and MLP through BitLinear: ternary weights (absmean), 8-bit inputs per
    # token (absmax), straight-through gradients (BitNet b1.58's online quantization; models/layers.py)
    bitlinear: bool = feature(False, "bitlinear")
    # differential attention (DiffLlama: models/differential.py), each layer's lambda_init from its index
    diff_attention: bool = feature(False, "differential_attention")

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        for record in RECORDS.values():  # a stored config's mapping (or a switch: true, false) as the record
            set_(record.NAME, record.of(getattr(self, record.NAME)))
        for name in ("layer_types", "mlp_layer_types", "rope_layers", "attention_out_bias_layers", "norm_positions",
                     "eos_token_id"):
            if isinstance(getattr(self, name), list):
                set_(name, tuple(getattr(self, name)))
        if isinstance(self.rope_layers, tuple) and all(v in (0, 1) for v in self.rope_layers):
            set_("rope_layers", tuple(bool(v) for v in self.rope_layers))  # HF's 1/0 as True/False
        self._check()
        # the canonical spelling of equal math
        if self.num_key_value_heads == self.num_attention_heads:
            set_("num_key_value_heads", None)
        if self.head_dim is not None and self.head_dim * self.num_attention_heads == self.hidden_size:
            set_("head_dim", None)
        scaling = checked_rope_scaling(self.rope_scaling, int(self.head_size * self.partial_rotary_factor) // 2)
        set_("rope_scaling", scaling)
        if self.query_pre_attn_scalar == self.head_size:
            set_("query_pre_attn_scalar", None)
        if self.attention_multiplier == (self.query_pre_attn_scalar or self.head_size) ** -0.5:
            set_("attention_multiplier", None)  # the scale every family uses by default
        types = self.layer_types
        if types is not None and len(set(types)) == 1 and MIXER_OF_LAYER_TYPE[types[0]] == ATTENTION:
            if types[0] != SLIDING:
                set_("sliding_window", None)
            if types[0] != CHUNKED:
                set_("attention_chunk_size", None)
            set_("layer_types", None)
        if not self.has_sliding_layers:
            set_("sliding_window", None)
            set_("rope_local_base_freq", None)
        if not self.has_chunked_layers:
            set_("attention_chunk_size", None)
        if self.rope_local_base_freq == self.rope_theta and scaling is None:
            set_("rope_local_base_freq", None)
        if self.qk_norm in ("none", "l2"):
            set_("qk_norm_after_rope", False)  # no norm to place, or one that commutes with rotary
        if self.qk_norm in ("none", "l2") or self.norm_type != "layernorm":
            set_("qk_norm_no_bias", False)  # no norm, or one that has no bias anyway
        if self.rope_layers is not None and all(self.rope_layers):
            set_("rope_layers", None)  # every layer rotates
        biased = self.attention_out_bias_layers
        if biased is not None:  # a uniform pattern is the flag; else the flag is off
            set_("attention_out_bias", biased[0] if len(set(biased)) == 1 else False)
            set_("attention_out_bias_layers", None if len(set(biased)) == 1 else biased)
        if self.norm_positions is not None and len(set(self.norm_positions)) == 1:
            set_("norm_position", self.norm_positions[0])  # every layer alike
            set_("norm_positions", None)
        if self.position_embedding != "rope":
            for name in ("rope_scaling", "rope_local_base_freq", "rope_layers"):
                set_(name, None)
            set_("rope_interleaved", False)
        if self.position_embedding not in ("learned", "sinusoidal"):
            set_("position_offset", 0)  # no table
        if self.moe is None and NONE not in (self.mlp_layer_types or ()):
            set_("mlp_layer_types", None)  # dense layers only
        if self.moe is not None and self.moe.moe_intermediate_size == self.intermediate_size:
            set_("moe", dataclasses.replace(self.moe, moe_intermediate_size=None))
        if self.mlp_layer_types is not None and set(self.mlp_layer_types) == {MOE}:
            set_("mlp_layer_types", None)

    def _check(self) -> None:
        check_fields(self, {"hidden_act": ACTIVATIONS, "position_embedding": POSITION_KINDS,
                            "norm_type": tuple(NORMS), "block_form": tuple(BLOCK_FORMS),
                            "norm_position": ("pre", "post", "both"),
                            "qk_norm": ("none", "head", "heads", "projection", "l2"),
                            "mlp_type": ("gated", "plain")},
                     ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim",
                      "max_position_embeddings", "sliding_window", "attention_chunk_size"))
        if isinstance(self.position_offset, bool) or not isinstance(self.position_offset, int) or self.position_offset < 0:
            raise ModelError(f"position_offset={self.position_offset!r} must be an integer >= 0 (the position "
                             "table's rows before position 0)")
        for name in ("rms_norm_eps", "initializer_range", "rope_theta", "embedding_multiplier",
                     "residual_multiplier", "logits_scaling", "partial_rotary_factor", "logit_scale"):
            if not positive(getattr(self, name)):
                raise ModelError(f"{name}={getattr(self, name)!r} must be a finite number > 0")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_base_freq", "attention_multiplier", "clip_qkv"):
            value = getattr(self, name)
            if value is not None and not positive(value):
                raise ModelError(f"{name}={value!r} must be a finite number > 0 (or null: off)")
        if self.head_transform is not None and self.head_transform not in ACTIVATIONS:
            raise ModelError(f"head_transform={self.head_transform!r} is not one of {', '.join(ACTIVATIONS)} "
                             "(or null: none)")
        if self.head_transform is not None and self.score_head:
            raise ModelError(f"head_transform={self.head_transform!r} (ModernBERT's prediction head) feeds the "
                             "language-model head only: a score head (reward model) is not read on top of it")
        if not self.first_attn_norm and (self.block_form != "sequential" or self.norm_position != "pre"):
            raise ModelError(f"first_attn_norm=false drops the first layer's pre-norm: block_form="
                             f"{self.block_form!r} must be 'sequential' and norm_position={self.norm_position!r} 'pre'")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ModelError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ModelError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}; set head_dim")
        if self.num_attention_heads % self.kv_heads:
            raise ModelError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.kv_heads}")
        rotated = int(self.head_size * self.partial_rotary_factor)
        if self.position_embedding == "rope" and rotated % 2 and not (self.latent and self.latent.kv_lora_rank):
            raise ModelError(f"rotary embeddings turn pairs of features: head_dim={self.head_size} x "
                             f"partial_rotary_factor={self.partial_rotary_factor} = {rotated} is odd")
        n = self.num_hidden_layers
        for name, allowed in (("layer_types", tuple(MIXER_OF_LAYER_TYPE)), ("mlp_layer_types", tuple(MLPS))):
            value = getattr(self, name)
            if value is None:
                continue
            if len(value) != n or any(v not in allowed for v in value):
                raise ModelError(f"{name} must name {n} layers (num_hidden_layers), each one of "
                                 f"{', '.join(allowed)}; got {list(value)}")
        rotates = self.rope_layers
        if rotates is not None and (not isinstance(rotates, tuple) or len(rotates) != n
                                    or any(not isinstance(v, bool) for v in rotates)):
            raise ModelError(f"rope_layers must give {n} layers (num_hidden_layers) each true (rotary "
                             f"embeddings) or false (none: NoPE); got {rotates!r}")
        biased = self.attention_out_bias_layers
        if biased is not None and (not isinstance(biased, tuple) or len(biased) != n
                                   or any(not isinstance(v, bool) for v in biased)):
            raise ModelError(f"attention_out_bias_layers must give {n} layers (num_hidden_layers) each true (the "
                             f"attention output has a bias) or false; got {biased!r}")
        positions = self.norm_positions
        if positions is not None and (not isinstance(positions, tuple) or len(positions) != n
                                      or any(v not in ("pre", "post", "both") for v in positions)):
            raise ModelError(f"norm_positions must give {n} layers (num_hidden_layers) each 'pre', 'post' or "
                             f"'both' (where its norms sit); got {positions!r}")
        if self.layer_types is not None and SLIDING in self.layer_types and not self.sliding_window:
            raise ModelError(f"layer_types has {SLIDING} layers but sliding_window is not set")
        self._check_layers()
        self._place_records()
        for mixer in sorted({spec.mixer for spec in self.layer_specs()}):  # each mixer's own checks
            if MIXERS[mixer].check is not None:
                MIXERS[mixer].check(self)
        for record in RECORDS.values():
            if getattr(self, record.NAME) is not None:
                getattr(self, record.NAME).check(self)
        if self.layer_types is not None and CHUNKED in self.layer_types and not self.attention_chunk_size:
            raise ModelError(f"layer_types has {CHUNKED} layers but attention_chunk_size is not set")
        if self.layer_types is None and self.sliding_window and self.attention_chunk_size:
            raise ModelError(f"sliding_window={self.sliding_window} and attention_chunk_size="
                             f"{self.attention_chunk_size} without layer_types: say which layers are which")

    def _place_records(self) -> None:
        """Each sub-record where a layer uses it (``SubRecord``): an owned one exactly where a layer
        has its owner (its defaults if none was given), another where it is used, else None."""
        specs = self.layer_specs()
        kinds = {s.mixer for s in specs} | {s.mlp for s in specs}
        for record in RECORDS.values():
            value = getattr(self, record.NAME)
            if record.OWNERS:
                value = (value or record()) if kinds & set(record.OWNERS) else None
            elif value is not None and not value.used(self):
                value = None
            object.__setattr__(self, record.NAME, value)

    def _check_layers(self) -> None:
        types, mlps = self.layer_types or (), self.mlp_layer_types or ()
        if any(t == NONE and m == NONE for t, m in zip(types, mlps, strict=False)):
            raise ModelError("a layer with neither a mixer (layer_types 'none') nor an MLP (mlp_layer_types 'none') "
                             "does nothing; remove it")
        if BLOCK_FORMS[self.block_form].check is not None:
            BLOCK_FORMS[self.block_form].check(self)

    # ------------------------------------------------------------------ derived sizes
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qk_head_size(self) -> int:
        """Features of one query/key head (MLA: nope + rope)."""
        return self.latent.qk_nope_head_dim + self.latent.qk_rope_head_dim if self.latent else self.head_size

    @property
    def v_head_size(self) -> int:
        return self.latent.v_head_dim if self.latent else (self.value_heads and self.value_heads.head_dim) or self.head_size

    @property
    def rope_dim(self) -> int:
        """Features of a head that rotate."""
        return self.latent.qk_rope_head_dim if self.latent else int(self.head_size * self.partial_rotary_factor)

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling or ())

    @property
    def expert_size(self) -> int:
        """The routed experts' width."""
        return (self.moe and self.moe.moe_intermediate_size) or self.intermediate_size

    @property
    def has_sliding_layers(self) -> bool:
        return bool(self.sliding_window) and (self.layer_types is None or SLIDING in self.layer_types)

    @property
    def has_chunked_layers(self) -> bool:
        types = self.layer_types
        return bool(self.attention_chunk_size) and (CHUNKED in types if types is not None
                                                    else not self.sliding_window)

    @property
    def default_layer_type(self) -> str:
        """Every layer's kind when ``layer_types`` is None."""
        return SLIDING if self.sliding_window else CHUNKED if self.attention_chunk_size else FULL

    @property
    def attention_scale(self) -> float:
        """The factor of the attention logits (Granite's multiplier, Gemma's scalar, 1/sqrt(d))."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        scale = (self.query_pre_attn_scalar or self.qk_head_size) ** -0.5
        scaling = self.rope_scaling_dict
        if self.latent and scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
            # latent attention under YaRN scales every dim of q.k, not only the rotary ones, by
            # mscale(factor, mscale_all_dim) squared (DeepSeek's reference; transformers' yarn_apply_mscale)
            factor = scaling["factor"]
            mscale = 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """Each layer's block, from the per-layer patterns."""
        n = self.num_hidden_layers
        types = self.layer_types or (self.default_layer_type,) * n
        mlps = self.mlp_layer_types or ((MOE if self.moe else DENSE),) * n
        rotates = self.rope_layers or (True,) * n
        biased = self.attention_out_bias_layers or (None,) * n
        norms = self.norm_positions or (self.norm_position,) * n
        uses = {layer: k for k, layer in enumerate(self.shared_block.layers)} if self.shared_block else {}
        shared = kv_sources(self, self.per_layer) if self.per_layer else (None,) * n
        out = []
        for i, (kind, mlp, rotary, out_bias, norm) in enumerate(zip(types, mlps, rotates, biased, norms, strict=True)):
            sliding = kind == SLIDING
            rope = "global"
            if self.position_embedding != "rope" or not rotary:
                rope = "none"
            elif sliding and self.rope_local_base_freq is not None:
                rope = "local"
            chunk = self.attention_chunk_size if kind == CHUNKED else None
            mixer = MIXER_OF_LAYER_TYPE[kind]
            out.append(LayerSpec(window=self.sliding_window if sliding else None, chunk=chunk, rope=rope, mlp=mlp,
                                 mixer=mixer, norm=norm, attn_norm=bool(i or self.first_attn_norm), out_bias=out_bias,
                                 lambda_init=lambda_init(i) if self.diff_attention else None, shared=uses.get(i),
                                 shares_kv=shared[i] is not None))
        return tuple(out)


def _record_feature(record):
    return lambda value: None if value is None else record.FEATURE


# The architecture record: the core fields, then one field per sub-record of the components'
# tables (models/components.py RECORDS), None where no layer uses it: a new component's settings
# are its own record, named in its table line, not fields here.
TransformerArch = dataclasses.make_dataclass(
    "TransformerArch", [(name, record | None, feature(None, _record_feature(record))) for name, record in RECORDS.items()],
    bases=(ArchCore,), frozen=True,
    namespace={"__module__": __name__, "__doc__": ArchCore.__doc__.replace(", but for its sub-records (``TransformerArch`` below)", "")})


def nest(fields: dict, current=None) -> dict:
    """``fields`` with the flat names of sub-record fields (``SubRecord.FLAT``: older checkpoints,
    ``--override``, the families' mappings) gathered into their records, onto ``current``'s
    (the architecture being replaced) where given; a record switched off (None, false) takes none."""
    out = dict(fields)
    if "parallel_residual" in out:  # the flag before block forms
        out.setdefault("block_form", "parallel" if out.pop("parallel_residual") else "sequential")
    for record in RECORDS.values():
        mine = {record.FLAT[k]: out.pop(k) for k in list(out) if k in record.FLAT}
        if not mine:
            continue
        if record.NAME in out:
            base = record.of(out[record.NAME])
            if base is None:
                continue
        else:
            base = record.of(getattr(current, record.NAME, None))
        out[record.NAME] = dataclasses.replace(base or record(), **mine)
    return out


def arch_of(**fields):
    """A ``TransformerArch`` of fields by name, the sub-records' by their flat names too (``nest``)."""
    return TransformerArch(**nest(fields))

