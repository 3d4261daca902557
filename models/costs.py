"""What a model costs: the memory a training step needs per device beyond its state.

Each config's ``activation_estimate(batch_size, seq_len, shards)`` calls one of these with a
``shards(logical_names) -> int`` from the plan (how many devices split an array with those
names under the rules), so the plan reads no model field. The plan adds it to parameters,
gradients (as parameters) and optimizer state; the sum is meant to match XLA's compiled total
(argument + output + temp - alias) of the train step, whose temporaries are the gradients plus
what is counted here. Every term is a count of arrays the step really holds, each
``tokens * elements_per_token * dtype_bytes / shards(names)``; nothing is fitted.

Transformer (a config with ``num_hidden_layers``), bytes per device::

    batch + mask + n_layers * saved(policy) + (policy != "none") * saved("none")
          + backward + head

``saved(p)`` is one layer's residuals that policy ``p`` keeps for the backward pass. For
``none`` these are what ``jax.ad_checkpoint.print_saved_residuals`` lists for a zoo block
(checked against XLA's buffer assignment on CPU, where the scanned layers' residuals appear
stacked ``[layers, ...]``). Per token (D hidden, F intermediate, H heads, K kv heads, Dh head
dim, L seq_len, E experts, C capacity slots per expert and row; compute dtype unless said):

    block_input D                the scan carry: kept by every policy
    attn_norm 3 D, float32       the norm's float32 intermediates (RMSNorm: the square's
                                 derivative, x * rsqrt, and the scaled output)
    query H*Dh                   rotated and regrouped for GQA ([batch, len, K, H/K, Dh])
    key K*Dh, value K*Dh         and kv_proj K*Dh: the fused k|v matmul's output (latent
                                 attention: keys and queries qk_nope + qk_rope wide, values and
                                 context v_head_dim, no kv_proj)
    latent, latent_norm          latent attention: the normed kv latent (kv_lora_rank) and
                                 query latent (q_lora_rank), the inputs of kv_b and q_b, and
                                 their RMSNorms' 3 float32 intermediates each
    scores H*L                   masked logits [batch, K, H/K, L, L]   } 0 with cuDNN
    probs H*L, float32           the softmax (jax computes it in f32)   } attention
    qk_norm 3 (H+K)*Dh, float32  with qk-norm (head, heads, projection): the norms' float32
                                 intermediates, as attn_norm's (llama-tiny's 4 layers with qk-norm:
                                 plan/compiled 0.90 without them)
    softcap 2 H*L                with attn_logit_softcapping: tanh's output and its derivative
                                 (such attention always runs in plain XLA)
    attn_context H*Dh            the input of the output projection
    attn_residual D              x + attention: the input of the MLP norm
    mlp_norm 3 D, float32        as attn_norm
    post_attn_norm, post_mlp_norm 3 D float32 each, with norm_position "both" (Gemma 2/3: four
                                 norms a block; "post" moves the two norms, it adds none)
                                 With parallel_residual (Phi, Cohere) neither attn_residual nor
                                 mlp_norm: the MLP reads the attention's normed input.
    dense MLP, gated: mlp_gate F, mlp_up F, mlp_proj F (the fused up|gate matmul's output;
      0 unfused), mlp_hidden F (swiglu's output, the down projection's input); plain: mlp_up F,
      mlp_hidden F; gated with another activation (GeGLU), mlp_act F: one more intermediate of
      the activation (jax lists five for tanh-GELU; XLA's fusions keep about one: gemma3-tiny's
      plan/compiled 0.97 with one, 1.17 with five; gemma2-tiny 0.90); xIELU (hidden_act xielu,
      either kind): xielu 4 F, the four float residuals jax lists beside its input (measured:
      apertus-tiny at F=1024, B=8, L=256 holds 11.9 F more per token than arcee-tiny's relu2
      without remat, 3 layers' worth: 2 saved, 1 backward)
    MoE MLP (capacity dispatch; replaces the dense MLP): router E x 2 float32 (softmax and
      z-loss exp); dispatch and combine masks E*C each ([batch, L, E, C]: the tokens' slots);
      expert buffers [E, batch, C, -] in and out, 2 x E*C*D/L; the experts' gate and up
      matmuls, silu (3 residuals) and their product, 6 x E*C*F/L (plain experts, expert_type
      plain: up and the activation's output, 2 x E*C*F/L, estimated); (GPT-OSS's clamped SwiGLU,
      swiglu_limit: 3 x E*C*F/L more, measured: gpt-oss-tiny's compiled temp grows by 3.0 of them
      with the clamps, and not measurably with attention sinks); with a shared expert
      (shared_expert_intermediate_size S) its gate, up (and fused) and hidden, S each (a plain
      one, mlp_type plain: up and hidden).

A conv layer (LFM2's gated short convolution, ``models/conv_mixer.py``) keeps none of
attention's terms; instead, d = hidden_size channels each: conv_in 3 d (b, c, x: slices of the
fused matmul's output, which jax does not keep), conv_input d (b * x), conv_out d (the
convolution's output) and attn_context d (c times it, the out projection's input); conv_masks
conv_kernel float32 (each tap's 0/1 for packed segments).

A linear-attention layer (Qwen3-Next's Gated DeltaNet, ``models/linear_attention.py``; K key
heads and V value heads of dk and dv features, chunks of C tokens, w taps) keeps none of
attention's terms either; instead: gdn_in 2 K dk + 2 V dv + 2 V (the projections q, k, v, z, b,
a), gdn_conv 2 (2 K dk + V dv) (each convolution's output and its SiLU) and 3 w float32 masks;
gdn_qk 2 V dk float32 (q and k normalised, one per value head); gdn_chunk V (3 C + 3 dk + dv +
dk dv / C) float32 (each chunk's decays, triangular system and q.k, its solved u and w, the
decayed q and k, and the state entering it); gdn_out 2 V dv float32 (the rule's output and its
norm) and attn_context V dv (the out projection's input).

The other policies keep named subsets (``POLICY_TERMS``); with remat (policy != "none") the
backward pass recomputes one layer whole, hence ``saved("none")`` once more.

``mask``: the attention mask (bool [batch, K, H/K, L, L]), made once outside the layer scan
and kept for every layer's backward: H*L bytes per token (0 with cuDNN).
Ring attention (context parallelism over a ring of N devices, ``shards.ring``; models/
ring_attention.py): no ``scores`` and no ``mask``; each block pair keeps its float32 softmax
numerators only, of the pairs it computes: the diagonal block and half of every other, so
``probs`` is (N + 1) / (2N) of the length-sharded figure (H*L^2 (N+1) / (2 N^2) per row and
device). ``ring_diagonal``: the backward of the diagonal block holds two float32 cotangents of
its (L/N)^2 scores. With ``context_attention="all_gather"`` every device keeps the numerators
of its queries against the whole row (the length-sharded ``probs``), no ``scores`` or ``mask``.
``backward``: the backward pass of one layer holds the cotangent of each array the layer
saved, so one more ``saved("none")`` of the largest layer (or the logits' float32 cotangent
V, when larger).
``head``: the final norm's 3 D float32 intermediates and the log-softmax's float32 ``exp``
of the logits, V per token (and with final_logit_softcapping tanh's output and its
derivative, 2 V). With the tiled loss (``models/tiled_loss.py``, ``execution.tiled_loss``)
only one chunk of them exists at a time: V becomes ``loss_vocab_chunk`` and the length
``loss_length_chunk``.
``batch``: the step's input arrays (inputs, targets, positions, segment_ids int32; weights
float32): 20 bytes per token.
``pipeline`` (the rules split the layer stack into S stages, ``models/pipeline.py``): every
iteration is rematerialized, so the layer terms become one iteration's: ``layers_per_stage``
layers of one microbatch (``/ M``) for the backward's recompute, and the ``stash`` holds the
embedded input, its microbatched copy, the circular store and each iteration's stage input
(``3 + iterations / M`` times D per token). The head runs on the whole batch on every stage.
Not counted: XLA's buffers of the optimizer update (donated state: it updates in place),
collective buffers, and a layer's transient copies (transposes, gathered parameters under
fsdp), which XLA overlaps with the arrays above.

MLP (a config with ``depth`` and ``width``): the batch's features, each hidden layer's pre-
and post-activation [batch, width] (plus a dropout mask when dropout_rate > 0) and the head's
logits in the compute dtype and in float32, each divided by its shards.
"""


from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from shardzoo.models import sparse_attention
from shardzoo.models.attention import attention_kernel
from shardzoo.models.tiled_loss import tiles
from shardzoo.sharding import axes as ax

BLE = (ax.BATCH, ax.LENGTH, ax.EMBED)
BL = (ax.BATCH, ax.LENGTH)
BLHD = (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM)
BLKD = (ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM)
BLF = (ax.BATCH, ax.LENGTH, ax.MLP)
BHL = (ax.BATCH, ax.HEADS, ax.LENGTH, None)  # attention scores: [batch, heads, q, k]
BLEC = (ax.BATCH, ax.LENGTH, ax.EXPERT, ax.CAPACITY)  # MoE dispatch and combine masks
ECD = (ax.EXPERT, ax.BATCH, ax.CAPACITY, ax.EMBED)  # MoE expert buffers
ECF = (ax.EXPERT, ax.BATCH, ax.CAPACITY, ax.MLP)

# What each remat policy keeps of a layer ("none": every term below that is not 0 there).
_DOTS = ("block_input", "query", "key", "value", "kv_proj", "conv_in", "gdn_in", "attn_out", "mlp_gate", "mlp_up",
         "mlp_proj", "mlp_out", "router_logits", "expert_in", "expert_out", "expert_proj",
         "shared_gate", "shared_up", "shared_proj")
POLICY_TERMS = {
    "full": ("block_input",),
    "dots_saveable": _DOTS + ("scores", "attn_context"),
    "dots_with_no_batch_dims_saveable": _DOTS,
    "save_attn_mlp": ("block_input", "attn_context", "mamba_context", "mlp_hidden", "shared_hidden"),
}
# Terms that only a remat policy saves (autodiff without remat does not keep them).
_POLICY_ONLY = ("attn_out", "mlp_out", "router_logits")


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    bytes: int  # per device
    policy: str
    formula: str
    terms: dict  # name -> bytes per device (per layer for a Transformer's layer terms)


def _term(tokens, per_token, names, nbytes, shards) -> int:
    return int(tokens * per_token * nbytes) // shards(names)


def _saved(terms: dict, policy: str) -> int:
    keep = POLICY_TERMS.get(policy)
    if keep is None:
        return sum(v for n, v in terms.items() if n not in _POLICY_ONLY)
    return sum(v for n, v in terms.items() if n in keep)


def _latent_attention_params(a) -> int:
    """Multi-head latent attention's projections: q (or q_a, q_b), kv_a, k_rope, kv_b, o."""
    d, h = a.hidden_size, a.num_attention_heads
    q_out = h * a.qk_head_size
    q = d * a.q_lora_rank + a.q_lora_rank * q_out if a.q_lora_rank else d * q_out
    kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + h * a.v_head_dim * d


def _mamba_matmul_params(a) -> int:
    """A mamba mixer's matmul parameters (models/ssm.py): in_proj (z, x, B, C, dt), out_proj
    and the convolution's taps over x, B, C."""
    d, inner, gn = a.hidden_size, a.mamba_inner, a.mamba_n_groups * a.ssm_state_size
    return d * (2 * inner + 2 * gn + a.mamba_num_heads) + inner * d + a.mamba_conv_kernel * (inner + 2 * gn)


def _mamba_extras(a) -> int:
    """A mamba mixer's other parameters: dt_bias, A_log, D, the gated norm, biases."""
    d, inner, gn, h = a.hidden_size, a.mamba_inner, a.mamba_n_groups * a.ssm_state_size, a.mamba_num_heads
    norm = inner * (a.mamba_norm != "none")
    return 3 * h + norm + a.mamba_conv_bias * (inner + 2 * gn) + a.mamba_proj_bias * (2 * inner + 2 * gn + h + d)


def _mamba_scan_flops(a) -> float:
    """Multiply-adds per token of a mamba layer's chunked scan (models/ssm.py ``ssd``): C.B and
    the masked product with x over half a chunk on average, and each token's part of its
    chunk's state in and out."""
    q, h, p, n = a.mamba_chunk_size, a.mamba_num_heads, a.mamba_head_dim, a.ssm_state_size
    return q / 2 * (a.mamba_n_groups * n + h * p) + 2 * h * p * n


def _linear_attention_params(a) -> int:
    """A Gated DeltaNet's projections (q, k, v, z, b, a; out) and convolution taps."""
    keys, values = a.linear_num_key_heads * a.linear_key_head_dim, a.linear_num_value_heads * a.linear_value_head_dim
    proj = a.hidden_size * (2 * keys + 2 * values + 2 * a.linear_num_value_heads) + values * a.hidden_size
    return proj + a.linear_conv_kernel_dim * (2 * keys + values)


def _layer_matmul_params(a, moe: bool, active: bool, conv: bool = False, mixer: str = "attention",
                         mlp: str = "dense") -> int:
    """A layer's matmul parameters (a conv layer's: in_proj's three and out_proj, and the
    convolution's taps, each multiplied once per token; a linear-attention layer's likewise; a
    mamba layer's ``_mamba_matmul_params``;
    an "attention+mamba" layer's both;
    a layer without a mixer or an MLP (``mixer`` / ``mlp`` "none") none of that half's)."""
    d, hd = a.hidden_size, a.head_size
    if mixer == "none":
        attn = 0
    elif mixer == "mamba":
        attn = _mamba_matmul_params(a)
    elif conv:
        attn = 4 * d * d + a.conv_kernel * d
    elif mixer == "linear_attention":
        attn = _linear_attention_params(a)
    else:
        attn = _latent_attention_params(a) if a.latent else d * hd * (2 * a.num_attention_heads + 2 * a.kv_heads)
        attn += d * hd * a.num_attention_heads * a.attn_output_gate  # the output gate's projection
        attn += _mamba_matmul_params(a) if mixer == "attention+mamba" else 0
    if mlp == "none":
        return attn
    if not moe:
        return attn + (3 if a.mlp_type == "gated" else 2) * d * a.intermediate_size
    experts = a.num_experts_per_tok if active else a.num_local_experts
    # the shared expert is a dense MLP of mlp_type, always active
    shared = (3 if a.mlp_type == "gated" else 2) * d * a.shared_expert_intermediate_size + d * a.shared_expert_gate
    per_expert = (3 if a.expert_type == "gated" else 2) * d * a.expert_size  # gate (gated), up, down
    return attn + d * a.num_local_experts + experts * per_expert + shared


def buffers(a) -> tuple[tuple[str, str], ...]:
    """The leaves (their last two path keys) that transformers holds as buffers, not
    parameters: not counted by ``transformer_params``. Ernie 4.5 MoE's correction bias is a
    parameter there (one that no gradient trains), DeepSeek-V3's a buffer."""
    out = (("xielu", "beta"), ("xielu", "eps"))
    return out + ((("moe", "router_bias"),) if a.router_kind == "sigmoid_groups" else ())


def _attention_extras(a, per: int) -> int:
    """An attention layer's parameters beside its projections: qk-norms, biases, sinks."""
    hd, total = a.head_size, 0
    if a.qk_norm not in ("none", "l2"):  # l2: no weight
        qk_per = 1 if a.qk_norm_no_bias else per
        total += qk_per * hd * (2 if a.qk_norm == "head" else a.num_attention_heads + a.kv_heads)
    if a.attention_bias:
        total += hd * (a.num_attention_heads * (1 + a.attn_output_gate) + 2 * a.kv_heads)
    if a.attention_out_bias:
        total += a.hidden_size
    if a.attention_sinks:
        total += a.num_attention_heads
    return total


def transformer_params(a, active: bool = False) -> int:
    """Parameters of a Transformer architecture ``a`` (``active``: only the top-k experts of
    MoE layers); equal to transformers' count of the same config (tests/hf). Not counted, as
    transformers does not: the sigmoid router's correction bias (``moe/router_bias``, a buffer
    there, trained by no gradient), and xIELU's ``beta`` and ``eps`` (buffers there too, fixed:
    ``buffers``); its ``alpha_p`` and ``alpha_n`` count, one each per layer."""
    d = a.hidden_size
    head = d if a.score_head else 0 if a.tie_word_embeddings else a.vocab_size * d  # a reward model: [embed, 1]
    total = a.vocab_size * d + head
    if a.position_embedding == "learned":
        total += a.max_position_embeddings * d
    per = 2 if a.norm_type == "layernorm" else 1  # weight and bias
    norm = d * per
    total += norm  # final norm
    norms = 4 if a.norm_position == "both" else 1 if a.parallel_residual else 2
    if a.lm_head_bias and not a.score_head:
        total += a.vocab_size
    for spec in a.layer_specs():
        moe = spec.mlp == "moe"
        half = spec.mixer == "none" or spec.mlp == "none"  # one half of the block: its norms only
        total += _layer_matmul_params(a, moe, active, spec.mixer == "conv", spec.mixer, spec.mlp)
        total += (norms // 2 if half else norms) * norm
        if spec.mixer == "conv":  # no attention: the conv's biases (in_proj 3 d, taps d, out_proj d)
            total += 5 * d * a.conv_bias
        elif spec.mixer == "mamba":
            total += _mamba_extras(a)
        elif spec.mixer == "linear_attention":  # A_log and dt_bias per value head, the gated norm's weight
            total += 2 * a.linear_num_value_heads + a.linear_value_head_dim
        elif spec.mixer == "none":
            pass
        else:  # attention (and beside it a mamba mixer)
            total += _attention_extras(a, per) + (a.kv_lora_rank + (a.q_lora_rank or 0) if a.latent else 0)
            total += sparse_attention.params(a) if a.index_topk else 0
            total += _mamba_extras(a) if spec.mixer == "attention+mamba" else 0
        if moe:
            total += a.num_local_experts * (a.router_bias + a.expert_bias * (2 * a.expert_size + d)
                                            + (a.router_kind == "softmax_bias"))  # its correction bias
        if spec.mlp == "none":
            continue
        if a.hidden_act == "xielu" and not moe:  # alpha_p, alpha_n (arch refuses xielu with MoE)
            total += 2
        if a.mlp_bias and not moe:
            total += a.intermediate_size * (2 if a.mlp_type == "gated" else 1) + d
        if a.mlp_bias and moe and a.shared_expert_intermediate_size:  # the shared expert's MLP
            total += a.shared_expert_intermediate_size * (2 if a.mlp_type == "gated" else 1) + d
    return total


def transformer_flops(a, seq_len: int) -> float:
    """Training FLOPs per token (MaxText): 6 x matmul params (active) + causal attention, each
    layer with its own window or chunk."""
    specs = a.layer_specs()
    matmul = sum(_layer_matmul_params(a, s.mlp == "moe", True, s.mixer == "conv", s.mixer, s.mlp) for s in specs)
    matmul += (1 if a.score_head else a.vocab_size) * a.hidden_size  # output head (tied or not; a reward model's score)
    keys = 0.0  # keys a query sees on average, summed over layers
    state = 0.0  # the gated delta rule's multiply-adds per token, summed over layers
    indexer = 0.0  # sparse attention's indexers (models/sparse_attention.py), forward only
    for s in specs:
        w, c = s.window, s.chunk
        if s.mixer in ("mamba", "attention+mamba"):  # the scan's products (2 x 3 FLOPs per multiply-add, as attention's)
            matmul += _mamba_scan_flops(a)
        if s.mixer == "linear_attention":  # per head: three state products, a chunk of 64's q.k, k.k and (q k) v
            dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
            state += a.linear_num_value_heads * (3 * dk * dv + 32 * (2 * dk + dv))
            continue
        if s.mixer in ("conv", "mamba", "none"):  # no attention (the taps are counted with the matmuls)
            continue
        if c and c < seq_len:  # whole chunks of c (the last one possibly cut): about c / 2 keys each
            keys += c / 2
            continue
        keys += seq_len / 2 if not w or w >= seq_len else w - w * w / (2 * seq_len)
        if a.index_topk:  # the indexer's forward (its projections; its scores where it selects)
            indexer += sparse_attention.flops(a, seq_len / 2 if a.index_topk < seq_len else 0)
    # q.k and probs.v: 2 x 3 FLOPs (forward and backward) per multiply-add of each
    return 6 * matmul + 6 * a.num_attention_heads * (a.qk_head_size + a.v_head_size) * keys + 6 * state + indexer


def decode_flops(a, context: float) -> float:
    """FLOPs of one generated token (forward only): 2 x matmul params (active, the output head
    included) + q.k and probs.v over the ``context`` keys the token attends (each layer's
    window or chunk capping it)."""
    specs = a.layer_specs()
    matmul = sum(_layer_matmul_params(a, s.mlp == "moe", True, s.mixer == "conv", s.mixer, s.mlp) for s in specs)
    matmul += a.vocab_size * a.hidden_size
    # a mamba layer's step: the state's update and read, 2 h p n multiply-adds
    matmul += sum(2 * a.mamba_num_heads * a.mamba_head_dim * a.ssm_state_size for s in specs
                  if s.mixer in ("mamba", "attention+mamba"))
    keys = sum(min(context, s.window or context, s.chunk or context) for s in specs
               if s.mixer in ("attention", "attention+mamba"))
    if a.index_topk:  # every layer's indexer scores the context where it selects
        matmul += len(specs) * sparse_attention.flops(a, context if a.index_topk < context else 0) / 2
    return 2 * matmul + 2 * a.num_attention_heads * (a.qk_head_size + a.v_head_size) * keys


def transformer_activations(cfg, batch_size, seq_len, shards, pipeline=None) -> ActivationEstimate:
    a, e = cfg.arch, cfg.execution
    d, f, h = a.hidden_size, a.intermediate_size, a.num_attention_heads
    k, dh = a.kv_heads, a.head_size
    nb = jnp.dtype(e.dtype).itemsize
    tok = batch_size * seq_len
    gated = a.mlp_type == "gated"
    # latent attention always runs in plain XLA (its values are narrower than its keys)
    ring = getattr(shards, "ring", 1)  # context-parallel ring attention over this many devices
    kernel = attention_kernel(cfg, jnp.dtype(e.dtype), seq_len)  # splash: not under a ring
    flash = kernel == "splash" and ring == 1 or kernel == "cudnn" and not a.attn_logit_softcapping and not a.latent
    dq, dv = a.qk_head_size, a.v_head_size  # head_size both, but for latent attention

    def t(per_token, names, nbytes=nb):
        return _term(tok, per_token, names, nbytes, shards)

    scores, probs = (0, 0) if flash else (t(h * seq_len, BHL), t(h * seq_len, BHL, 4))
    gathered = ring > 1 and e.context_attention == "all_gather"
    if ring > 1:  # its blocks keep only their float32 numerators, of the visible block pairs
        scores, probs = 0, probs if gathered else int(probs * (ring + 1) / (2 * ring))
    layer = {
        "block_input": t(d, BLE), "attn_norm": t(3 * d, BLE, 4),
        "query": t(h * dq, BLHD), "key": t(k * dq, BLKD), "value": t(k * dv, BLKD),
        "kv_proj": t(k * dh, BLKD) if e.fuse_projections and not a.latent else 0,
        "scores": scores, "probs": probs,
        "attn_context": t(h * dv, BLHD), "attn_out": t(d, BLE), "attn_residual": t(d, BLE),
        "mlp_norm": t(3 * d, BLE, 4), "mlp_out": t(d, BLE),
    }
    if a.latent:
        lat = a.kv_lora_rank + (a.q_lora_rank or 0)
        layer.update(latent=t(lat, (ax.BATCH, ax.LENGTH, ax.KV_LORA)),
                     latent_norm=t(3 * lat, (ax.BATCH, ax.LENGTH, ax.KV_LORA), 4))
    if a.index_topk and a.index_topk < seq_len:  # each layer's own mask, its indexer's selection (bool)
        layer["index_mask"] = t(seq_len, BL, 1)
    if a.attn_logit_softcapping:
        layer["softcap"] = t(2 * h * seq_len, BHL)
    if a.qk_norm in ("head", "heads", "projection"):  # as attn_norm's, of every query and key head
        layer["qk_norm"] = t(3 * (h + k) * dq, BLHD, 4)
    if a.norm_position == "both":
        layer.update(post_attn_norm=t(3 * d, BLE, 4), post_mlp_norm=t(3 * d, BLE, 4))
    if a.parallel_residual:  # the MLP reads the attention's norm: no sum between them, no second norm
        del layer["attn_residual"], layer["mlp_norm"]
    dense = dict(layer, mlp_up=t(f, BLF), mlp_hidden=t(f, BLF))
    if gated:
        dense.update(mlp_gate=t(f, BLF), mlp_proj=t(f, BLF) if e.fuse_projections else 0)
        if a.hidden_act not in ("silu", "swish"):  # no hand-written backward (swiglu's)
            dense["mlp_act"] = t(f, BLF)
    if a.hidden_act == "xielu":  # its residuals: alpha_p x, expm1's derivative, both branches' sums
        dense["xielu"] = t(4 * f, BLF)
    experts = a.num_local_experts
    moe_layer = None
    if experts:
        slots = experts * cfg.moe_config().capacity(seq_len)  # E*C per row, per token: / L
        fe = a.expert_size
        # one-hot [batch, length, expert, capacity] masks for the einsum dispatches; the
        # indexed one keeps int32 slot indices instead (a few per token: not counted)
        masks = t(2 * slots, BLEC) if e.moe_dispatch in ("capacity", "shard_map") else 0
        moe_layer = dict(
            layer, router_logits=t(experts, (ax.BATCH, ax.LENGTH, ax.EXPERT), 4),
            router=t(2 * experts, (ax.BATCH, ax.LENGTH, ax.EXPERT), 4),
            masks=masks, expert_in=t(slots * d / seq_len, ECD),
            expert_out=t(slots * d / seq_len, ECD),
            # gated: gate and up, silu's residuals and their product; plain: up, the activation's output
            expert_proj=t((2 if a.expert_type == "gated" else 1) * slots * fe / seq_len, ECF),
            expert_hidden=t((4 if a.expert_type == "gated" else 1) * slots * fe / seq_len, ECF),
        )
        if a.swiglu_limit:  # the clamped SwiGLU's min and clip outputs and sigmoid(alpha g): 3 more
            moe_layer["expert_clamp"] = t(3 * slots * fe / seq_len, ECF)
        fs = a.shared_expert_intermediate_size
        if fs:  # the shared expert: a dense MLP's terms at its width (its gate: 1 per token)
            moe_layer.update(shared_up=t(fs, BLF), shared_hidden=t(fs, BLF))
            if gated:
                moe_layer.update(shared_gate=t(fs, BLF), shared_proj=t(fs, BLF) if e.fuse_projections else 0)
    # each kind of layer (mixer, MLP) and how many the model has; a conv layer keeps the
    # convolution's arrays in attention's place
    kinds = {}
    for s_ in a.layer_specs():
        terms_ = moe_layer if s_.mlp == "moe" else dense
        key = (s_.mixer, s_.mlp)
        if s_.mixer == "conv":
            terms_ = _conv_terms(terms_, t, d, a.conv_kernel)
        elif s_.mixer == "mamba":
            terms_ = _mamba_terms(terms_, t, a, seq_len)
        elif s_.mixer == "attention+mamba":  # attention's terms and the mixer's beside them
            terms_ = _mamba_terms(terms_, t, a, seq_len, keep_attention=True)
        elif s_.mixer == "linear_attention":
            terms_ = _linear_terms(terms_, t, a, e.linear_attention_chunk)
        elif s_.mixer == "none":  # an MLP layer: no mixer's terms, no second residual
            terms_ = {k: v for k, v in terms_.items()
                      if k not in _ATTENTION_TERMS + ("attn_norm", "attn_out", "attn_residual")}
        if s_.mlp == "none":  # a mixer-only layer: no MLP's terms
            terms_ = {k: v for k, v in terms_.items() if not k.startswith(("mlp", "attn_residual"))}
        kinds[key] = (terms_, kinds.get(key, (None, 0))[1] + 1)
    n_moe = sum(n for (_, mlp), (_, n) in kinds.items() if mlp == "moe")
    n_dense = a.num_hidden_layers - n_moe
    attends = any(mixer in ("attention", "attention+mamba") for mixer, _ in kinds)
    n_conv = sum(n for (mixer, _), (_, n) in kinds.items() if mixer == "conv")
    policy = e.remat_policy
    largest = max(_saved(terms_, "none") for terms_, _ in kinds.values())
    layers = sum(n * _saved(terms_, policy) for terms_, n in kinds.values())
    recompute = largest if policy != "none" else 0
    vocab, length_share = (1 if a.score_head else a.vocab_size), 1.0  # the logits (or scores) that exist at once
    if tiles(e, tok, a.vocab_size):  # the tiled loss: one chunk of positions x one of the vocabulary
        vocab, length_share = min(a.vocab_size, e.loss_vocab_chunk), min(1.0, e.loss_length_chunk / seq_len)
    logits = int(t(vocab, (ax.BATCH, ax.LENGTH, ax.VOCAB), 4) * length_share)
    others = {
        "batch": t(5, BL, 4),
        "mask": 0 if flash or ring > 1 or not attends else t(h * seq_len, BHL, 1),
        "backward": max(largest, logits),
        "head": t(3 * d, BLE, 4) + logits
        + (int(t(2 * vocab, (ax.BATCH, ax.LENGTH, ax.VOCAB)) * length_share) if a.final_logit_softcapping else 0),
    }
    if ring > 1 and not gathered and attends:  # the diagonal block's two float32 cotangents, (length / ring)^2 each
        others["ring_diagonal"] = 2 * t(h * seq_len, BHL, 4) // ring
    if pipeline is not None:  # one stage's layers on one microbatch at a time (models/pipeline.py)
        m, iters = pipeline["microbatches"], pipeline["iterations"]
        lps = pipeline["layers_per_stage"]
        largest, layers = largest // m, lps * _saved(dense, policy) // m
        recompute = largest if policy != "none" else 0
        others.update(mask=others["mask"] // m, backward=max(largest, logits),
                      stash=int((3 + iters / m) * t(d, BLE)))
    total = layers + recompute + sum(others.values())
    if pipeline is not None:
        formula = (f"batch + mask + pipeline stash (input, microbatches, circular store, {iters} iterations' "
                   f"stage inputs) + one iteration: {lps} layers x saved({policy}) of one microbatch"
                   + (" + one layer recomputed" if policy != "none" else "")
                   + " + one layer's backward + final norm and logits")
    else:
        formula = (
            f"batch + mask + {n_dense} dense + {n_moe} MoE layers x saved({policy})"
            + (f" ({n_conv} of them conv layers)" if n_conv else "")
            + (" + one layer recomputed" if policy != "none" else "")
            + " + one layer's backward + final norm and logits"
            + (f" (ring attention over {ring} devices)" if ring > 1 else "")
        )
    terms = {**next(iter(kinds.values()))[0], **others}
    return ActivationEstimate(int(total), policy, formula, terms)


_ATTENTION_TERMS = ("query", "key", "value", "kv_proj", "scores", "probs", "softcap", "latent", "latent_norm",
                    "index_mask", "qk_norm", "attn_context")


def _conv_terms(layer: dict, t, d: int, width: int) -> dict:
    """A conv layer's terms (models/conv_mixer.py): attention's replaced by the projections'
    outputs b, c, x (the slices of their fused matmul's, which is not kept), b * x (the convolution's input), the
    convolution's output and c times it (the out projection's input), d channels each; and the
    taps' float32 0/1 segment masks, conv_kernel per token."""
    out = {k: v for k, v in layer.items() if k not in _ATTENTION_TERMS}
    blc = (ax.BATCH, ax.LENGTH, ax.CONV_CHANNELS)
    out.update(conv_in=t(3 * d, blc), conv_input=t(d, blc),
               conv_masks=t(width, BL, 4), conv_out=t(d, blc), attn_context=t(d, blc))
    return out


def _mamba_terms(layer: dict, t, a, seq_len: int, keep_attention: bool = False) -> dict:
    """A mamba layer's terms (models/ssm.py): attention's replaced by in_proj's outputs (z, x,
    B, C, dt), the convolutions' outputs, and the chunked scan's float32 arrays of [chunk] per
    head and token (the decays' differences, their exponential, the masked decay, its products
    with C.B and dt: 6 counting the masks' where), the per-chunk states and the output; then
    the gated norm's (3 per feature, float32) and the out projection's input (``keep_attention``:
    an attention+mamba layer, attention's terms kept beside them, the out projection's input as
    ``mamba_context``)."""
    out = dict(layer) if keep_attention else {k: v for k, v in layer.items() if k not in _ATTENTION_TERMS}
    inner, gn, h = a.mamba_inner, a.mamba_n_groups * a.ssm_state_size, a.mamba_num_heads
    q = min(a.mamba_chunk_size, seq_len)
    blh = (ax.BATCH, ax.LENGTH, ax.SSM_HEADS)
    per_chunk_state = h * a.mamba_head_dim * a.ssm_state_size / q  # a chunk's state, per token
    out.update(mamba_in=t(2 * inner + 2 * gn + h, blh), mamba_conv=t(inner + 2 * gn, blh),
               ssm_decay=t(6 * h * q, blh, 4), ssm_states=t(2 * per_chunk_state, blh, 4),
               ssm_out=t(inner, blh), ssm_norm=t(3 * inner, blh, 4))
    out["mamba_context" if keep_attention else "attn_context"] = t(inner, blh)
    return out


def _linear_terms(layer: dict, t, a, chunk: int) -> dict:
    """A linear-attention layer's terms (models/linear_attention.py; see the module doc)."""
    out = {k: v for k, v in layer.items() if k not in _ATTENTION_TERMS}
    nk, nv, dk, dv = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
    heads = (ax.BATCH, ax.LENGTH, ax.LINEAR_HEADS)
    qkv = 2 * nk * dk + nv * dv
    out.update(gdn_in=t(qkv + nv * dv + 2 * nv, heads), gdn_conv=t(2 * qkv, heads),
               conv_masks=t(3 * a.linear_conv_kernel_dim, BL, 4), gdn_qk=t(2 * nv * dk, heads, 4),
               gdn_chunk=t(nv * (7 * chunk + 3 * dk + dv + dk * dv / chunk), heads, 4),
               gdn_out=t(2 * nv * dv, heads, 4), attn_context=t(nv * dv, heads))
    return out


def decode_cache_bytes(a, batch_size: int, length: int, nbytes: int) -> dict:
    """Bytes of the decoding cache by kind of layer (summed over the model's layers), for
    ``batch_size`` rows of ``length`` positions, keys, values and convolution inputs of ``nbytes``:
    an attention layer's keys, values and segment ids of every position (latent attention: its
    latent and rotary key), a conv layer's last conv_kernel - 1 inputs, a linear-attention layer's
    float32 state per value head, its segment id and its convolution's last inputs, a mamba
    layer's float32 state, its segment id and its three convolutions' last inputs; an
    attention+mamba layer both an attention layer's and a mamba layer's."""
    out = {}
    for s in a.layer_specs():
        if s.mixer == "linear_attention":
            nk, nv = a.linear_num_key_heads, a.linear_num_value_heads
            dk, dv, h = a.linear_key_head_dim, a.linear_value_head_dim, a.linear_conv_kernel_dim - 1
            size = batch_size * (4 * nv * dk * dv + 4 + h * ((2 * nk * dk + nv * dv) * nbytes + 4))
        elif s.mixer == "conv":
            size = batch_size * (a.conv_kernel - 1) * (a.hidden_size * nbytes + 4)
        elif s.mixer == "none":
            continue
        else:
            size = 0
            if s.mixer in ("mamba", "attention+mamba"):  # the float32 state, its segment id; each of three
                h, gn = a.mamba_conv_kernel - 1, a.mamba_n_groups * a.ssm_state_size  # convolutions' last inputs
                size += batch_size * (4 * a.mamba_inner * a.ssm_state_size + 4
                                      + h * ((a.mamba_inner + 2 * gn) * nbytes + 3 * 4))
            if s.mixer != "mamba":  # attention's keys, values, segment ids and the layer's cache index
                per = a.kv_lora_rank + a.qk_rope_head_dim if a.latent else 2 * a.kv_heads * a.head_size
                size += batch_size * length * (per * nbytes + 4) + 4
                size += sparse_attention.cache_bytes(a, batch_size, length, nbytes) if a.index_topk else 0
        out[s.mixer] = out.get(s.mixer, 0) + size
    return out


def mlp_activations(cfg, batch_size, shards) -> ActivationEstimate:
    nb = jnp.dtype(cfg.dtype).itemsize
    terms = {"input": _term(batch_size, cfg.in_features, (ax.BATCH, ax.EMBED), nb, shards)}
    per_hidden = 3 if cfg.dropout_rate > 0 else 2
    for i in range(cfg.depth):
        names = (ax.BATCH, ax.MLP if i % 2 == 0 else ax.EMBED)
        terms[f"layers_{i}"] = _term(batch_size, cfg.width * per_hidden, names, nb, shards)
    terms["head"] = _term(batch_size, cfg.num_outputs, (ax.BATCH, ax.VOCAB), nb + 4, shards)
    formula = "input + depth x (pre- and post-activation) + logits"
    return ActivationEstimate(sum(terms.values()), "none", formula, terms)
