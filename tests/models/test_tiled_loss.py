"""The vocabulary-tiled loss (models/tiled_loss.py) equals the untiled head and optax's loss, in
value and gradient; a train step with it equals one without, on one device and under fsdp_tp;
DPO's and GRPO's log-probabilities tile too; and the compiled step needs less temporary memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from shardzoo.models import ModelError, get_model
from shardzoo.models.tiled_loss import (
    AUTO_BYTES,
    HeadInputs,
    TokenStats,
    contiguous_chunks,
    head_logits,
    reference_stats,
    tiles,
    token_stats,
    weighted_nll,
)
from shardzoo.sharding import axes as ax
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.config import TrainConfig
from shardzoo.train.optim import make_optimizer
from shardzoo.train.program import Program
from shardzoo.train.step import score_step
from shardzoo.train.tasks.base import forward
from shardzoo.train.tasks.grpo import grpo_task, token_logps
from shardzoo.train.tasks.preference import preference_task, sequence_logps
from shardzoo.train.tasks.registry import get_task

ROWS, LENGTH, EMBED, VOCAB = 3, 10, 16, 70
TRANSFORMS = {"plain": {}, "softcap": dict(softcap=4.0),
              "granite_cohere": dict(logits_scaling=2.5, logit_scale=1.5, softcap=6.0)}
# (length chunk, vocab chunk): dividing both, dividing neither, 3 vocabulary chunks of 24 (2 columns
# of padding), one chunk longer than the axis
CHUNKS = [(5, 35), (4, 16), (4, 32), (16, 128)]


def _data(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    hidden = jax.random.normal(k[0], (ROWS, LENGTH, EMBED))
    kernel = jax.random.normal(k[1], (EMBED, VOCAB)) * 0.5
    bias = jax.random.normal(k[2], (VOCAB,))
    targets = jax.random.randint(k[3], (ROWS, LENGTH), 0, VOCAB)
    weights = (jax.random.uniform(k[4], (ROWS, LENGTH)) > 0.3).astype(jnp.float32)  # masked tokens
    return hidden, kernel, bias, targets, weights


def _mean_loss(tiled, static, hidden, kernel, bias, targets, weights):
    """``tiled``: None (the untiled loss as the lm task computed it before), or the tiled loss's
    backward ("recompute", "fused"; "contiguous": recompute over contiguous vocabulary chunks)."""
    if tiled is None:
        head = HeadInputs(hidden, kernel, bias, **static)
        losses = optax.softmax_cross_entropy_with_integer_labels(head_logits(head).astype(jnp.float32), targets)
        return jnp.sum(losses * weights) / jnp.sum(weights)
    backward, contiguous = ("recompute", True) if tiled == "contiguous" else (tiled, False)
    loss, _ = weighted_nll(HeadInputs(hidden, kernel, bias, **static, backward=backward, contiguous=contiguous),
                           targets, weights)
    return loss / jnp.sum(weights)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("chunks", CHUNKS, ids=str)
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("backward", ["recompute", "fused", "contiguous"])
def test_tiled_loss_and_grads_equal_optax(transform, chunks, use_bias, backward):
    hidden, kernel, bias, targets, weights = _data()
    bias = bias if use_bias else None
    static = dict(TRANSFORMS[transform], length_chunk=chunks[0], vocab_chunk=chunks[1])
    argnums = (0, 1, 2) if use_bias else (0, 1)
    grad = lambda tiled: jax.jit(jax.value_and_grad(functools.partial(_mean_loss, tiled, static), argnums))(
        hidden, kernel, bias, targets, weights)
    (got, got_grads), (want, want_grads) = grad(backward), grad(None)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for name, g, w in zip(("hidden", "kernel", "bias")[:len(argnums)], got_grads, want_grads, strict=True):
        assert float(jnp.max(jnp.abs(w))) > 1e-3, name  # a gradient that is not trivially zero
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
    assert float(jnp.max(jnp.abs(got_grads[0] * (1 - weights[..., None])))) == 0.0  # masked tokens: none


@pytest.mark.parametrize("contiguous", [False, True])
def test_every_statistic_equals_the_full_logits(contiguous):
    hidden, kernel, bias, targets, _ = _data(1)
    head = HeadInputs(hidden, kernel, bias, softcap=5.0, length_chunk=4, vocab_chunk=32, contiguous=contiguous)
    logits = head_logits(head).astype(jnp.float32)
    targets = targets.at[0].set(jnp.argmax(logits[0], -1))  # one row of greedy guesses
    got, want = token_stats(head, targets), reference_stats(logits, targets)
    logp = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(got.logp, jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], atol=1e-6)
    np.testing.assert_allclose(got.max, jnp.max(logits, -1), atol=1e-6)
    np.testing.assert_allclose(got.entropy, -jnp.sum(jnp.exp(logp) * logp, -1), atol=1e-5)
    np.testing.assert_allclose(got.lse, want.lse, atol=1e-6)
    greedy = jnp.argmax(logits, -1) == targets
    assert bool(jnp.any(greedy)) and bool(jnp.any(~greedy))  # accuracy is tested on both outcomes
    np.testing.assert_array_equal(got.target >= got.max, greedy)


def test_fused_statistics_equal_the_full_logits_with_a_padded_vocabulary():
    """The fused backward's statistics (metrics), loss and gradients, its position chunks capped
    by FUSED_BYTES too, over a vocabulary whose last 6 columns are padding (never in the softmax)."""
    import shardzoo.models.tiled_loss as tl

    hidden, kernel, bias, targets, weights = _data(3)
    targets = jnp.minimum(targets, VOCAB - 7)
    full = reference_stats(head_logits(HeadInputs(hidden, kernel, bias, vocab=VOCAB - 6)), targets)
    for cap in (tl.FUSED_BYTES, 4 * ROWS * VOCAB * 3):  # the cap: chunks of 3 positions (4 chunks of 10)
        old, tl.FUSED_BYTES = tl.FUSED_BYTES, cap
        try:
            head = HeadInputs(hidden, kernel, bias, vocab=VOCAB - 6, length_chunk=8, backward="fused")
            loss, stats = jax.jit(weighted_nll)(head, targets, weights)
        finally:
            tl.FUSED_BYTES = old
        for name in TokenStats._fields:
            np.testing.assert_allclose(getattr(stats, name), getattr(full, name), rtol=1e-6, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(loss, jnp.sum((full.lse - full.target) * weights), rtol=1e-6)
    # the gradients over the padded vocabulary: those of the recomputing backward (which equals optax)
    grads = {}
    for backward in ("recompute", "fused"):
        total = lambda h, k, b, backward=backward: weighted_nll(HeadInputs(h, k, b, vocab=VOCAB - 6, length_chunk=4,
                                                                                   vocab_chunk=16, backward=backward),
                                                                        targets, weights)[0]
        grads[backward] = jax.jit(jax.grad(total, argnums=(0, 1, 2)))(hidden, kernel, bias)
    for name, g, w in zip(("hidden", "kernel", "bias"), grads["fused"], grads["recompute"], strict=True):
        assert float(jnp.max(jnp.abs(w))) > 1e-3, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
    with pytest.raises(ModelError, match="tiled_loss_backward='later'"):
        get_model("llama-tiny", tiled_loss_backward="later")


def test_auto_tiles_above_the_threshold_and_the_field_is_checked():
    _, config = get_model("llama-tiny")
    e = config.execution
    assert not tiles(e, 8, 1000) and tiles(e, AUTO_BYTES // 4000 + 1, 1000)
    assert tiles(config.replace(tiled_loss="on").execution, 1, 1)
    assert not tiles(config.replace(tiled_loss="off").execution, 10**9, 10**6)
    with pytest.raises(ModelError, match="tiled_loss='maybe'"):
        config.replace(tiled_loss="maybe")
    with pytest.raises(ModelError, match="loss_vocab_chunk=0"):
        config.replace(loss_vocab_chunk=0)
    with pytest.raises(ModelError, match="loss_vocab_chunks='rows'"):
        config.replace(loss_vocab_chunks="rows")


# ------------------------------------------------------------------------------ the model
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, loss_length_chunk=5, loss_vocab_chunk=100)
HEADS = {"untied": {}, "tied_bias_softcap": dict(tie_word_embeddings=True, lm_head_bias=True,
                                                 final_logit_softcapping=3.0),
         "granite_cohere": dict(logits_scaling=2.0, logit_scale=1.25)}


def _lm_batch(rows=8, length=16, vocab=512, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, length + 1))
    ones = np.ones((rows, length), np.int32)
    return {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
            "positions": np.cumsum(ones, axis=1) - 1, "segment_ids": ones,
            "weights": (rng.random((rows, length)) > 0.2).astype(np.float32)}


@pytest.mark.parametrize("chunks", ["strided", "contiguous"])
@pytest.mark.parametrize("head", HEADS)
def test_model_head_off_gives_the_same_loss_and_param_grads(head, chunks):
    """``head=False`` returns the normed hidden states and the head's weights (the params'
    names unchanged); the lm task's sums and their gradients wrt every param equal the logits',
    over either layout of vocabulary chunks (``loss_vocab_chunks``; 100 of 512 columns: padded)."""
    module, config = get_model("llama-tiny", **TINY, **HEADS[head], loss_vocab_chunks=chunks)
    batch = jax.tree.map(jnp.asarray, _lm_batch())
    params = nn.meta.unbox(jax.jit(module.init)(jax.random.PRNGKey(0), batch["inputs"])["params"])
    if head == "tied_bias_softcap":  # the tied head's zero-initialised bias, made to matter
        params["lm_head_bias"] = jax.random.normal(jax.random.PRNGKey(1), params["lm_head_bias"].shape)
    assert ("lm_head" in params) == (head != "tied_bias_softcap")
    task = get_task("lm")

    def sums(params, tiled):
        args, kw = task.model_args(batch)
        return task.sums(module.apply({"params": params}, *args, **kw, head=not tiled), batch)

    def loss(params, tiled):
        s = sums(params, tiled)
        return s["loss"] / s["weight"], s

    args, kw = task.model_args(batch)
    assert jax.eval_shape(lambda p: module.apply({"params": p}, *args, **kw, head=False), params).contiguous == (
        chunks == "contiguous")

    (got, got_sums), got_g = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, True)
    (want, want_sums), want_g = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, False)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert float(got_sums["correct"]) == float(want_sums["correct"])
    for path, g in jax.tree_util.tree_leaves_with_path(got_g):
        w = dict(jax.tree_util.tree_leaves_with_path(want_g))[path]
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_auto_vocabulary_chunks_are_contiguous_where_they_read_the_kernel_in_place():
    """``loss_vocab_chunks="auto"`` (the default): contiguous where the chunks divide the vocabulary
    (llama3.2-1b's 128,256 = 16 x 8,016) on one device and under tables that leave the vocabulary
    whole (dp, fsdp); strided where a mesh axis of size > 1 holds it (tp over tensor=2) or the
    chunks do not divide it (qwen's 151,936 = 2^7 x 1,187 in chunks of at most 8,192: padded);
    and the model's HeadInputs carry that choice."""
    from shardzoo.sharding.partition import Placement

    _, config = get_model("llama-tiny", **TINY)  # 100-column chunks
    e = config.execution
    assert e.loss_vocab_chunks == "auto" and contiguous_chunks(e, 500) and contiguous_chunks(e, 500, None)
    assert not contiguous_chunks(e, 512)  # 6 chunks of 86: padded
    big = config.replace(loss_vocab_chunk=8192).execution
    assert contiguous_chunks(big, 128_256) and contiguous_chunks(big, 262_144) and not contiguous_chunks(big, 151_936)
    devices = jax.devices()[:2]
    assert contiguous_chunks(e, 500, Placement(make_mesh("data=2", devices=devices), get_rules("dp")))
    assert contiguous_chunks(e, 500, Placement(make_mesh("data=2", devices=devices), get_rules("fsdp")))
    tp = Placement(make_mesh("tensor=2", devices=devices), get_rules("tp"))
    assert not contiguous_chunks(e, 500, tp)
    assert contiguous_chunks(e, 500, Placement(make_mesh("tensor=1", devices=devices[:1]), get_rules("tp")))
    # a table whose vocabulary the rules resolve to tensor only beside embed (first match wins)
    from shardzoo.sharding.rules import Rules

    odd = Rules((("embed", "data"), ("vocab", "data"), ("vocab", "tensor")))
    mesh = make_mesh("data=1,tensor=2", devices=devices)
    assert Placement(mesh, odd).mesh_axes(ax.VOCAB) == () and not contiguous_chunks(e, 500, Placement(mesh, odd))
    assert contiguous_chunks(config.replace(loss_vocab_chunks="contiguous").execution, 512, tp)
    assert not contiguous_chunks(config.replace(loss_vocab_chunks="strided").execution, 500, None)
    batch = jax.tree.map(jnp.asarray, _lm_batch(vocab=500))
    args, kw = get_task("lm").model_args(batch)
    for vocab, placement, want in ((500, None, True), (500, tp, False), (512, None, False)):
        module = config.replace(vocab_size=vocab).build(placement)
        params = jax.eval_shape(module.init, jax.random.PRNGKey(0), batch["inputs"])["params"]
        head = jax.eval_shape(lambda p, m=module: m.apply({"params": p}, *args, **kw, head=False), params)
        assert head.contiguous == want, (vocab, placement)


# SGD at lr 1: the params after the step differ by the gradients' difference. (Adam's first
# step is about lr * sign(g): it turns float rounding in a near-zero gradient into lr.)
SETTINGS = TrainConfig(batch_size=8, seq_len=16, optimizer="sgd", lr=1.0, warmup_steps=0, schedule="constant")


@functools.cache
def _step(tiled: str, rules: str, backward: str = "recompute", chunks: str = "auto"):
    """The eval step's sums and one SGD step of llama-tiny (fresh init, seed 0) under ``rules``:
    (metrics with the eval sums as ``eval_*``, params after the step)."""
    _, config = get_model("llama-tiny", **TINY, tiled_loss=tiled, tiled_loss_backward=backward,
                          loss_vocab_chunks=chunks)
    mesh = make_mesh("", devices=jax.devices()[:1]) if rules == "dp" else make_mesh("fsdp=2,tensor=4")
    program = Program(config, get_rules(rules), mesh, optimizer=functools.partial(make_optimizer, SETTINGS),
                      batch_size=8, seq_len=16)
    state, batch = program.init(jax.random.PRNGKey(0)), program.place(_lm_batch())
    sums = jax.device_get(program.compiled_eval_step()(state.params, batch))
    new, metrics = program.compiled_train_step()(state, batch, jax.random.PRNGKey(0))
    metrics = {**jax.device_get(metrics), **{f"eval_{k}": v for k, v in sums.items()}}
    return metrics, jax.device_get(new.params)


@pytest.mark.parametrize("rules", ["dp", "fsdp_tp"])
def test_train_step_tiled_equals_untiled_and_one_device(rules):
    """Vocab on the tensor axis under fsdp_tp: the scan over vocabulary chunks of a sharded head
    (the fused backward: each chunk of positions over the whole sharded vocabulary); both layouts
    of the chunks (contiguous ones of a sharded vocabulary too, where "auto" would not take them)."""
    want_m, want_p = _step("off", "dp")
    for got_m, got_p in (_step("on", rules), _step("on", rules, "fused"), _step("off", rules),
                         _step("on", rules, chunks="contiguous"), _step("on", rules, chunks="strided")):
        for key in ("loss", "grad_norm", "accuracy", "eval_loss", "eval_correct", "eval_weight"):
            np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-5, atol=1e-5, err_msg=key)
        for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert 0.0 < want_m["accuracy"] or want_m["loss"] > 5.0  # a real loss on a 512-token vocabulary


def test_tiled_train_step_needs_less_temporary_memory():
    """A structural check: the compiled step's temporaries shrink by about the float32 logits
    (4 x 128 x 16384 x 4 bytes = 32 MiB) and their gradient."""
    temp = {}
    for tiled in ("on", "off"):
        _, config = get_model("llama-tiny", **{**TINY, "loss_length_chunk": 32, "loss_vocab_chunk": 2048},
                              vocab_size=16384, tiled_loss=tiled)
        program = Program(config, get_rules("dp"), make_mesh("", devices=jax.devices()[:1]),
                          optimizer=functools.partial(make_optimizer, SETTINGS), batch_size=4, seq_len=128)
        temp[tiled] = program.compiled_train_step().memory_analysis().temp_size_in_bytes
    logits = 4 * 128 * 16384 * 4
    assert temp["on"] < temp["off"] - logits, temp


# ------------------------------------------------------------------------------ DPO, GRPO
def _head(rows, seed=2, contiguous=False):
    hidden, kernel, bias, _, _ = _data(seed)
    hidden = jnp.tile(hidden, (rows // ROWS + 1, 1, 1))[:rows]
    return HeadInputs(hidden, kernel, bias, softcap=5.0, length_chunk=3, vocab_chunk=32, contiguous=contiguous)


def _logits_or_tiled(head, tiled):
    return head if tiled else head_logits(head)


@pytest.mark.parametrize("contiguous", [False, True])
def test_dpo_sequence_logps_and_loss_grads_equal(contiguous):
    pairs = 2
    head = _head(2 * pairs, contiguous=contiguous)
    rng = np.random.default_rng(0)
    batch = {"targets": jnp.asarray(rng.integers(0, VOCAB, (pairs, 2, LENGTH)), jnp.int32),
             "loss_mask": jnp.asarray(rng.random((pairs, 2, LENGTH)) > 0.4, jnp.float32),
             "weights": jnp.ones((pairs,)), "truncated": jnp.zeros((pairs,)),
             "ref_logps": jnp.asarray(rng.normal(-30, 3, (pairs, 2)), jnp.float32)}
    task = preference_task("sigmoid", beta=0.5)
    assert task.tiles_head
    got, want = (sequence_logps(_logits_or_tiled(head, t), batch)[0] for t in (True, False))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def loss(hidden, kernel, tiled):
        return task.sums(_logits_or_tiled(head.replace(hidden=hidden, kernel=kernel), tiled), batch)["loss"]

    for g, w in zip(*(jax.grad(loss, (0, 1))(head.hidden, head.kernel, t) for t in (True, False)), strict=True):
        assert float(jnp.max(jnp.abs(w))) > 1e-4
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("contiguous", [False, True])
def test_grpo_token_logps_entropy_and_loss_grads_equal(contiguous):
    rows = 4
    head = _head(rows, seed=3, contiguous=contiguous)
    rng = np.random.default_rng(1)
    targets = jnp.asarray(rng.integers(0, VOCAB, (rows, LENGTH)), jnp.int32)
    (got_lp, got_h), (want_lp, want_h) = (token_logps(_logits_or_tiled(head, t), targets) for t in (True, False))
    np.testing.assert_allclose(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-5)
    task = grpo_task(beta=0.1)
    assert task.tiles_head
    batch = {"targets": targets, "loss_mask": jnp.asarray(rng.random((rows, LENGTH)) > 0.3, jnp.float32),
             "advantages": jnp.asarray(rng.normal(size=rows), jnp.float32), "weights": jnp.ones((rows,)),
             "ref_logps": want_lp + 0.1}

    def loss(hidden, kernel, tiled):
        return task.sums(_logits_or_tiled(head.replace(hidden=hidden, kernel=kernel), tiled), batch)["loss"]

    for g, w in zip(*(jax.grad(loss, (0, 1))(head.hidden, head.kernel, t) for t in (True, False)), strict=True):
        assert float(jnp.max(jnp.abs(w))) > 1e-4
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_forward_tiles_only_where_the_task_and_execution_say():
    module, _ = get_model("llama-tiny", **TINY, tiled_loss="on")
    batch = jax.tree.map(jnp.asarray, _lm_batch(rows=2, length=4))
    params = jax.jit(module.init)(jax.random.PRNGKey(0), batch["inputs"])["params"]
    outputs, _, _ = forward(get_task("lm"), module, params, batch, jax.random.PRNGKey(0), True)
    assert isinstance(outputs, HeadInputs) and outputs.hidden.shape == (2, 4, 32)
    off, _ = get_model("llama-tiny", **TINY, tiled_loss="off")
    outputs, _, _ = forward(get_task("lm"), off, params, batch, jax.random.PRNGKey(0), True)
    assert outputs.shape == (2, 4, 512)
    # multiple-choice scoring (train/step.py's score_step) reads the same statistics
    batch["targets"] = batch["targets"].at[0].set(jnp.argmax(outputs[0], -1))  # row 0: greedy
    got, want = (score_step(params, batch, module=m, task=get_task("lm")) for m in (module, off))
    np.testing.assert_allclose(got["logprob"], want["logprob"], rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got["greedy"], want["greedy"])
    assert bool(want["greedy"][0]) and not bool(want["greedy"][1])
