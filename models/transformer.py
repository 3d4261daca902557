"""Decoder-only Transformer LMs: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, OLMo 2,
Phi-3, Gemma 1/2/3, GPT-2, Mixtral and Qwen3-MoE (MoE).

One frozen config with Hugging Face field names selects the family's pieces; one model covers
them. Layers are stacked with ``nn.scan`` by default (every parameter gets a leading ``layers``
axis) or unrolled (``layers_0``, ``layers_1``, ...). MoE layers (``num_local_experts > 0``) use
``models/moe.py``'s ``MoeMLP``; where dense and MoE layers mix (``moe_layer_freq > 1`` or
``mlp_only_layers``) the layers must be unrolled, so the parameter tree stays one homogeneous
stack when scanned.

A local/global layer pattern (``sliding_window_pattern``, Gemma 2/3) is scanned as MaxText
does: each scanned step runs one period of the pattern, ``period`` blocks with their own
parameters (``layers/sub_0``, ``layers/sub_1``, ..., each with the leading ``layers`` axis), and
the layers past the last whole period are unrolled after the scan (``layers_24``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import DTYPES, ModelError, check_fields, register
from shardzoo.models.costs import transformer_activations
from shardzoo.models.layers import (
    ACTIVATIONS,
    MLP,
    ROPE_SCALING,
    Attention,
    Embed,
    Linear,
    constrain,
    make_norm,
    softcap,
)
from shardzoo.models.lora import TARGETS as LORA_TARGETS
from shardzoo.models.lora import check_lora
from shardzoo.models.pipeline import PipelineError, active_schedule, make_schedule, pipeline
from shardzoo.models.ring_attention import STRATEGIES as CONTEXT_STRATEGIES
from shardzoo.models.ring_attention import enter_ring, unzigzag
from shardzoo.sharding import axes as ax

BLE = (ax.BATCH, ax.LENGTH, ax.EMBED)

# checkpoint_name labels in layers.py: query, key, value, attn_context, attn_out, mlp_hidden, mlp_out.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attn_mlp": jax.checkpoint_policies.save_only_these_names("attn_context", "mlp_hidden"),
}
_CHOICES = {
    "mlp_type": ("gated", "plain"),
    "position_embedding": ("rope", "learned"),
    "norm_type": ("rmsnorm", "rmsnorm_plus_one", "layernorm"),
    "norm_position": ("pre", "post", "both"),
    "qk_norm": ("none", "head", "projection"),
    "remat_policy": tuple(REMAT_POLICIES),
    "attention_impl": ("auto", "xla", "cudnn"),
    "context_attention": CONTEXT_STRATEGIES,
    "dtype": DTYPES,
    "param_dtype": DTYPES,
    "moe_dispatch": ("indexed", "capacity", "dropless", "shard_map"),
    "hidden_act": tuple(ACTIVATIONS),
}
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
             "moe_layer_freq", "pipeline_repeats", "moe_intermediate_size", "sliding_window_pattern")
_POSITIVE_FLOATS = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                    "rope_local_base_freq")


def _check_rope_scaling(value) -> None:
    """``rope_scaling`` is None or a mapping (or its pairs) of a supported type with its keys."""
    if value is None:
        return
    try:
        scaling = None if isinstance(value, str) else dict(value)
    except (TypeError, ValueError):
        scaling = None
    if scaling is None:
        raise ModelError(f"rope_scaling={value!r} is not a mapping such as "
                         "{rope_type: linear, factor: 2.0}; use null for none")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_SCALING:
        raise ModelError(f"rope_scaling rope_type={kind!r} is not one of {', '.join(ROPE_SCALING)}")
    for key in ROPE_SCALING[kind]:
        number = scaling.get(key)
        if not isinstance(number, (int, float)) or isinstance(number, bool) or not number > 0:
            raise ModelError(f"rope_scaling of rope_type {kind!r} needs {key} > 0, got {number!r}")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A decoder LM; field names (and defaults, those of ``LlamaConfig``) follow Hugging Face."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as query heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # HF dict, stored as sorted (key, value) pairs
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-6  # also GPT-2's layer_norm_epsilon
    sliding_window: int | None = None  # a query at i sees keys j with i - j < sliding_window
    attention_bias: bool = False  # q/k/v biases
    attention_out_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    mlp_type: str = "gated"
    position_embedding: str = "rope"
    norm_type: str = "rmsnorm"
    norm_position: str = "pre"  # "pre": x + f(norm(x)); "post": x + norm(f(x)) (OLMo 2); "both": x + norm(f(norm(x))) (Gemma 2/3)
    qk_norm: str = "none"  # RMSNorm of q and k before rotary: per "head" (Qwen3) or whole "projection" (OLMo 2)
    # Gemma ("rmsnorm_plus_one" norms, GeGLU as hidden_act "gelu_pytorch_tanh"):
    scale_embeddings: bool = False  # embeddings x sqrt(hidden_size), in the compute dtype
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar**-0.5 (None: head_dim)
    attn_logit_softcapping: float | None = None  # cap * tanh(logits / cap) on attention scores
    final_logit_softcapping: float | None = None  # ... and on the output logits
    sliding_window_pattern: int | None = None  # layer i global iff (i + 1) % pattern == 0, else local
    rope_local_base_freq: float | None = None  # local layers' rotary base, unscaled (None: as global)
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    initializer_range: float = 0.02
    dtype: str = "float32"  # compute
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat_policy: str = "none"
    pipeline_microbatches: int = 0  # when the rules put layers on a mesh axis (pp); 0: one per stage
    pipeline_repeats: int = 1  # circular pipeline: passes of each microbatch through all stages
    attention_impl: str = "auto"
    context_attention: str = "ring"  # under context parallelism: "ring" or "all_gather" K/V
    fuse_projections: bool = True  # k|v and up|gate as one matmul each (parameters unchanged)
    num_local_experts: int = 0  # 0: dense MLPs
    num_experts_per_tok: int = 2
    moe_layer_freq: int = 1  # layer i is MoE iff (i + 1) % moe_layer_freq == 0 (HF decoder_sparse_step)
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not in mlp_only_layers (Qwen3-MoE)
    moe_intermediate_size: int | None = None  # the experts' width (None: intermediate_size)
    moe_dispatch: str = "indexed"
    capacity_factor: float = 1.25
    router_jitter_noise: float = 0.0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    lora_rank: int = 0  # > 0: LoRA adapters on lora_targets, the only params a run trains (models/lora.py)
    lora_alpha: float | None = None  # scale alpha / lora_rank; None: lora_rank
    lora_targets: tuple[str, ...] = LORA_TARGETS

    task: ClassVar[str] = "lm"

    def __post_init__(self):
        _check_rope_scaling(self.rope_scaling)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.mlp_only_layers, list):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        check_fields(self, _CHOICES, _POSITIVE)
        if self.pipeline_microbatches < 0:
            raise ModelError(f"pipeline_microbatches={self.pipeline_microbatches} must be >= 0 (0: one per stage)")
        for name in _POSITIVE_FLOATS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise ModelError(f"{name}={value!r} must be a number > 0 (or null: off)")
        if self.rope_local_base_freq is not None and self.sliding_window_pattern is None:
            raise ModelError("rope_local_base_freq needs sliding_window_pattern (which layers are local)")
        if self.num_local_experts < 0:
            raise ModelError(f"num_local_experts={self.num_local_experts} must be >= 0 (0: dense MLPs)")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ModelError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; set head_dim"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.kv_heads}"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ModelError(f"mlp_only_layers={list(self.mlp_only_layers)} names layers outside "
                             f"0..{self.num_hidden_layers - 1} (num_hidden_layers={self.num_hidden_layers})")
        mixed = ([f"moe_layer_freq={self.moe_layer_freq}"] if self.moe_layer_freq > 1 else []) + (
            [f"mlp_only_layers={list(self.mlp_only_layers)}"] if self.mlp_only_layers else [])
        if self.num_local_experts and mixed and self.scan_layers:
            raise ModelError(f"{' and '.join(mixed)} mixes dense and MoE layers: set scan_layers=false")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        check_lora(self)
        if self.num_local_experts:
            self.moe_config()  # its own checks (experts per token, capacity, jitter) now, not at trace

    # ------------------------------------------------------------------ derived sizes
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling or ())

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def layer_period(self) -> int:
        """Layers in one scanned step: the local/global pattern's period (1: all layers alike)."""
        return self.sliding_window_pattern or 1

    def is_local_layer(self, i: int) -> bool:
        """Layer ``i`` uses ``sliding_window`` and ``rope_local_base_freq`` (without a pattern,
        every layer: the window, if any, is everyone's)."""
        return self.sliding_window_pattern is None or (i + 1) % self.sliding_window_pattern != 0

    def param_layout(self) -> list[tuple[tuple[str, ...], tuple[int, ...], bool]]:
        """Where each layer's parameters live: ``(path prefix, layers, stacked)``; a stacked
        prefix holds its layers on a leading axis in that order, else it holds one layer."""
        n, period = self.num_hidden_layers, self.layer_period
        if not self.scan_layers:
            return [((f"layers_{i}",), (i,), False) for i in range(n)]
        scanned = n - n % period
        if period == 1:
            out = [(("layers",), tuple(range(n)), True)]
        else:
            out = [(("layers", f"sub_{j}"), tuple(range(j, scanned, period)), True)
                   for j in range(period)] if scanned else []
        return out + [((f"layers_{i}",), (i,), False) for i in range(scanned, n)]

    def is_moe_layer(self, i: int) -> bool:
        """As HF's Qwen3MoeDecoderLayer decides (Mixtral's: every layer)."""
        return (self.num_local_experts > 0 and (i + 1) % self.moe_layer_freq == 0
                and i not in self.mlp_only_layers)

    def moe_config(self):
        from shardzoo.models.moe import MoeConfig

        return MoeConfig(
            num_experts=self.num_local_experts, num_experts_per_tok=self.num_experts_per_tok,
            intermediate_size=self.expert_size, hidden_act=self.hidden_act,
            dispatch=self.moe_dispatch, capacity_factor=self.capacity_factor,
            router_jitter_noise=self.router_jitter_noise, norm_topk_prob=self.norm_topk_prob,
            aux_loss_coef=self.router_aux_loss_coef, z_loss_coef=self.router_z_loss_coef,
            dtype=self.dtype, param_dtype=self.param_dtype, initializer_range=self.initializer_range,
        )

    # ------------------------------------------------------------------ zoo interface
    def build(self) -> Transformer:
        return Transformer(self)

    def sample_inputs(self, batch_size: int, seq_len: int):
        return (jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32),)

    def _layer_matmul_params(self, moe: bool, active: bool) -> int:
        d, hd = self.hidden_size, self.head_size
        attn = d * hd * (2 * self.num_attention_heads + 2 * self.kv_heads)
        n_mats = 3 if self.mlp_type == "gated" else 2
        if not moe:
            return attn + n_mats * d * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_local_experts
        return attn + d * self.num_local_experts + 3 * experts * d * self.expert_size

    def num_params(self, active: bool = False) -> int:
        """Parameters of the model (``active``: counting only the top-k experts of MoE layers)."""
        d, hd = self.hidden_size, self.head_size
        total = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        if self.position_embedding == "learned":
            total += self.max_position_embeddings * d
        norm = d * (2 if self.norm_type == "layernorm" else 1)
        total += norm  # final norm
        norms = 4 if self.norm_position == "both" else 2
        for i in range(self.num_hidden_layers):
            moe = self.is_moe_layer(i)
            total += self._layer_matmul_params(moe, active) + norms * norm
            if self.qk_norm != "none":
                total += hd * (2 if self.qk_norm == "head" else self.num_attention_heads + self.kv_heads)
            if self.attention_bias:
                total += hd * (self.num_attention_heads + 2 * self.kv_heads)
            if self.attention_out_bias:
                total += d
            if self.mlp_bias and not moe:
                total += self.intermediate_size * (2 if self.mlp_type == "gated" else 1) + d
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (MaxText): 6 x matmul params (active) + causal attention."""
        matmul = sum(self._layer_matmul_params(self.is_moe_layer(i), True)
                     for i in range(self.num_hidden_layers))
        matmul += self.vocab_size * self.hidden_size  # output head (tied or not)
        keys = 0.0  # keys a query sees on average, summed over layers (each its own window)
        for i in range(self.num_hidden_layers):
            w = self.sliding_window if self.is_local_layer(i) else None
            keys += seq_len / 2 if not w or w >= seq_len else w - w * w / (2 * seq_len)
        attn = 12 * self.num_attention_heads * self.head_size * keys
        return 6 * matmul + attn

    def pipeline_plan(self, batch_size: int, shards) -> dict | None:
        """The pipeline schedule (``models/pipeline.py``) when the rules split the layer stack
        (``shards((layers,)) > 1``), as the plan shows it; else None."""
        stages = shards((ax.LAYERS,))
        if stages == 1 or not self.scan_layers:
            return None
        sched = make_schedule(self.num_hidden_layers, batch_size, stages=stages,
                              microbatches=self.pipeline_microbatches, repeats=self.pipeline_repeats,
                              batch_shards=shards((ax.BATCH,)))
        layers = sched.layers_per_stage * sched.repeats
        return sched.to_dict() | {"text": sched.describe(), "stages_layers": f"{layers} / {self.num_hidden_layers}"}

    def activation_estimate(self, batch_size: int, seq_len: int, shards):
        """Activation bytes a train step keeps per device (``models/costs.py``)."""
        return transformer_activations(self, batch_size, seq_len or 1, shards,
                                       self.pipeline_plan(batch_size, shards))


class Block(nn.Module):
    """Residual block: x + attn(norm(x)), then x + mlp(norm(x)); with ``norm_position="post"``
    the norms move onto the outputs: x + norm(attn(x)), then x + norm(mlp(x)) (OLMo 2); with
    "both" there are both: x + norm(attn(norm(x))), then x + norm(mlp(norm(x))) (Gemma 2/3)."""

    config: TransformerConfig
    use_moe: bool = False
    deterministic: bool = True
    decode: bool = False
    scanned: bool = False  # return (x, None) as nn.scan wants
    local: bool = True  # a local layer of the pattern (see TransformerConfig.is_local_layer)

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        cfg = self.config
        pre, post = cfg.norm_position in ("pre", "both"), cfg.norm_position in ("post", "both")
        h = make_norm(cfg, "attn_norm")(x) if pre else x
        h = Attention(cfg, self.local, name="attn")(h, positions, segment_ids, self.decode)
        h = make_norm(cfg, "post_attn_norm")(h) if post else h
        x = constrain(x + h, BLE)
        h = make_norm(cfg, "mlp_norm")(x) if pre else x
        if self.use_moe:
            from shardzoo.models.moe import MoeMLP  # lazily: the dense models need no moe.py

            token_mask = None if segment_ids is None else segment_ids > 0  # 0: padding
            h = MoeMLP(config=cfg.moe_config(), name="moe")(h, self.deterministic, token_mask)
        else:
            h = MLP(cfg, name="mlp")(h)
        h = make_norm(cfg, "post_mlp_norm")(h) if post else h
        x = constrain(x + h, BLE)  # [batch, length, embed]
        return (x, None) if self.scanned else x


def pipeline_schedule(cfg, batch_size: int):
    """The pipeline schedule the active rules ask for (``models/pipeline.py``), or None."""
    sched = active_schedule(cfg.num_hidden_layers, batch_size, microbatches=cfg.pipeline_microbatches,
                            repeats=cfg.pipeline_repeats)
    if sched is not None and cfg.layer_period > 1:
        raise PipelineError("pipeline parallelism (rules put layers on a mesh axis) needs one homogeneous "
                            f"layer stack; sliding_window_pattern={cfg.sliding_window_pattern} scans periods")
    if sched is not None and cfg.num_local_experts:
        raise PipelineError("pipeline parallelism (rules put layers on a mesh axis) runs dense layers only;"
                            f" num_local_experts={cfg.num_local_experts}")
    return sched


def _apply_layer(cfg, block, params, x, positions, segment_ids):
    """One scanned layer, outside the scan: the pipeline's stage function."""
    return block(cfg, parent=None).apply({"params": params}, x, positions, segment_ids)


def _block_class(cfg: TransformerConfig, decode: bool, prevent_cse: bool):
    """Block, wrapped in the config's remat policy when training."""
    if cfg.remat_policy == "none" or decode:
        return Block
    return nn.remat(Block, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=prevent_cse)


class PeriodBlock(nn.Module):
    """One scanned step of a layer pattern: ``layer_period`` blocks with their own parameters
    (``sub_0``, ``sub_1``, ...); at step k, ``sub_j`` is layer ``k * period + j``."""

    config: TransformerConfig
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        cfg = self.config
        block = _block_class(cfg, self.decode, prevent_cse=False)
        for j in range(cfg.layer_period):
            x = block(cfg, cfg.num_local_experts > 0, self.deterministic, self.decode,
                      local=cfg.is_local_layer(j), name=f"sub_{j}")(x, positions, segment_ids)
        return x, None


class Transformer(nn.Module):
    """The decoder LM. ``__call__(inputs, positions, segment_ids, deterministic, decode)`` -> logits.

    With ``decode=True`` the layers read and write a "cache" collection (see models/decode.py);
    the first such call (``init``) sizes the cache by the length of its inputs.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, positions=None, segment_ids=None, deterministic=True, decode=False):
        cfg = self.config
        if positions is None:
            if decode:
                raise ValueError("decoding needs explicit positions")
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        # context parallelism: the tokens in the ring's zig-zag order (ring_attention.py)
        ring, (inputs, positions, segment_ids) = enter_ring(self, decode, inputs, positions, segment_ids)
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, init_std=cfg.initializer_range)
        embed = Embed(cfg.vocab_size, cfg.hidden_size, name="embed", **kw)
        x = embed(inputs)  # [batch, length, embed]
        if cfg.scale_embeddings:  # Gemma: the scale rounded to the compute dtype, as HF does
            x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
        if cfg.position_embedding == "learned":
            pos_embed = Embed(cfg.max_position_embeddings, cfg.hidden_size, ax.POSITION, name="pos_embed", **kw)
            x = x + pos_embed(positions)
        x = constrain(x, BLE)

        flags = dict(deterministic=deterministic, decode=decode)
        period = cfg.layer_period
        scanned = cfg.num_hidden_layers - cfg.num_hidden_layers % period if cfg.scan_layers else 0
        sched = None if decode or not scanned else pipeline_schedule(cfg, x.shape[0])
        if sched is not None and not self.is_initializing():  # init builds the same tree by nn.scan
            step = _block_class(cfg, decode, prevent_cse=False)
            x = pipeline(sched, functools.partial(_apply_layer, cfg, step), self.variables["params"]["layers"],
                         x, positions, segment_ids)
        elif scanned:
            step = _block_class(cfg, decode, prevent_cse=False) if period == 1 else PeriodBlock
            stack = nn.scan(
                step,
                variable_axes={c: 0 for c in ("params", "cache", "losses", "metrics", "intermediates")},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast),
                length=scanned // period,
                metadata_params={nn.PARTITION_NAME: ax.LAYERS},
            )
            if period == 1:
                layers = stack(cfg, cfg.num_local_experts > 0, scanned=True, name="layers", **flags)
            else:
                layers = stack(cfg, name="layers", **flags)
            x, _ = layers(x, positions, segment_ids)
        block = _block_class(cfg, decode, prevent_cse=True)
        for i in range(scanned, cfg.num_hidden_layers):  # all layers unrolled, or the remainder
            x = block(cfg, cfg.is_moe_layer(i), local=cfg.is_local_layer(i), name=f"layers_{i}",
                      **flags)(x, positions, segment_ids)

        if ring:
            x = unzigzag(x, ring)  # the natural order again; the norm and head work per token
        x = make_norm(cfg, "final_norm")(x)
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = Linear((cfg.vocab_size,), (ax.EMBED, ax.VOCAB), name="lm_head", **kw)(x)
        if cfg.final_logit_softcapping:
            logits = softcap(logits, jnp.asarray(cfg.final_logit_softcapping, logits.dtype))
        return constrain(logits, (ax.BATCH, ax.LENGTH, ax.VOCAB))  # [batch, length, vocab]


# ----------------------------------------------------------------------------------- presets
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000,
               eos_token_id=128001, num_key_value_heads=8)
_GPT2 = dict(vocab_size=50257, max_position_embeddings=1024, rms_norm_eps=1e-5, attention_bias=True,
             attention_out_bias=True, mlp_bias=True, tie_word_embeddings=True, hidden_act="gelu_new",
             mlp_type="plain", position_embedding="learned", norm_type="layernorm",
             bos_token_id=50256, eos_token_id=50256)
_QWEN2 = dict(attention_bias=True, tie_word_embeddings=True, rope_theta=1000000.0,
              bos_token_id=151643, eos_token_id=151643)
# Qwen3 (Qwen/Qwen3-*/config.json): head_dim 128 whatever the width, qk-norm, no biases.
_QWEN3 = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=40960,
              rope_theta=1000000.0, qk_norm="head", bos_token_id=151643, eos_token_id=151645)
# OLMo 2 (allenai/OLMo-2-0425-1B/config.json): norms on the outputs, qk-norm over the projections.
_OLMO2 = dict(vocab_size=100352, rope_theta=500000.0, norm_position="post", qk_norm="projection",
              bos_token_id=None, eos_token_id=100257)
# Phi-3 mini 4k (microsoft/Phi-3-mini-4k-instruct/config.json): Mistral's model, fused tensors in HF.
_PHI3 = dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, max_position_embeddings=4096,
             rms_norm_eps=1e-5, sliding_window=2047, bos_token_id=1, eos_token_id=32000)
# Qwen3-MoE (Qwen/Qwen3-30B-A3B/config.json): Qwen3's attention, 128 experts top-8 of their own
# width, renormalised top-k; HF's router has no z-loss.
_QWEN3_MOE = dict(_QWEN3, num_key_value_heads=4, num_local_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, router_aux_loss_coef=0.001, router_z_loss_coef=0.0)
# Gemma (google/gemma-2b, gemma-2-*, gemma-3-*-pt config.json): GeGLU, (1 + w) norms, scaled
# tied embeddings, head_dim 256; Gemma 2 adds four norms a block, soft-caps and alternating
# local/global layers; Gemma 3 drops the caps for qk-norm, 5 local : 1 global, two rope bases.
_GEMMA = dict(vocab_size=256000, head_dim=256, max_position_embeddings=8192,
              hidden_act="gelu_pytorch_tanh", norm_type="rmsnorm_plus_one", scale_embeddings=True,
              tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)
_GEMMA2 = dict(_GEMMA, norm_position="both", query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
               final_logit_softcapping=30.0, sliding_window=4096, sliding_window_pattern=2)
_GEMMA3 = dict(_GEMMA, vocab_size=262144, norm_position="both", qk_norm="head",
               query_pre_attn_scalar=256, sliding_window_pattern=6, rope_theta=1000000.0,
               rope_local_base_freq=10000.0)
_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None)
_MIXTRAL = dict(num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0, rms_norm_eps=1e-5,
                num_key_value_heads=8, max_position_embeddings=32768)

PRESETS = {
    "llama2-7b": TransformerConfig(max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama3-8b": TransformerConfig(intermediate_size=14336, max_position_embeddings=8192, **_LLAMA3),
    "llama3.1-8b": TransformerConfig(
        intermediate_size=14336, max_position_embeddings=131072, **_LLAMA3,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama3.2-1b": TransformerConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
        max_position_embeddings=131072, tie_word_embeddings=True, **_LLAMA3,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "mistral-7b": TransformerConfig(
        intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=32768,
        rms_norm_eps=1e-5, sliding_window=4096),
    "qwen2.5-0.5b": TransformerConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, **_QWEN2),
    "gpt2": TransformerConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                              num_attention_heads=12, **_GPT2),
    "gpt2-medium": TransformerConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                     num_attention_heads=16, **_GPT2),
    "mixtral-8x7b": TransformerConfig(intermediate_size=14336, **_MIXTRAL),
    "qwen3-0.6b": TransformerConfig(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                    num_attention_heads=16, tie_word_embeddings=True, **_QWEN3),
    "qwen3-8b": TransformerConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                  num_attention_heads=32, **_QWEN3),
    "olmo-2-1b": TransformerConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=16, max_position_embeddings=4096, **_OLMO2),
    "phi-3-mini-4k": TransformerConfig(**_PHI3),
    "qwen3-30b-a3b": TransformerConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                       num_attention_heads=32, moe_intermediate_size=768, **_QWEN3_MOE),
    "gemma-2b": TransformerConfig(**{  # head_dim 256 = hidden / heads: spelled None, as imported
        **_GEMMA, "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": None}),
    "gemma-2-2b": TransformerConfig(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                    num_attention_heads=8, num_key_value_heads=4, **_GEMMA2),
    "gemma-2-9b": TransformerConfig(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                    num_attention_heads=16, num_key_value_heads=8, **_GEMMA2),
    "gemma-3-1b": TransformerConfig(**{
        **_GEMMA3, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "sliding_window": 512,
        "max_position_embeddings": 32768}),
    "gemma-3-4b": TransformerConfig(**{  # the text model of google/gemma-3-4b-pt
        **_GEMMA3, "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
        "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
        "sliding_window": 1024, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    # Tiny variants for tests and demos (vocab 512 fits the byte tokenizer's 259 ids).
    "llama-tiny": TransformerConfig(**_TINY),
    "mistral-tiny": TransformerConfig(**_TINY, sliding_window=8),
    "qwen2-tiny": TransformerConfig(**{**_TINY, **_QWEN2, "num_key_value_heads": 1,
                                       "bos_token_id": None, "eos_token_id": None}),  # MQA
    "gpt2-tiny": TransformerConfig(**{**_GPT2, **_TINY, "intermediate_size": 256,
                                      "num_key_value_heads": None}),
    "olmo2-tiny": TransformerConfig(**{**_OLMO2, **_TINY}),
    "phi3-tiny": TransformerConfig(**{**_PHI3, **_TINY, "sliding_window": 8}),
    "qwen3-tiny": TransformerConfig(**{**_QWEN3, **_TINY, "head_dim": 32, "tie_word_embeddings": True}),
    # one dense layer (layer 0, as mlp_only_layers says) and one MoE layer: unrolled
    "qwen3-moe-tiny": TransformerConfig(**{**_QWEN3_MOE, **_TINY, "head_dim": 32, "num_local_experts": 4,
                                           "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                           "mlp_only_layers": (0,), "scan_layers": False}),
    # Gemma: windows shorter than a test's sequence, caps that clip; 8 layers at period 6.
    "gemma-tiny": TransformerConfig(**{**_GEMMA, **_TINY, "num_key_value_heads": 1, "head_dim": 32,
                                       "bos_token_id": None, "eos_token_id": None}),
    "gemma2-tiny": TransformerConfig(**{**_GEMMA2, **_TINY, "num_hidden_layers": 4, "head_dim": 16,
                                        "query_pre_attn_scalar": 16, "sliding_window": 8,
                                        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 2.0,
                                        "bos_token_id": None, "eos_token_id": None}),
    "gemma3-tiny": TransformerConfig(**{**_GEMMA3, **_TINY, "num_hidden_layers": 8, "head_dim": 16,
                                        "query_pre_attn_scalar": 16, "sliding_window": 8,
                                        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                        "bos_token_id": None, "eos_token_id": None}),
    "mixtral-tiny": TransformerConfig(**{**_TINY, **_MIXTRAL, "num_local_experts": 4,
                                         "num_key_value_heads": 2, "max_position_embeddings": 256}),
}
for _name, _config in PRESETS.items():
    register(_name, _config)
