"""The execution record: how a model runs, apart from what it is.

Dtypes, scanning and its layout, rematerialization, the pipeline's microbatches, the attention
implementation, context-parallel attention, MoE dispatch and capacity, projection fusion, the
vocabulary-tiled loss, how decoding runs the layers and LoRA adapters. None of it changes the
model's numbers beyond float rounding (LoRA adds parameters that start at zero); a Hugging Face
config.json records none of it.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from shardzoo.models import DTYPES, ModelError, check_fields
from shardzoo.models.lora import TARGETS as LORA_TARGETS
from shardzoo.models.lora import check_lora
from shardzoo.models.tiled_loss import BACKWARDS

# checkpoint_name labels: query, key, value, attn_context, attn_out (attention.py), mlp_gate, mlp_up,
# mlp_hidden, mlp_out (layers.py).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attn_mlp": jax.checkpoint_policies.save_only_these_names("attn_context", "mlp_hidden"),
    # the inputs of everything but the matmuls, and the splash kernel's output and log-sum-exp
    # (models/splash.py RESIDUALS): the backward recomputes the MLP's activation and XLA
    # attention's scores, never a projection nor splash's forward kernel (MaxText's
    # save_qkv_proj and save_dot_except_mlp between them)
    "save_qkv_mlp": jax.checkpoint_policies.save_only_these_names("query", "key", "value", "attn_kernel", "mlp_gate",
                                                                  "mlp_up"),
    # save_qkv_mlp less the MLP's gate and up: the backward reruns those two matmuls, never
    # attention's projections nor splash's forward. It recomputes a subset of save_attn_mlp's and
    # keeps less than it where 2 x kv_heads x head_dim < the MLP's width (every family here):
    # gemma-3-1b at 4 x 2048 on a v5e chip, 458.6 ms against full remat's 470.9 (BENCHMARKS.md)
    "save_qkv": jax.checkpoint_policies.save_only_these_names("query", "key", "value", "attn_kernel"),
}
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")
# What ``shardzoo train --remat auto`` tries, fastest first: by the FLOPs each recomputes per
# token (``train/advise.py``: none 0; dots_with_no_batch_dims_saveable and save_qkv_mlp
# attention's batched matmuls; save_qkv those and the MLP's gate and up; save_attn_mlp those and
# attention's projections; full the whole forward). Memory falls the other way, but for save_qkv,
# which keeps less than save_attn_mlp (TPU.md: llama3.2-1b at 2 x 2048 needed 19.1 GB with dots_...,
# 16.3 with save_attn_mlp): save_attn_mlp comes after it for what save_qkv cannot fit and it can
# (a family whose MLP is narrower than its keys and values).
AUTO_REMAT = ("none", "dots_with_no_batch_dims_saveable", "save_qkv_mlp", "save_qkv", "save_attn_mlp", "full")
CONTEXT_STRATEGIES = ("ring", "all_gather")
MOE_DISPATCHES = ("indexed", "capacity", "dropless", "gmm", "shard_map", "auto")  # models/moe.py
DECODE_LAYERS = ("unroll", "scan")
VOCAB_CHUNKS = ("auto", "strided", "contiguous")
DECODE_ATTENTIONS = ("auto", "xla", "pallas")
DECODE_VMEM_SHARE = 7 / 8  # decode_vmem_kib "auto" on a TPU: of the chip's VMEM (v5e: 112 of 128 MiB)
# decode_vmem_kib "auto" raises the limit only for unrolled layers whose cache is at least this share of the
# weights (v5e: qwen3-0.6b batch 32, cache 1.18x the weights, 57% -> 74% of the bound; llama3.2-1b batch 1,
# 0.005x, 82% -> 78%; scanned qwen batch 32 47% -> 36%)
DECODE_VMEM_CACHE_SHARE = 1 / 4


@dataclasses.dataclass(frozen=True)
class Execution:
    """How a Transformer runs (see the module docstring)."""

    dtype: str = "float32"  # compute
    param_dtype: str = "float32"
    scan_layers: bool = True
    # (prefix, period, repeats): layers [0, prefix) unrolled, then `repeats` scanned steps of
    # `period` layers, the rest unrolled; None: chosen from the layer pattern (models/layout.py)
    scan_layout: tuple[int, int, int] | None = None
    remat_policy: str = "none"
    pipeline_microbatches: int = 0  # when the rules put layers on a mesh axis (pp); 0: one per stage
    pipeline_repeats: int = 1  # circular pipeline: passes of each microbatch through all stages
    # "auto" (cuDNN on GPU, splash on TPU, where each can), "xla", "cudnn", "splash" (Pallas, TPU;
    # interpreted elsewhere; models/splash.py says which layers and lengths it leaves to XLA)
    attention_impl: str = "auto"
    splash_block_q: int | None = None  # splash's query tile (MaxText's sa_block_q); None: 512 or what divides
    context_attention: str = "ring"  # under context parallelism: "ring" or "all_gather" K/V
    fuse_projections: bool = True  # k|v and up|gate as one matmul each (parameters unchanged)
    # tokens per chunk of the gated delta rule (models/linear_attention.py): parallel within a
    # chunk, the recurrent state carried from chunk to chunk (transformers' and fla's 64)
    linear_attention_chunk: int = 64
    moe_dispatch: str = "indexed"  # MOE_DISPATCHES; "auto": gmm on a TPU, else indexed (models/moe.py)
    capacity_factor: float = 1.25
    router_z_loss_coef: float = 0.001
    # DeepSeek-V3's auxiliary-loss-free balancing: after each step, each expert's routing bias
    # moves by this much, up when the expert took less than its share of the batch, down when
    # more (train/step.py's balance_router_bias); 0: off. Needs a router with a correction bias.
    router_bias_update_rate: float = 0.0
    # the loss from the hidden states in chunks, never the [tokens, vocab] logits at once
    # (models/tiled_loss.py): "auto" where the float32 logits of a call exceed
    # tiled_loss.AUTO_BYTES (256 MiB), "on", "off"; chunks of at most so many positions (all rows)
    # and vocabulary columns, strided (each chunk keeps a sharded axis sharded)
    tiled_loss: str = "auto"
    loss_length_chunk: int = 512
    loss_vocab_chunk: int = 8192
    # the tiled loss's vocabulary chunks: "strided" (chunk i holds columns i, i + n, ...: a sharded
    # vocabulary stays sharded in each chunk, but the head's kernel is copied into that layout every
    # step), "contiguous" (chunk i is rows i*c... of the [vocab, embed] kernel, read in place: a
    # tied embedding is never copied where the chunks divide the vocabulary, llama3.2-1b's 128,256 =
    # 16 x 8,016; else the kernel is padded, a copy), or "auto": contiguous where that reads the
    # kernel in place (the chunks divide the vocabulary and no mesh axis of size > 1 holds it),
    # strided elsewhere (tiled_loss.contiguous_chunks).
    # On a v5e chip, llama3.2-1b 2 x 2048: 295.9 ms strided, 291.8 contiguous (BENCHMARKS.md)
    loss_vocab_chunks: str = "auto"
    # the tiled language-model loss's gradients: "recompute" each chunk's logits in the backward,
    # or "fused" into the forward (one head matmul fewer; models/tiled_loss.py weighted_nll): 1.46x
    # on a CPU, but 0.67x on a v5e chip at a 262k vocabulary, where every chunk of positions reads
    # and writes the kernel gradient's float32 accumulator (BENCHMARKS.md)
    tiled_loss_backward: str = "recompute"
    lora_rank: int = 0  # > 0: LoRA adapters on lora_targets, the only params a run trains
    lora_alpha: float | None = None  # scale alpha / lora_rank; None: lora_rank
    lora_targets: tuple[str, ...] = LORA_TARGETS
    # the embedding's and the head's vocab rows padded to a multiple of this (a tensor-parallel
    # rule table needs the vocab divisible by its mesh axes; Megatron and MaxText pad the same
    # way): the padded logits are the dtype's lowest value, never sampled nor in the loss's
    # logsumexp, and no export or HF import sees the padding
    vocab_pad_multiple: int = 1
    # how Program.generate runs scanned layers: "unroll" (each layer its own weights and cache,
    # updated in place: the faster steps, a compile that grows with depth) or "scan" (the layer
    # scan of models/decode.py: compile time flat in depth, slower steps; deep models, one-off
    # generation). On a TPU v5e, llama3.2-1b bf16: 3.9 s to compile scanned against 13.9 s,
    # 258 tokens/s at batch 1 against 297 unrolled (README)
    decode_layers: str = "unroll"
    # the decoding cache of head_dim < 128 with 128 // head_dim kv heads side by side in each row
    # ("auto": on a TPU; attention_kernels.kv_pack): the chip then lays it out features-minor,
    # where one position's write per step touches its own tiles only
    kv_cache_packing: str = "auto"
    # libtpu's scoped on-chip memory (VMEM) limit for the compiled ``generate``, in KiB
    # (``--xla_tpu_scoped_vmem_limit_kib``, per compile): -1 "auto" (DECODE_VMEM_SHARE of the TPU's
    # VMEM where the layers are unrolled and the cache weighs DECODE_VMEM_CACHE_SHARE of the weights;
    # nothing elsewhere), 0 the compiler's default. Raised, XLA stops staging each layer's whole
    # cache in VMEM to write one position (v5e, qwen3-0.6b batch 32: 57% -> 74% of the bound)
    decode_vmem_kib: int = -1
    # the decoding cache's keys held transposed, positions minor ("auto": on a CPU, where a step's
    # scores then reduce over a major axis; attention_kernels.keys_transposed)
    kv_cache_transposed_keys: str = "auto"
    # the sampling loop in so many stretches of near-equal length, each a loop over a cache only
    # as long as the positions filled by its end (models/decode.py segment_ends): a step attends
    # over the positions written so far, not the whole cache; -1 "auto" (decode.cache_segments:
    # on a CPU up to 4 of at least 32 new tokens each, each stretch a loop to compile; 1 elsewhere),
    # 1 one loop over the whole cache
    decode_cache_segments: int = -1
    # a decoding step's attention over the cache: "xla" (one_query_attention) or "pallas" (a
    # kernel reading the cache in HBM, only its blocks up to the query's slot; interpreted off a
    # TPU; layers it cannot serve stay in XLA: models/decode_attention.py kernel_for); "auto":
    # the kernel on a TPU for scanned layers (decode_layers="scan") at batch >= 8 over caches of at
    # most 8 kv rows (decode_attention.AUTO_MAX_KV_ROWS), else XLA
    # (v5e, batch 32 scanned: qwen3-0.6b 47% -> 70% of the bound, llama3.2-1b 65% -> 74%;
    # batch 1: 0.99x; unrolled layers: not measured with this kernel)
    decode_attention: str = "auto"
    # decode_layers="scan": layers per iteration of the decoding layer scan (jax.lax.scan's
    # ``unroll``): fewer iterations, each loop's fixed cost paid less often, a compile that grows
    # with it (a small model's step is short beside that cost: qwen3-0.6b batch 1 scanned 71% of the
    # bound, unrolled 88%, on v5e). Measured slower on v5e: 2 and 4 layers an iteration ran
    # qwen3-0.6b at 0.71x and 0.68x (batch 1) and 0.88x and 0.85x (batch 32), llama3.2-1b batch 1 at
    # 0.56x and 0.40x of 1 (BENCHMARKS.md, ninth session)
    decode_scan_unroll: int = 1
    # the decoding kernel's keys and values per grid step, in KiB (batch rows of a block of
    # positions: decode_attention.block_b); each is buffered twice in on-chip memory. v5e, batch 32
    # scanned: 2048 against 1024 against 512, qwen3-0.6b 70.7% / 69.9% / 66.6% of the bound,
    # llama3.2-1b 74.7% / 74.1% (BENCHMARKS.md, ninth session)
    decode_block_kib: int = 2048
    # decoding's q, k and v kernels ([embed, heads, head_dim]) stored flat, [embed, heads x head_dim],
    # once per generate call (models.decode.flat_head_kernels; the numbers are the same): a TPU
    # pads an array's minor dim to its 128 lanes, so a head_dim of 64 (llama3.2-1b) doubles those
    # kernels' bytes, 8% of the model's, and every step read the padding. "auto": on a TPU where
    # head_dim is not a multiple of 128 and no mesh axis holds the heads; "on": every such kernel;
    # "off". v5e, llama3.2-1b (head_dim 64) batch 1: 79.1% -> 86.6% of the bound unrolled, 78.6% ->
    # 85.4% scanned; batch 32 scanned 74.7% / 74.3% (BENCHMARKS.md, tenth session)
    decode_flat_heads: str = "auto"

    def __post_init__(self):
        for name in ("scan_layout", "lora_targets"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        check_fields(self, {"dtype": DTYPES, "param_dtype": DTYPES, "remat_policy": tuple(REMAT_POLICIES),
                            "attention_impl": ATTENTION_IMPLS,
                            "context_attention": CONTEXT_STRATEGIES, "moe_dispatch": MOE_DISPATCHES,
                            "tiled_loss": ("auto", "on", "off"), "decode_layers": DECODE_LAYERS,
                            "loss_vocab_chunks": VOCAB_CHUNKS,
                            "kv_cache_packing": ("auto", "on", "off"), "tiled_loss_backward": BACKWARDS,
                            "kv_cache_transposed_keys": ("auto", "on", "off"),
                            "decode_attention": DECODE_ATTENTIONS, "decode_flat_heads": ("auto", "on", "off")},
                     ("pipeline_repeats", "linear_attention_chunk", "loss_length_chunk", "loss_vocab_chunk"))
        if self.pipeline_microbatches < 0:
            raise ModelError(f"pipeline_microbatches={self.pipeline_microbatches} must be >= 0 (0: one per stage)")
        layout = self.scan_layout
        if layout is not None and (len(layout) != 3 or any(not isinstance(v, int) or v < 0 for v in layout)):
            raise ModelError(f"scan_layout={layout!r} must be three integers >= 0: prefix, period, repeats")
        if not (isinstance(self.capacity_factor, (int, float)) and math.isfinite(self.capacity_factor)
                and self.capacity_factor > 0):
            raise ModelError(f"capacity_factor={self.capacity_factor!r} must be a finite number > 0")
        if not (math.isfinite(self.router_z_loss_coef) and self.router_z_loss_coef >= 0):
            raise ModelError(f"router_z_loss_coef={self.router_z_loss_coef!r} must be a finite number >= 0")
        rate = self.router_bias_update_rate
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= 0):
            raise ModelError(f"router_bias_update_rate={rate!r} must be a finite number >= 0 (0: off)")
        if isinstance(self.vocab_pad_multiple, bool) or not isinstance(self.vocab_pad_multiple, int) \
                or self.vocab_pad_multiple < 1:
            raise ModelError(f"vocab_pad_multiple={self.vocab_pad_multiple!r} must be an integer >= 1 (1: no padding)")
        vmem = self.decode_vmem_kib
        if isinstance(vmem, bool) or not isinstance(vmem, int) or vmem < -1:
            raise ModelError(f"decode_vmem_kib={vmem!r} must be an integer: -1 (auto), 0 (the compiler's default) "
                             "or the KiB of on-chip memory each op of decoding may use")
        unroll = self.decode_scan_unroll
        if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
            raise ModelError(f"decode_scan_unroll={unroll!r} must be an integer >= 1 (layers per iteration of the "
                             "decoding layer scan)")
        kib = self.decode_block_kib
        if isinstance(kib, bool) or not isinstance(kib, int) or not 16 <= kib <= 16384:
            raise ModelError(f"decode_block_kib={kib!r} must be an integer from 16 to 16384 (KiB of keys and values "
                             "the decoding kernel moves per grid step)")
        segments = self.decode_cache_segments
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1 and segments != -1:
            raise ModelError(f"decode_cache_segments={segments!r} must be an integer: -1 (auto) or the number "
                             "(>= 1) of stretches the sampling loop runs in, each over the cache filled by its end")
        block = self.splash_block_q
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 128 or block % 128):
            raise ModelError(f"splash_block_q={block!r} must be a multiple of 128 (the kernel's lanes), or null: "
                             "512 or the largest of 256, 128 that divides the length")
        check_lora(self)
