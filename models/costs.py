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
                                 A parallel block form (models/blocks.py: Phi, Cohere) keeps no
                                 attn_residual, and mlp_norm only with its second norm (GPT-NeoX).
                                 A shortcut_moe layer (LongCat-Flash) keeps two halves' sequential
                                 terms, mixer terms and dense MLP terms, its MoE's once, and
                                 shortcut_out D (estimated, not yet measured against XLA).
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
from collections.abc import Callable

import jax.numpy as jnp

from shardzoo.models import per_layer, shared_block
from shardzoo.models.attention import layer_arch
from shardzoo.models.blocks import BLE, BLOCK_FORMS
from shardzoo.models.components import MIXERS, MLPS
from shardzoo.models.layers import DENSE
from shardzoo.models.moe_arch import DENSE_AND_MOE, MOE
from shardzoo.models.norms import norm_params
from shardzoo.models.tiled_loss import FUSED_BYTES, tiles
from shardzoo.sharding import axes as ax

BL = (ax.BATCH, ax.LENGTH)

# What each remat policy keeps of a layer ("none": every term below that is not 0 there).
_DOTS = ("block_input", "query", "key", "value", "kv_proj", "conv_in", "gdn_in", "attn_out", "mlp_gate", "mlp_up",
         "mlp_proj", "mlp_out", "router_logits", "expert_in", "expert_out", "expert_proj",
         "shared_gate", "shared_up", "shared_proj")
POLICY_TERMS = {
    "full": ("block_input",),
    "dots_saveable": _DOTS + ("scores", "attn_context"),
    "dots_with_no_batch_dims_saveable": _DOTS,
    "save_attn_mlp": ("block_input", "attn_context", "mamba_context", "mlp_hidden", "shared_hidden"),
    # the experts' gate and up (expert_proj) and the shared expert's carry the MLP's names
    "save_qkv_mlp": ("block_input", "query", "key", "value", "attn_kernel", "mlp_gate", "mlp_up", "expert_proj",
                     "shared_gate", "shared_up"),
    "save_qkv": ("block_input", "query", "key", "value", "attn_kernel"),
}
# Terms that only a remat policy saves (autodiff without remat does not keep them).
_POLICY_ONLY = ("attn_out", "mlp_out", "router_logits")


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    bytes: int  # per device
    policy: str
    formula: str
    terms: dict  # name -> bytes per device (per layer for a Transformer's layer terms)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What a component's activation terms are computed from (``component.Mixer.activations``):
    the config, the row length, the ring of context parallelism (``ring`` devices; ``gathered``:
    its attention gathers the keys whole) and ``t(per_token, names, nbytes=compute dtype's)``,
    the bytes per device of one array of ``per_token`` elements a token over the batch."""

    config: object
    seq_len: int
    t: Callable
    ring: int = 1
    gathered: bool = False


def _term(tokens, per_token, names, nbytes, shards) -> int:
    return int(tokens * per_token * nbytes) // shards(names)


def _saved(terms: dict, policy: str) -> int:
    keep = POLICY_TERMS.get(policy)
    if keep is None:
        return sum(v for n, v in terms.items() if n not in _POLICY_ONLY)
    return sum(v for n, v in terms.items() if n in keep)


def buffers(a) -> tuple[tuple[str, str], ...]:
    """The leaves (their last two path keys) that transformers holds as buffers, not
    parameters: not counted by ``transformer_params`` (Gemma 4's layer scalars too). Ernie 4.5 MoE's correction bias is a
    parameter there (one that no gradient trains), DeepSeek-V3's, Kolibri's and LongCat-Flash's (beside
    zero experts) a buffer."""
    out = (("xielu", "beta"), ("xielu", "eps")) + ((("layer_scalar", "scale"),) if a.layer_scalar else ())
    biased = a.moe and (a.moe.router_kind in ("sigmoid_groups", "logit_bias") or a.moe.zero_expert_num)
    return out + ((("moe", "router_bias"),) if biased else ())


def _layer_params(a, spec, active: bool) -> tuple[int, int]:
    """A layer's (matmul parameters, other parameters) from its mixer's and its MLP's records (as
    many mixers and dense MLPs besides as its block form has; a mixer's unchosen experts counted
    unless ``active``)."""
    form = BLOCK_FORMS[a.block_form]
    kind, la = MIXERS[spec.mixer], layer_arch(a, spec)
    mixer, mlp = kind.params(la), MLPS[spec.mlp].params(a, active)
    dense = MLPS[DENSE].params(a, active) if form.dense_mlps else (0, 0)
    idle = kind.idle_params(la) if kind.idle_params is not None and not active else 0  # unchosen experts
    return (form.mixers * mixer[0] + mlp[0] + form.dense_mlps * dense[0] + idle,
            form.mixers * mixer[1] + mlp[1] + form.dense_mlps * dense[1])


def _matmul_params(a, active: bool = True) -> int:
    return sum(_layer_params(a, s, active)[0] for s in a.layer_specs())


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
        total += (a.max_position_embeddings + a.position_offset) * d
    norm = norm_params(a, d)  # weight and bias, as the kind has them
    total += norm * (BLOCK_FORMS[a.block_form].final_norm + a.embedding_norm)  # final norm (and the embeddings' norm)
    if a.head_transform is not None:  # the prediction head's dense and norm
        total += d * d + norm
    if a.lm_head_bias and not a.score_head:
        total += a.vocab_size
    for spec in a.layer_specs():
        total += sum(_layer_params(a, spec, active)) + BLOCK_FORMS[a.block_form].norms(a, spec) * norm
        total += d * bool(spec.out_bias)  # a layer's own output bias (the mixer counts attention_out_bias's)
    return total + shared_block.params(a) + (per_layer.params(a) if a.per_layer else 0)  # Zamba2's shared blocks


def transformer_flops(a, seq_len: int) -> float:
    """Training FLOPs per token (MaxText): 6 x matmul params (active) + each layer's mixing beyond
    them (attention's q.k and probs.v over its window or chunk; a scan's or a delta rule's state)."""
    matmul = _matmul_params(a) + (1 if a.score_head else a.vocab_size) * a.hidden_size  # the head (or the score)
    matmul += a.hidden_size**2 if a.head_transform is not None else 0  # the prediction head's dense
    mixers = BLOCK_FORMS[a.block_form].mixers
    return (6 * matmul + mixers * sum(MIXERS[s.mixer].flops(layer_arch(a, s), s, seq_len) for s in a.layer_specs())
            + shared_block.flops(a, seq_len))  # Zamba2's shared blocks, at each use


def decode_flops(a, context: float) -> float:
    """FLOPs of one generated token (forward only): 2 x matmul params (active, the output head
    included) + each layer's mixing beyond them (q.k and probs.v over the ``context`` keys the
    token attends, each layer's window or chunk capping it; a mamba layer's state update)."""
    matmul = _matmul_params(a) + a.vocab_size * a.hidden_size
    matmul += a.hidden_size**2 if a.head_transform is not None else 0  # the prediction head's dense
    mixers = BLOCK_FORMS[a.block_form].mixers
    return 2 * matmul + mixers * sum(MIXERS[s.mixer].decode_flops(layer_arch(a, s), s, context)
                                     for s in a.layer_specs())


def transformer_activations(cfg, batch_size, seq_len, shards, pipeline=None) -> ActivationEstimate:
    a, e = cfg.arch, cfg.execution
    nb = jnp.dtype(e.dtype).itemsize
    tok = batch_size * seq_len

    def t(per_token, names, nbytes=nb):
        return _term(tok, per_token, names, nbytes, shards)

    ring = getattr(shards, "ring", 1)  # context-parallel ring attention over this many devices
    cost = LayerCost(cfg, seq_len, t, ring, ring > 1 and e.context_attention == "all_gather")
    # each kind of layer (mixer, MLP), its terms and how many the model has
    kinds = {}
    for spec in a.layer_specs():
        mine = layer_arch(a, spec)  # Gemma 4's global layers: their own head size
        key = (spec.mixer, spec.mlp, mine is not a)
        if key not in kinds:
            own = cost if mine is a else dataclasses.replace(cost, config=type(cfg)(mine, e))
            form = BLOCK_FORMS[a.block_form]
            mixer = {k: form.mixers * v for k, v in MIXERS[spec.mixer].activations(own, spec).items()}
            dense = {k: form.dense_mlps * v for k, v in MLPS[DENSE].activations(cost).items()} if form.dense_mlps else {}
            terms = {**form.terms(a, spec, t), **mixer, **dense, **MLPS[spec.mlp].activations(cost)}
            kinds[key] = (terms, 0)
        kinds[key] = (kinds[key][0], kinds[key][1] + 1)
    n_moe = sum(n for (_, mlp, _), (_, n) in kinds.items() if mlp in (MOE, DENSE_AND_MOE))
    n_dense = a.num_hidden_layers - n_moe
    n_conv = sum(n for (mixer, _, _), (_, n) in kinds.items() if mixer == "conv")
    policy = e.remat_policy
    largest = max(_saved(terms_, "none") for terms_, _ in kinds.values())
    layers = sum(n * _saved(terms_, policy) for terms_, n in kinds.values())
    recompute = largest if policy != "none" else 0
    vocab, length_share = (1 if a.score_head else a.vocab_size), 1.0  # the logits (or scores) that exist at once
    tiled = tiles(e, tok, a.vocab_size)
    fused = tiled and e.tiled_loss_backward == "fused" and not a.score_head
    if tiled:  # the tiled loss: one chunk of positions x one of the vocabulary (fused: all of it, <= FUSED_BYTES)
        vocab = vocab if fused else min(a.vocab_size, e.loss_vocab_chunk)
        length_share = min(1.0, e.loss_length_chunk / seq_len)
    logits = int(t(vocab, (ax.BATCH, ax.LENGTH, ax.VOCAB), 4) * length_share)
    if fused:
        logits = min(logits, FUSED_BYTES)
    others = {
        "batch": t(5, BL, 4),
        "mask": 0,
        "backward": max(largest, logits),
        "head": t(3 * a.hidden_size, BLE, 4) * (1 + (a.head_transform is not None)) + logits
        + (int(t(2 * vocab, (ax.BATCH, ax.LENGTH, ax.VOCAB)) * length_share) if a.final_logit_softcapping else 0),
    }
    if a.shared_block:  # Zamba2's shared blocks, each use's arrays kept whole (outside the layers' remat)
        others["shared_blocks"] = shared_block.activations(a, seq_len, t)
    for mixer in sorted({m for m, _, _ in kinds}):  # what a mixer keeps once per model (attention's mask)
        if MIXERS[mixer].model_terms is not None:
            others.update(MIXERS[mixer].model_terms(cost))
    if pipeline is not None:  # one stage's layers on one microbatch at a time (models/pipeline.py)
        m, iters = pipeline["microbatches"], pipeline["iterations"]
        lps = pipeline["layers_per_stage"]
        stage_terms = max(kinds.values(), key=lambda kind: kind[1])[0]  # a pipeline runs a stack of alike layers
        largest, layers = largest // m, lps * _saved(stage_terms, policy) // m
        recompute = largest if policy != "none" else 0
        others.update(mask=others["mask"] // m, backward=max(largest, logits),
                      stash=int((3 + iters / m) * t(a.hidden_size, BLE)))
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


def decode_cache_bytes(a, batch_size: int, length: int, nbytes: int) -> dict:
    """Bytes of the decoding cache by kind of mixer (summed over the model's layers), for
    ``batch_size`` rows of ``length`` positions, keys, values and convolution inputs of ``nbytes``
    (each mixer's ``cache_bytes``: attention's keys, values and segment ids of every position; a
    recurrent mixer's state and its convolutions' last inputs; a layer without a mixer none)."""
    out = {}
    for s in a.layer_specs():
        size = MIXERS[s.mixer].cache_bytes
        if size is not None:
            mixers = BLOCK_FORMS[a.block_form].mixers
            out[s.mixer] = out.get(s.mixer, 0) + mixers * size(layer_arch(a, s), batch_size, length, nbytes)
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
