"""The decoder Transformer: its config (architecture + execution) and the model every family
builds. Which mechanisms a family uses is in its architecture record; how it runs, in its
execution record; the families themselves (their config.json, weights and presets) are in
``models/hf/``.

Each layer's block comes from its ``LayerSpec`` (window, rotary embedding, MLP kind). Layers are
scanned one period at a time (``models/layout.py``): ``layers`` (or ``layers/sub_j`` for a
period of several layers), every parameter with a leading ``layers`` axis, and ``layers_i`` for
the unrolled prefix and rest. With the rules putting ``layers`` on a mesh axis, a uniform stack
runs as a pipeline (``models/pipeline.py``).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from shardzoo.models import ModelError, splash
from shardzoo.models.arch import MOE, LayerSpec, TransformerArch, nest
from shardzoo.models.attention_kernels import keys_transposed
from shardzoo.models.blocks import BLE, BLOCK_FORMS, LayerScalar
from shardzoo.models.components import RECORDS
from shardzoo.models.config import ModelConfig, type_hints
from shardzoo.models.costs import transformer_activations, transformer_flops, transformer_params
from shardzoo.models.decode import cache_writes, join_kv, split_kv, write_cache
from shardzoo.models.decode_attention import cache_kv_rows, reads_stack
from shardzoo.models.execution import REMAT_POLICIES, Execution
from shardzoo.models.layers import ACTIVATIONS, Embed, Linear, constrain, dtype_of
from shardzoo.models.layout import Layout, layout_of
from shardzoo.models.lora import trainable_filter
from shardzoo.models.norms import make_norm
from shardzoo.models.per_layer import run_layers
from shardzoo.models.pipeline import PipelineError, make_schedule, pipeline, placement_schedule
from shardzoo.models.positions import add_positions
from shardzoo.models.ring_attention import enter_ring, unzigzag
from shardzoo.models.shared_block import check_layout, shared_inputs
from shardzoo.models.tiled_loss import HeadInputs, contiguous_chunks, head_logits, tiles
from shardzoo.sharding import axes as ax

# the parameters whose rows are the vocabulary, and that axis: padded to ``padded_vocab``
VOCAB_PARAMS = {("embed", "embedding"): 0, ("lm_head", "kernel"): 1, ("lm_head", "bias"): 0, ("lm_head_bias",): 0}


class TransformerConfig(ModelConfig):
    """A decoder LM: ``arch`` (``TransformerArch``) and ``execution`` (``Execution``)."""

    ARCH: ClassVar[type] = TransformerArch
    EXECUTION: ClassVar[type] = Execution
    task: ClassVar[str] = "lm"

    def __init__(self, arch: TransformerArch | None = None, execution: Execution | None = None):
        super().__init__(arch or TransformerArch(), execution or Execution())

    def check(self) -> None:
        check_layout(self.arch, self.layout())  # an explicit scan layout must fit the layer pattern
        if (self.arch.attention_sinks or self.arch.position_embedding == "alibi") and \
                self.execution.attention_impl == "cudnn":
            what = ("attention_sinks (a learned logit per head in the softmax)" if self.arch.attention_sinks
                    else "position_embedding='alibi' (a bias on the attention logits)")
            raise ModelError(f"{what} runs in plain XLA: attention_impl='cudnn' (jax.nn.dot_product_attention) "
                             "cannot add it; use 'auto' or 'xla'")
        if self.execution.attention_impl == "splash" and splash.serves(self.arch):
            raise ModelError(f"attention_impl='splash': {splash.serves(self.arch)}; use 'auto' or 'xla'")
        if self.execution.attention_impl == "cudnn" and self.arch.has_chunked_layers:
            raise ModelError(f"attention_impl='cudnn' cannot mask chunks (attention_chunk_size="
                             f"{self.arch.attention_chunk_size}); use attention_impl 'xla' or 'auto'")
        router = self.arch.moe.router_kind if self.arch.moe else None
        if self.execution.router_bias_update_rate and router != "sigmoid_groups":
            raise ModelError(f"router_bias_update_rate={self.execution.router_bias_update_rate} balances a router "
                             "with a correction bias (router_kind sigmoid_groups: DeepSeek-V3's); "
                             + (f"this model's router is {router!r}" if router else "this model has no MoE layers"))

    @classmethod
    def field_types(cls) -> dict[str, tuple[str, object]]:
        """The records' fields, and the sub-records' fields by their flat names (``SubRecord.FLAT``)."""
        out = super().field_types() | {"parallel_residual": ("arch", bool)}  # block_form's flag before it (arch.nest)
        for record in RECORDS.values():
            hints = type_hints(record)
            out.update({flat: ("arch", hints[name]) for flat, name in record.FLAT.items()})
        return out

    def replace(self, **fields):
        """A copy with fields replaced by name, a sub-record's by its flat names too (``arch.nest``)."""
        return super().replace(**nest(fields, self.arch))

    # ------------------------------------------------------------------ layers
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        return self.arch.layer_specs()

    def layout(self) -> Layout:
        """Which layers are scanned (``models/layout.py``); none with the ``per_layer`` record,
        whose layers pass keys and values on (models/per_layer.py)."""
        e = self.execution
        return layout_of(self.arch.layer_specs(), e.scan_layers and not self.arch.per_layer, e.scan_layout)

    def param_layout(self) -> list[tuple[tuple[str, ...], tuple[int, ...], bool]]:
        """Where each layer's parameters live: ``(path prefix, layers, stacked)``."""
        return self.layout().param_layout()

    def resolved(self) -> TransformerConfig:
        """With the scan layout spelled out, as checkpoints record it."""
        return self.replace(scan_layout=self.layout().as_tuple())

    def moe_config(self):
        from shardzoo.models.moe import MoeConfig

        return MoeConfig.of(self.arch, self.execution)

    # ------------------------------------------------------------------ the model interface
    def build(self, placement=None) -> Transformer:
        return Transformer(self, placement)

    def sample_inputs(self, batch_size: int, seq_len: int | None):
        return (jax.ShapeDtypeStruct((batch_size, seq_len or 1), jnp.int32),)

    def num_params(self, active: bool = False) -> int:
        """Parameters of the model (``active``: counting only the top-k experts of MoE layers)."""
        return transformer_params(self.arch, active)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (MaxText): 6 x matmul params (active) + causal attention."""
        return transformer_flops(self.arch, seq_len)

    def pipeline_plan(self, batch_size: int, shards) -> dict | None:
        """The pipeline schedule (``models/pipeline.py``) when the rules split the layer stack
        (``shards((layers,)) > 1``), as the plan shows it; else None."""
        stages = shards((ax.LAYERS,))
        if stages == 1 or not self.layout().repeats:
            return None
        e = self.execution
        sched = make_schedule(self.arch.num_hidden_layers, batch_size, stages=stages,
                              microbatches=e.pipeline_microbatches, repeats=e.pipeline_repeats,
                              batch_shards=shards((ax.BATCH,)))
        layers = sched.layers_per_stage * sched.repeats
        return sched.to_dict() | {"text": sched.describe(),
                                  "stages_layers": f"{layers} / {self.arch.num_hidden_layers}"}

    def activation_estimate(self, batch_size: int, seq_len: int, shards):
        """Activation bytes a train step keeps per device (``models/costs.py``)."""
        return transformer_activations(self, batch_size, seq_len or 1, shards,
                                       self.pipeline_plan(batch_size, shards))

    @property
    def padded_vocab(self) -> int:
        """The embedding's and the head's rows: ``vocab_size`` rounded up to ``vocab_pad_multiple``."""
        return -(-self.arch.vocab_size // self.execution.vocab_pad_multiple) * self.execution.vocab_pad_multiple

    @property
    def max_positions(self) -> int:
        return self.arch.max_position_embeddings

    @property
    def trains(self):
        return trainable_filter(self.execution)

    @property
    def remat_policies(self) -> tuple[str, ...]:
        return tuple(REMAT_POLICIES)

    @classmethod
    def upgrade_fields(cls, flat: dict) -> dict:
        """A flat config of shardzoo before the family layer in today's fields: the Gemma
        pattern (``sliding_window_pattern``) as ``layer_types``, the MoE pattern
        (``moe_layer_freq``, ``mlp_only_layers``) as ``mlp_layer_types``, and the scan layout
        that version built (one period from layer 0, the rest unrolled), so its params load."""
        from shardzoo.models.arch import DENSE, FULL, SLIDING

        n = flat.get("num_hidden_layers", TransformerArch.num_hidden_layers)
        period = flat.pop("sliding_window_pattern", None)
        if period:
            flat["layer_types"] = [FULL if (i + 1) % period == 0 else SLIDING for i in range(n)]
        freq, dense = flat.pop("moe_layer_freq", 1), set(flat.pop("mlp_only_layers", None) or ())
        if flat.get("num_local_experts") and (freq > 1 or dense):
            flat["mlp_layer_types"] = [MOE if (i + 1) % freq == 0 and i not in dense else DENSE
                                       for i in range(n)]
        if flat.get("scan_layers", True):
            p = period or 1
            flat["scan_layout"] = [0, p, n // p]
        return flat


# ----------------------------------------------------------------------------------- blocks
def _block_class(config: TransformerConfig, decode: bool, prevent_cse: bool = False, block=None):
    """``block`` (None: Block), wrapped in the execution's remat policy when training (``prevent_cse`` outside a
    scan, where XLA could otherwise merge the recomputation back into the forward)."""
    policy, block = config.execution.remat_policy, block or Block
    if policy == "none" or decode:
        return block
    return nn.remat(block, policy=REMAT_POLICIES[policy], prevent_cse=prevent_cse)


class Block(nn.Module):
    """One layer: its token mixer and its MLP (``models/components.py``: attention, a short
    convolution, Gated DeltaNet, Mamba2, ...; a dense or MoE MLP) joined to the residual stream by
    the architecture's block form (``models/blocks.py``: sequential with pre, post or both norms;
    parallel from one norm or two)."""

    config: TransformerConfig
    spec: LayerSpec
    placement: object = None
    deterministic: bool = True
    decode: bool = False
    scanned: bool = False  # return (x, None) as nn.scan wants

    @nn.compact
    def __call__(self, x, positions, segment_ids, extra=None):
        # extra: a shared block's output for the mixer's input (sequential blocks: models/shared_block.py)
        x = BLOCK_FORMS[self.config.arch.block_form].apply(self, x, positions, segment_ids,
                                                           *(() if extra is None else (extra,)))
        if self.config.arch.layer_scalar:
            x = LayerScalar(self.config.execution.param_dtype, name="layer_scalar")(x)
        return (x, None) if self.scanned else x  # [batch, length, embed]


class PeriodBlock(nn.Module):
    """One scanned step of a layer pattern: a period of blocks with their own parameters
    (``sub_0``, ``sub_1``, ...); at step k, ``sub_j`` runs layer ``prefix + k * period + j``."""

    config: TransformerConfig
    specs: tuple[LayerSpec, ...]
    placement: object = None
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        block = _block_class(self.config, self.decode)
        for j, spec in enumerate(self.specs):
            x = block(self.config, spec, self.placement, self.deterministic, self.decode,
                      name=f"sub_{j}")(x, positions, segment_ids)
        return x, None


def _apply_layer(config, spec, placement, block, params, x, positions, segment_ids):
    """One scanned layer, outside the scan: the pipeline's stage function."""
    return block(config, spec, placement, parent=None).apply({"params": params}, x, positions, segment_ids)


def pipeline_schedule(config: TransformerConfig, placement, layout: Layout, batch_size: int):
    """The pipeline schedule ``placement`` asks for (``models/pipeline.py``), or None."""
    e = config.execution
    sched = placement_schedule(placement, config.arch.num_hidden_layers, batch_size,
                               microbatches=e.pipeline_microbatches, repeats=e.pipeline_repeats)
    if sched is None:
        return None
    if layout.period > 1 or layout.unrolled:
        raise PipelineError("pipeline parallelism (rules put layers on a mesh axis) needs one stack of "
                            f"alike layers; this model scans {layout.repeats} periods of {layout.period} "
                            f"and unrolls layers {list(layout.unrolled)}")
    if config.arch.moe:
        raise PipelineError("pipeline parallelism (rules put layers on a mesh axis) runs dense layers only;"
                            f" num_local_experts={config.arch.moe.num_local_experts}")
    return sched


class Transformer(nn.Module):
    """The decoder LM. ``__call__(inputs, positions, segment_ids, deterministic, decode)`` -> logits;
    with ``head=False``, ``HeadInputs`` (the normed hidden states and the head's weights) instead.

    With ``decode=True`` the layers read and write a "cache" collection (see models/decode.py);
    the first such call (``init``) sizes the cache by the length of its inputs.
    """

    config: TransformerConfig
    placement: object = None  # sharding.partition.Placement: the mesh and rules (None: one device)

    @nn.compact
    def __call__(self, inputs, positions=None, segment_ids=None, deterministic=True, decode=False, head=True):
        cfg, a, e, placement = self.config, self.config.arch, self.config.execution, self.placement
        if positions is None:
            if decode:
                raise ValueError("decoding needs explicit positions")
            positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        # context parallelism: the tokens in the ring's zig-zag order (ring_attention.py)
        ring, (inputs, positions, segment_ids) = enter_ring(
            placement, decode, self.is_initializing(), inputs, positions, segment_ids)
        kw = dict(dtype=e.dtype, param_dtype=e.param_dtype, init_std=a.initializer_range)
        embed = Embed(cfg.padded_vocab, a.hidden_size, name="embed", real_rows=a.vocab_size, **kw)
        x = embed(inputs)  # [batch, length, embed]
        if a.scale_embeddings:  # Gemma: the scale rounded to the compute dtype, as HF does
            x = x * jnp.asarray(a.hidden_size**0.5, x.dtype)
        if a.embedding_multiplier != 1.0:  # Granite
            x = x * jnp.asarray(a.embedding_multiplier, x.dtype)
        x = add_positions(x, positions, a, kw)  # a learned table or sinusoids (models/positions.py)
        if a.embedding_norm:  # BLOOM
            x = make_norm(cfg, "embed_norm")(x)
        x = constrain(x, BLE, placement)

        specs, layout = a.layer_specs(), cfg.layout()
        flags = dict(deterministic=deterministic, decode=decode)
        block = _block_class(cfg, decode, prevent_cse=True)
        if a.per_layer:  # Gemma 3n's layers, unrolled (models/per_layer.py)
            x = run_layers(self, x, inputs, positions, segment_ids, specs,
                           functools.partial(_block_class, cfg, decode, True), **flags)
        else:
            extra = shared_inputs(cfg, placement, x, positions, segment_ids, decode)  # Zamba2's shared blocks
            for i in range(layout.prefix):
                x = block(cfg, specs[i], placement, name=f"layers_{i}", **flags)(x, positions, segment_ids, extra(i, x))
            if layout.repeats:
                x = self._scan(x, positions, segment_ids, specs, layout, **flags)
            for i in range(layout.prefix + layout.scanned, a.num_hidden_layers):
                x = block(cfg, specs[i], placement, name=f"layers_{i}", **flags)(x, positions, segment_ids, extra(i, x))

        if ring:
            x = unzigzag(x, placement)  # the natural order again; the norm and head work per token
        if BLOCK_FORMS[a.block_form].final_norm:
            x = make_norm(cfg, "final_norm")(x)
        dt = dtype_of(e.dtype)
        if a.score_head:  # a reward model: one score per token, read at a sequence's last token
            return Linear((1,), (ax.EMBED, ax.SCORE), False, name="score", **kw)(x).astype(jnp.float32)  # [b, l, 1]
        if a.head_transform is not None:  # ModernBERT's prediction head: dense, activation, norm
            h = Linear((a.hidden_size,), (ax.EMBED, ax.MLP), name="head_dense", **kw)(x)  # mlp-sharded, as an MLP's
            x = make_norm(cfg, "head_norm")(constrain(ACTIVATIONS[a.head_transform](h), BLE, placement))
        if a.tie_word_embeddings:
            kernel, bias = embed.embedding.astype(dt).T, None  # [embed, vocab]
            if a.lm_head_bias:  # a tied head's own bias
                bias = self.param("lm_head_bias", nn.with_logical_partitioning(nn.initializers.zeros, (ax.VOCAB,)),
                                  (cfg.padded_vocab,), dtype_of(e.param_dtype)).astype(dt)
        else:
            kernel, bias, _ = Linear((cfg.padded_vocab,), (ax.EMBED, ax.VOCAB), a.lm_head_bias, name="lm_head",
                                     real_out=a.vocab_size, **kw).weights((a.hidden_size,))
        out = HeadInputs(x, kernel, bias, a.logits_scaling, a.logit_scale, a.final_logit_softcapping or 0.0,
                         e.loss_length_chunk, e.loss_vocab_chunk, a.vocab_size, e.tiled_loss_backward,
                         contiguous=contiguous_chunks(e, cfg.padded_vocab, placement))
        if not head:  # the loss tiles the head itself (models/tiled_loss.py)
            return out.replace(hidden=constrain(x, BLE, placement))
        return constrain(head_logits(out), (ax.BATCH, ax.LENGTH, ax.VOCAB), placement)  # [batch, length, vocab]

    def tiles_loss(self, tokens: int) -> bool:
        """Whether a loss over ``tokens`` tokens asks for ``head=False`` (execution.tiled_loss)."""
        return tiles(self.config.execution, tokens, self.config.arch.vocab_size)

    def _scan(self, x, positions, segment_ids, specs, layout: Layout, deterministic, decode):
        """The scanned layers: one period a step (or the pipeline over the stack)."""
        cfg, placement = self.config, self.placement
        period = tuple(specs[layout.prefix + j] for j in range(layout.period))
        sched = None if decode else pipeline_schedule(cfg, placement, layout, x.shape[0])
        block = _block_class(cfg, decode)
        if sched is not None and not self.is_initializing():  # init builds the same tree by nn.scan
            fn = functools.partial(_apply_layer, cfg, period[0], placement, block)
            return pipeline(sched, placement, fn, self.variables["params"]["layers"], x, positions, segment_ids)
        if decode and self.has_variable("cache", "layers"):  # the cache exists: decode it in place
            return self._decode_scan(x, positions, segment_ids, period)
        stack = nn.scan(
            block if layout.period == 1 else PeriodBlock,
            variable_axes={c: 0 for c in ("params", "cache", "losses", "metrics", "router_load", "intermediates")},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=layout.repeats,
            metadata_params={nn.PARTITION_NAME: ax.LAYERS},
        )
        if layout.period == 1:
            layers = stack(cfg, period[0], placement, deterministic, decode, scanned=True, name="layers")
        else:
            layers = stack(cfg, period, placement, deterministic, decode, name="layers")
        x, _ = layers(x, positions, segment_ids)
        return x

    def _decode_scan(self, x, positions, segment_ids, period):
        """Decoding through the scanned layers (``models/decode.py``): the stacked cache is read
        only inside the layer scan, each layer giving back what it wrote (``cache_writes``), and
        written once after it (``write_cache``): a new token's keys and values land in place, where
        nn.scan's per-layer cache outputs would build a new stacked cache every step. For the
        Pallas decoding kernel the keys and values go through the scan whole instead (``split_kv``):
        each layer writes its position into the stack and the kernel reads its layer there."""
        cfg, placement = self.config, self.placement
        params = nn.meta.unbox(self.variables["params"]["layers"])
        cache = nn.meta.unbox(self.variables["cache"]["layers"])
        if len(period) == 1:
            layer = Block(cfg, period[0], placement, decode=True, parent=None)
        else:
            layer = PeriodBlock(cfg, period, placement, decode=True, parent=None)
        length, keys_t = x.shape[1], keys_transposed(cfg.execution)
        # the keys and values whole, carried and written in place, where the decoding kernel reads them
        kv = None
        if reads_stack(cfg.execution, length, placement, x.shape[0], cache_kv_rows(cache)):
            kv, cache = split_kv(cache)
        index = jnp.arange(jax.tree.leaves(params)[0].shape[0], dtype=jnp.int32)

        def step(carry, xs):
            x, kv = carry
            p, c, i = xs  # this layer's params, cache and index
            x, new = layer.apply({"params": p, "cache": join_kv(c, kv, i)}, x, positions, segment_ids,
                                 mutable=["cache"])
            x = x[0] if isinstance(x, tuple) else x  # PeriodBlock returns (x, None)
            kv, new = split_kv(new["cache"]) if kv else (None, new["cache"])
            return (x, kv), cache_writes(c, new, length, keys_t)

        (x, kv), writes = jax.lax.scan(step, (x, kv), (params, cache, index), unroll=cfg.execution.decode_scan_unroll)
        self.put_variable("cache", "layers", join_kv(write_cache(cache, writes, keys_t), kv))
        return x
