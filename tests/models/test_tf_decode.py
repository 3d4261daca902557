"""KV-cache decoding equals full forward passes; the sampler and ``generate`` behave."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from shardzoo.models import decode as dec
from shardzoo.models import get_model
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.program import Program

TINY = dict(hidden_size=32, intermediate_size=64, vocab_size=128, max_position_embeddings=32)
B, L, PREFILL = 2, 12, 5


# Cheaper XLA:CPU compiles (about half the time); both sides of every comparison use them.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _params(module, x):
    return nn.unbox(jax.jit(module.init, compiler_options=FAST)(jax.random.key(0), x)["params"])


# mistral: sliding window 4 (shorter than the sequence), GQA, scanned layers;
# gpt2: learned positions, biases, MHA, unrolled layers; llama: an unrolled first layer, two
# scanned periods of two layers (``layers/sub_j``) and an unrolled last layer.
@pytest.mark.parametrize("name,overrides", [
    ("mistral-tiny", dict(sliding_window=4)),
    ("gpt2-tiny", dict(scan_layers=False)),
    ("llama-tiny", dict(num_hidden_layers=6, scan_layout=(1, 2, 2))),
])
def test_cached_decoding_matches_full_forward(name, overrides):
    module, config = get_model(name, **TINY, **overrides)
    x = jax.random.randint(jax.random.key(1), (B, L), 0, config.vocab_size)
    params = _params(module, x)
    full = jax.jit(module.apply, compiler_options=FAST)({"params": params}, x)
    step = jax.jit(dec.decode_step, static_argnums=0, compiler_options=FAST)
    cache = jax.jit(dec.cache_init_fn(module, B, L))(params)
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    last = jax.jit(functools.partial(dec.decode_step, last=True), static_argnums=0, compiler_options=FAST)
    np.testing.assert_allclose(last(module, params, cache, x[:, :PREFILL], pos[:, :PREFILL])[0],
                               full[:, PREFILL - 1:PREFILL], atol=1e-5, rtol=0)  # a prefill's head: one position
    logits, cache = step(module, params, cache, x[:, :PREFILL], pos[:, :PREFILL])
    outs = [logits]
    for i in range(PREFILL, L):
        logits, cache = step(module, params, cache, x[:, i:i + 1], pos[:, i:i + 1])
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5, rtol=0)


def test_greedy_generate_is_argmax_of_full_forwards_with_left_padding():
    module, config = get_model("mistral-tiny", **TINY, sliding_window=4)
    x = jax.random.randint(jax.random.key(2), (B, 6), 0, config.vocab_size)
    prompt = x.at[1, :2].set(7)  # row 1: two padding tokens, then a 4-token prompt
    lengths = jnp.array([6, 4])
    params = _params(module, prompt)
    program = Program(config, get_rules("dp"), make_mesh("data=1", devices=jax.devices()[:1]))
    out = program.decoding.generate(params, prompt, lengths, max_new_tokens=6)
    again = program.decoding.generate(params, prompt, lengths, max_new_tokens=6)
    assert out.shape == (B, 12) and out.dtype == np.int32
    np.testing.assert_array_equal(out, again)
    np.testing.assert_array_equal(out[:, :6], prompt)
    # Full forwards over each row's real tokens (row 1 without its padding, then filler).
    rows = jnp.stack([out[0], jnp.concatenate([out[1, 2:], jnp.array([1, 2])])])
    logits = jax.jit(module.apply, compiler_options=FAST)({"params": params}, rows)
    np.testing.assert_array_equal(out[0, 6:], jnp.argmax(logits[0, 5:11], axis=-1))
    np.testing.assert_array_equal(out[1, 6:], jnp.argmax(logits[1, 3:9], axis=-1))


def _fake_model(vocab=8):
    """tokens_to_logits of a bigram table: next token prefers (token + 1) % vocab."""
    table = jnp.log(jax.nn.one_hot((jnp.arange(vocab) + 1) % vocab, vocab) * 0.6 + 0.4 / vocab)

    def tokens_to_logits(tokens, state):
        return table[tokens], state + 1

    return table, tokens_to_logits


def test_sampler_greedy_eos_and_padding():
    table, fn = _fake_model()
    first = table[jnp.array([0, 5])]
    out, calls = dec.sample_loop(fn, jnp.int32(0), first, 6, jax.random.key(0), eos_ids=(3,), pad_id=-1)
    np.testing.assert_array_equal(out, [[1, 2, 3, -1, -1, -1], [6, 7, 0, 1, 2, 3]])
    assert int(calls) == 6
    out, calls = dec.sample_loop(fn, jnp.int32(0), first[:1], 6, jax.random.key(0), eos_ids=(3,))
    assert int(calls) == 3  # stopped once every row had ended


def test_sampler_top_k_top_p_and_temperature():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    keys = jax.random.key(0)
    greedy = dec.sample_logits(logits, keys, temperature=0.0)
    assert set(np.asarray(greedy).tolist()) == {0}
    top1 = dec.sample_logits(logits, keys, temperature=1.0, top_k=1)
    assert set(np.asarray(top1).tolist()) == {0}
    top2 = np.asarray(dec.sample_logits(logits, keys, temperature=1.0, top_k=2))
    assert set(top2.tolist()) == {0, 1}
    np.testing.assert_allclose(np.mean(top2 == 0), 0.5 / 0.8, atol=0.03)
    nucleus = np.asarray(dec.sample_logits(logits, keys, temperature=1.0, top_p=0.7))
    assert set(nucleus.tolist()) == {0, 1}  # 0.5 < 0.7 needs the second token, not the third
    free = np.asarray(dec.sample_logits(logits, keys, temperature=1.0))
    np.testing.assert_allclose(np.bincount(free, minlength=4) / len(free), [0.5, 0.3, 0.15, 0.05], atol=0.03)
    same = dec.sample_logits(logits, keys, temperature=1.0)
    np.testing.assert_array_equal(free, same)


def test_sample_loop_honours_temperature_top_k_and_top_p_at_every_step():
    rows, steps, vocab = 2000, 4, 6
    probs = jnp.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    fixed = jnp.broadcast_to(jnp.log(probs), (rows, vocab))

    def same_logits(tokens, state):
        return fixed, state + 1

    # Temperature reshapes the distribution: frequencies of 8,000 draws follow softmax(logits / T)
    # within 0.02 (a binomial's standard deviation here is at most 0.0056).
    for temperature in (0.5, 1.0, 2.0):
        out, _ = dec.sample_loop(same_logits, 0, fixed, steps, jax.random.key(1), temperature)
        freq = np.bincount(np.asarray(out).ravel(), minlength=vocab) / out.size
        want = jax.nn.softmax(jnp.log(probs) / temperature)
        np.testing.assert_allclose(freq, want, atol=0.02, err_msg=f"temperature {temperature}")
    # top_p below the top token's probability leaves only that token.
    out, _ = dec.sample_loop(same_logits, 0, fixed, steps, jax.random.key(2), 2.0, top_p=0.1)
    assert set(np.asarray(out).ravel().tolist()) == {0}

    # Logits that change every step (a fresh random table per step, per row): top_k=1 is greedy,
    # and with top_k=3 every token is among the 3 most likely of its own step's logits.
    table = jax.random.normal(jax.random.key(3), (steps + 1, 64, 32)) * 2

    def changing(tokens, step):
        return table[step + 1], step + 1

    def run(**kw):
        return np.asarray(dec.sample_loop(changing, 0, table[0], steps, jax.random.key(4), **kw)[0])

    greedy = run(temperature=0.0)
    np.testing.assert_array_equal(greedy, np.argmax(table[:steps], -1).T)
    np.testing.assert_array_equal(run(temperature=3.0, top_k=1), greedy)
    np.testing.assert_array_equal(run(temperature=3.0, top_p=1e-6), greedy)
    top3, logits = run(temperature=3.0, top_k=3), np.asarray(table[:steps])  # [step, row, vocab]
    rank = (logits > np.take_along_axis(logits, top3.T[..., None], -1)).sum(-1)
    assert rank.max() <= 2 and (rank > 0).mean() > 0.3  # sampled among the top 3, not only the top


def test_cache_carries_logical_axes_and_shards_under_the_rules():
    """The cache's arrays carry logical axes (on a CPU the keys transposed, positions minor:
    ``kv_cache_transposed_keys="auto"``) and are created sharded as the rules say."""
    _, config = get_model("llama-tiny", **TINY)
    assert jax.default_backend() == "cpu"
    one = Program(config, get_rules("dp"), make_mesh("data=1", devices=jax.devices()[:1]))
    boxed = jax.eval_shape(dec.cache_init_fn(one.module, 4, 16), one.params_target())
    specs = nn.get_partition_spec(boxed)["layers"]["attn"]
    assert specs["cached_key"] == P("layers", "batch", "kv_heads", "head_dim", "cache_length")
    assert specs["cached_value"] == P("layers", "batch", "kv_heads", "cache_length", "head_dim")
    assert specs["cached_segment_ids"] == P("layers", "batch", "cache_length")
    plain = Program(config.replace(kv_cache_transposed_keys="off"), get_rules("dp"), one.mesh)
    boxed = jax.eval_shape(dec.cache_init_fn(plain.module, 4, 16), plain.params_target())
    assert nn.get_partition_spec(boxed)["layers"]["attn"]["cached_key"] == P(
        "layers", "batch", "kv_heads", "cache_length", "head_dim")
    mesh = make_mesh("data=4,tensor=2")
    program = Program(config, get_rules("tp"), mesh)
    cache = program.decoding.new_cache(4, 16)  # decoding's: one per layer (decode_layers="unroll")
    assert sorted(cache) == ["layers_0", "layers_1"]
    key, value = cache["layers_1"]["attn"]["cached_key"], cache["layers_1"]["attn"]["cached_value"]
    assert key.shape == (4, 2, 8, 16) and value.shape == (4, 2, 16, 8)
    assert key.addressable_shards[0].data.shape == (1, 1, 8, 16)  # batch/4, kv_heads/2
    assert value.addressable_shards[0].data.shape == (1, 1, 16, 8)
    scan = Program(config.replace(decode_layers="scan"), get_rules("tp"), mesh)
    cache = scan.decoding.new_cache(4, 16)  # the scanned layers' stacked
    assert sorted(cache) == ["layers"]
    key = cache["layers"]["attn"]["cached_key"]
    assert key.shape == (2, 4, 2, 8, 16)
    assert key.addressable_shards[0].data.shape == (2, 1, 1, 8, 16)


SAMPLING = (dict(), dict(temperature=1.0, top_k=20, seed=7))  # greedy, then sampled


@functools.cache
def _one_device_tokens():
    """llama-tiny on one device: (config, params, prompt, the greedy and sampled tokens of
    ``SAMPLING``), computed once for both ``decode_layers`` below."""
    _, config = get_model("llama-tiny", **TINY)
    one = Program(config, get_rules("dp"), make_mesh("data=1", devices=jax.devices()[:1]))
    params = one.init(np.asarray(jax.random.PRNGKey(3), np.uint32)).params
    prompt = np.asarray(jax.random.randint(jax.random.key(4), (4, 5), 0, config.vocab_size))
    return config, params, prompt, [one.decoding.generate(params, prompt, max_new_tokens=7, **kw) for kw in SAMPLING]


@pytest.mark.parametrize("decode_layers,layer,lead", [("unroll", "layers_0", ()), ("scan", "layers", (None,))])
def test_decoding_under_fsdp_tp_shards_the_cache_and_equals_one_device(decode_layers, layer, lead):
    """The Program's compiled decoding on 8 devices: every cache array sharded as its logical
    axes say under fsdp_tp (batch over data+fsdp, kv heads over tensor), the same greedy and
    sampled tokens as one device (decoding unrolled); for either ``decode_layers``."""
    config, params, prompt, wants = _one_device_tokens()
    program = Program(config.replace(decode_layers=decode_layers), get_rules("fsdp_tp"), make_mesh("fsdp=4,tensor=2"))
    placed = jax.device_put(jax.device_get(params), program.shardings.params)
    for kw, want in zip(SAMPLING, wants, strict=True):
        got = program.decoding.generate(placed, prompt, max_new_tokens=7, **kw)
        np.testing.assert_array_equal(got, want)
    _, shardings = program.decoding.cache_shardings(4, 12)
    attn = shardings[layer]["attn"]
    assert attn["cached_key"].spec == P(*lead, ("data", "fsdp"), "tensor", None, None)
    assert attn["cached_segment_ids"].spec == P(*lead, ("data", "fsdp"), None)
    cache = program.decoding.new_cache(4, 12)
    for name in ("cached_key", "cached_value", "cached_segment_ids"):
        assert cache[layer]["attn"][name].sharding == attn[name], name
    assert cache[layer]["attn"]["cached_key"].addressable_shards[0].data.shape == (2,) * len(lead) + (1, 1, 8, 12)
    assert cache[layer]["attn"]["cached_value"].addressable_shards[0].data.shape == (2,) * len(lead) + (1, 1, 12, 8)


def test_scan_and_unroll_decoding_give_the_same_tokens_and_logits():
    """``decode_layers="scan"`` (the layer scan over the stacked cache; also two periods a loop
    iteration, ``decode_scan_unroll``) and "unroll" (every layer its own weights and cache) on
    the same params of an unrolled first layer, two scanned periods of two layers and an
    unrolled last layer: the same greedy tokens from ``generate``, and the same logits (1e-5) at
    the prefill and every one-token step."""
    _, config = get_model("llama-tiny", **TINY, num_hidden_layers=6, scan_layout=(1, 2, 2))
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    variants = {"unroll": dict(decode_layers="unroll"), "scan": dict(decode_layers="scan"),
                "scan, 2 a loop": dict(decode_layers="scan", decode_scan_unroll=2)}
    programs = {d: Program(config.replace(**kw), get_rules("dp"), mesh) for d, kw in variants.items()}
    params = programs["scan"].init(np.asarray(jax.random.PRNGKey(5), np.uint32)).params
    assert sorted(params) == ["embed", "final_norm", "layers", "layers_0", "layers_5", "lm_head"]
    prompt = np.asarray(jax.random.randint(jax.random.key(6), (B, PREFILL), 0, config.vocab_size))
    tokens = {d: p.decoding.generate(params, prompt, max_new_tokens=L - PREFILL) for d, p in programs.items()}
    np.testing.assert_array_equal(tokens["scan"], tokens["unroll"])
    np.testing.assert_array_equal(tokens["scan, 2 a loop"], tokens["unroll"])
    step = jax.jit(dec.decode_step, static_argnums=0, compiler_options=FAST)
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    x = tokens["unroll"]
    logits = {}
    for d, program in programs.items():
        module, weights, cache = program.decoding.decoder, program.decoding.decoding_params(params), program.decoding.new_cache(B, L)
        assert sorted(cache) == (["layers", "layers_0", "layers_5"] if d.startswith("scan")
                                 else [f"layers_{i}" for i in range(6)])
        out, cache = step(module, weights, cache, x[:, :PREFILL], pos[:, :PREFILL])
        outs = [out]
        for i in range(PREFILL, L):
            out, cache = step(module, weights, cache, x[:, i:i + 1], pos[:, i:i + 1])
            outs.append(out)
        logits[d] = np.asarray(jnp.concatenate(outs, axis=1))
    np.testing.assert_allclose(logits["scan"], logits["unroll"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits["scan, 2 a loop"], logits["unroll"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.argmax(logits["scan"][:, PREFILL - 1:-1], -1), x[:, PREFILL:])  # greedy
    assert np.abs(logits["unroll"]).max() > 0.1  # not all zeros


def _generate_hlo(layers):
    """The compiled ``generate`` (``decode_layers="scan"``) of a scanned llama-tiny of ``layers``
    layers (2 rows, a 16-token prompt, 240 new tokens), its stacked key cache's shape and the whole cache's bytes.
    One loop over the whole cache (``decode_cache_segments=1``): growing it between stretches holds
    two caches at once."""
    _, config = get_model("llama-tiny", **dict(TINY, max_position_embeddings=256), num_hidden_layers=layers,
                          decode_layers="scan", decode_cache_segments=1)
    program = Program(config, get_rules("dp"), make_mesh("data=1", devices=jax.devices()[:1]))
    compiled, _ = program.decoding._compile_generate((2, 16), 240, 0.0, 0, 1.0, (), 0)
    shapes, _ = program.decoding.cache_shardings(2, 256)
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    return compiled, shapes["layers"]["attn"]["cached_key"].shape, whole


def test_scanned_decoding_writes_the_stacked_cache_in_place_and_compiles_one_layer():
    """``decode_layers="scan"`` scans the layers and carries the stacked cache through the sampling loop in
    place: no copy of a stacked cache array anywhere in the program (nn.scan's per-layer cache
    outputs copied it five times), the temporaries beyond the cache itself do not grow with the
    layers (theirs did, by a cache), and 8 layers compile to as many instructions as 4."""
    seen = {}
    for layers in (4, 8):
        compiled, key_shape, whole = _generate_hlo(layers)
        text = compiled.as_text()
        stacked = "f32[" + ",".join(map(str, key_shape)) + "]"
        assert key_shape[0] == layers and stacked in text
        copies = re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} copy\(", text)
        assert stacked not in copies, copies
        instructions = len(re.findall(r"^\s+(?:ROOT )?%\S+ = ", text, re.M))
        seen[layers] = (compiled.memory_analysis().temp_size_in_bytes - whole, instructions)
    assert seen[8][0] <= seen[4][0] + 8 * 1024, seen  # 4 more layers' cache: 270 KB
    assert seen[8][1] == seen[4][1], seen


def test_greedy_is_argmax_with_ties_nans_and_infinities():
    """The greedy pick (a max, then the first index holding it) is ``jnp.argmax``'s: the first
    of tied maxima, the first NaN of a row with NaNs, index 0 of a row of -inf."""
    x = np.array(jax.random.normal(jax.random.key(8), (6, 300)), np.float32)
    x[0, [5, 9, 200]] = 9.0  # ties
    x[1, [7, 100]] = np.nan
    x[2] = -np.inf
    x[3, 17], x[3, 250] = np.inf, np.inf
    x[4, 299] = 50.0  # the last
    got = jax.jit(lambda v: dec.sample_logits(v, None, temperature=0.0))(jnp.asarray(x))
    np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(x), -1))
    np.testing.assert_array_equal(got[:5], [5, 7, 0, 17, 299])


def test_top_k_and_top_p_thresholds_equal_sorting():
    """The sampler's thresholds come from bisections over the logits' bits (no sort of the
    vocabulary): the k-th largest and the top-p cut of sorted rows, negatives, ties and -0 too."""
    x = np.array(jax.random.normal(jax.random.key(7), (64, 500)) * 3, np.float32)
    x[:, :40] = np.round(x[:, :40])  # ties
    x[0, :3] = [-0.0, 0.0, -0.0]
    keys = dec._order_keys(jnp.asarray(x))
    for k in (1, 7, 50):
        kth = dec._largest_key(keys, lambda at_least, k=k: at_least.sum(-1) >= k)
        want = np.sort(x, -1)[:, ::-1][:, k - 1:k]
        np.testing.assert_array_equal(np.asarray(keys >= kth), x >= want)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(x), -1), np.float64)
    for p in (0.1, 0.5, 0.9):
        cut = dec._largest_key(keys, lambda at_least, p=p: jnp.sum(
            jnp.where(at_least, jnp.asarray(probs, jnp.float32), 0.0), -1) >= p)
        # keep a token when the tokens strictly more likely than it hold less than p
        above = np.array([[probs[r][x[r] > v].sum() for v in x[r]] for r in range(len(x))])
        np.testing.assert_array_equal(np.asarray(keys >= cut), above < p)


CACHE_LAYOUTS = {"plain": dict(kv_cache_packing="off", kv_cache_transposed_keys="off"),
                 "packed": dict(kv_cache_packing="on", kv_cache_transposed_keys="off"),  # a TPU's "auto"
                 "transposed": dict(kv_cache_packing="off", kv_cache_transposed_keys="on"),  # a CPU's "auto"
                 "both": dict(kv_cache_packing="on", kv_cache_transposed_keys="on")}


@pytest.mark.parametrize("decode_layers", ["unroll", "scan"])
def test_packed_and_transposed_caches_decode_as_the_plain_one(decode_layers):
    """``kv_cache_packing="on"`` (a TPU's "auto"): head_dim 32 puts four kv heads (two query
    heads each) in each 128-wide row of the cache; ``kv_cache_transposed_keys="on"`` (a CPU's
    "auto") holds the keys positions minor; either, and both, give the plain cache's logits
    (1e-5) at the prefill and every one-token step, the keys held [batch, kv_heads / 4, length,
    128] packed, [batch, kv_heads, 32, length] transposed, and the values never transposed."""
    _, config = get_model("llama-tiny", hidden_size=256, intermediate_size=128, vocab_size=512,
                          num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2,
                          decode_layers=decode_layers)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    programs = {p: Program(config.replace(**kw), get_rules("dp"), mesh) for p, kw in CACHE_LAYOUTS.items()}
    params = programs["plain"].init(np.asarray(jax.random.PRNGKey(3), np.uint32)).params
    x = np.asarray(jax.random.randint(jax.random.key(4), (B, L), 0, config.vocab_size))
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    step = jax.jit(dec.decode_step, static_argnums=0, compiler_options=FAST)
    logits, shapes = {}, {}
    for p, program in programs.items():
        module, weights = program.decoding.decoder, program.decoding.decoding_params(params)
        cache = program.decoding.new_cache(B, L)
        flat = jax.tree_util.tree_flatten_with_path(cache)[0]
        shapes[p] = {name: [v.shape for k, v in flat if jax.tree_util.keystr(k).endswith(f"['{name}']")]
                     for name in ("cached_key", "cached_value")}
        out, cache = step(module, weights, cache, x[:, :PREFILL], pos[:, :PREFILL])
        outs = [out]
        for i in range(PREFILL, L):
            out, cache = step(module, weights, cache, x[:, i:i + 1], pos[:, i:i + 1])
            outs.append(out)
        logits[p] = np.asarray(jnp.concatenate(outs, axis=1))
    for p in ("packed", "transposed", "both"):
        np.testing.assert_allclose(logits[p], logits["plain"], atol=1e-5, rtol=0, err_msg=p)
    assert np.abs(logits["plain"]).max() > 0.1
    want = {"plain": ((4, L, 32), (4, L, 32)), "packed": ((1, L, 128), (1, L, 128)),
            "transposed": ((4, 32, L), (4, L, 32)), "both": ((1, 128, L), (1, L, 128))}
    for p, (key, value) in want.items():
        assert len(shapes[p]["cached_key"]) == (1 if decode_layers == "scan" else 2), shapes[p]
        assert all(s[-3:] == key for s in shapes[p]["cached_key"]), (p, shapes[p])
        assert all(s[-3:] == value for s in shapes[p]["cached_value"]) and shapes[p]["cached_value"], (p, shapes[p])


@pytest.mark.parametrize("decode_layers", ["unroll", "scan"])
def test_sampling_loop_in_stretches_grows_the_cache_and_keeps_the_tokens(decode_layers):
    """``decode_cache_segments=3`` (a CPU's "auto" is up to 4 of at least 32 new tokens each): 7 new tokens in stretches ending at 3, 5
    and 7, each a loop over a cache of the prompt's length plus its end (the keys of each length in
    the compiled program), give one loop's greedy and sampled tokens on LFM2 (convolution layers,
    whose states do not grow, between attention layers), a left-padded row included."""
    from shardzoo.models import ModelError

    _, config = get_model("lfm2-tiny", **TINY, decode_layers=decode_layers)
    assert dec.segment_ends(7, 3) == [3, 5, 7] and dec.segment_ends(2, 4) == [1, 2] and dec.segment_ends(0, 4) == [0]
    # "auto" on this CPU: a stretch of at least STRETCH_STEPS (32) new tokens, at most 4
    assert [dec.cache_segments(config.execution, n) for n in (7, 63, 64, 128, 1000)] == [1, 1, 2, 4, 4]
    assert dec.cache_segments(config.replace(decode_cache_segments=3).execution, 7) == 3  # as asked
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    programs = {n: Program(config.replace(decode_cache_segments=n), get_rules("dp"), mesh) for n in (1, 3)}
    params = programs[1].init(np.asarray(jax.random.PRNGKey(9), np.uint32)).params
    leaves, tree = jax.tree.flatten(params)  # wide random weights: tokens that change from step to step
    params = tree.unflatten([jax.random.normal(jax.random.key(i), x.shape, x.dtype) * 0.5 for i, x in enumerate(leaves)])
    prompt = np.asarray(jax.random.randint(jax.random.key(10), (B, PREFILL), 1, config.vocab_size), np.int32)
    lengths = np.array([PREFILL, PREFILL - 2], np.int32)
    for kw in SAMPLING:
        got = {n: p.decoding.generate(params, prompt, lengths, max_new_tokens=7, **kw) for n, p in programs.items()}
        np.testing.assert_array_equal(got[3], got[1])
        assert all(len(set(row.tolist())) > 3 for row in got[1][:, PREFILL:]), got[1]  # not one repeated token
    text = programs[3].decoding._compiled[((B, PREFILL), 7, 0.0, 0, 1.0, (), 0)][0].as_text()  # the greedy one
    for end in (3, 5, 7):
        shapes, _ = programs[3].decoding.cache_shardings(B, PREFILL + end)
        key = [x.shape for k, x in jax.tree_util.tree_flatten_with_path(shapes)[0] if "cached_key" in jax.tree_util.keystr(k)]
        assert key and all(s[-1] == PREFILL + end for s in key), key  # positions minor (transposed keys)
        assert all("f32[" + ",".join(map(str, s)) + "]" in text for s in key), (end, key)
    with pytest.raises(ModelError, match=r"decode_cache_segments=0 must be an integer: -1 \(auto\)"):
        config.replace(decode_cache_segments=0)


@pytest.mark.parametrize("decode_layers", ["unroll", "scan"])
def test_prefill_runs_the_projections_apart_on_a_cpu(decode_layers, monkeypatch):
    """On a CPU (``decode.prefill_fuses``) decoding's prefill runs up and gate (and k and v) as
    matmuls of their own: no stacked up|gate kernel ([hidden, 2, intermediate] on one CPU device,
    ``layers.flat_tokens``; [2, hidden, intermediate] elsewhere) in the compiled ``generate``,
    where ``fuse_projections``' prefill stacks one per layer, and the same greedy tokens."""
    from shardzoo.train import decoding

    _, config = get_model("llama-tiny", **TINY, num_hidden_layers=3, decode_layers=decode_layers)  # params [3, ...]
    assert config.execution.fuse_projections and not dec.prefill_fuses(config.execution)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    h, i = TINY["hidden_size"], TINY["intermediate_size"]
    stacks = (f"f32[{h},2,{i}]", f"f32[2,{h},{i}]")
    params = prompt = None
    texts, tokens = {}, {}
    for fuse in (False, True):
        monkeypatch.setattr(decoding, "prefill_fuses", lambda e, fuse=fuse: fuse)
        program = Program(config, get_rules("dp"), mesh)
        if params is None:
            params = program.init(np.asarray(jax.random.PRNGKey(11), np.uint32)).params
            prompt = np.asarray(jax.random.randint(jax.random.key(12), (B, PREFILL), 1, config.vocab_size), np.int32)
        tokens[fuse] = program.decoding.generate(params, prompt, max_new_tokens=3)
        texts[fuse] = program.decoding._compiled[((B, PREFILL), 3, 0.0, 0, 1.0, (), 0)][0].as_text()
    assert any(s in texts[True] for s in stacks) and not any(s in texts[False] for s in stacks)
    np.testing.assert_array_equal(tokens[False], tokens[True])


def test_decode_vmem_limit_is_a_tpu_compile_option_and_checked():
    """``decode_vmem_kib`` reaches ``generate``'s compile as libtpu's scoped VMEM limit on a TPU
    only ("auto": 7/8 of the chip's VMEM for unrolled layers whose cache weighs a quarter of the
    weights, as measured on v5e; XLA:CPU rejects the option): on this CPU an explicit limit compiles
    and gives the default's greedy tokens; a negative size other than -1 is one line."""
    from shardzoo.models import ModelError
    from shardzoo.train.decoding import auto_vmem_kib

    _, config = get_model("llama-tiny", **TINY, num_hidden_layers=2)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    programs = {k: Program(config.replace(decode_vmem_kib=k), get_rules("dp"), mesh) for k in (-1, 65536)}
    assert all(p.decoding.compiler_options(B, PREFILL + 4) == {} for p in programs.values())
    params = programs[-1].init(np.asarray(jax.random.PRNGKey(1), np.uint32)).params
    prompt = np.asarray(jax.random.randint(jax.random.key(2), (B, PREFILL), 1, config.vocab_size), np.int32)
    tokens = {k: np.asarray(p.decoding.generate(params, prompt, max_new_tokens=4)) for k, p in programs.items()}
    np.testing.assert_array_equal(tokens[65536], tokens[-1])
    assert tokens[-1].shape == (B, PREFILL + 4)
    big = {"scanned": False, "cache_bytes": 1410, "weight_bytes": 1192}  # qwen3-0.6b, batch 32 (MB)
    assert auto_vmem_kib(128 << 20, **big) == 114688  # v5e and v6e: the limit measured on v5e
    assert auto_vmem_kib(16 << 20, **big) == 14336  # v4's 16 MiB: under the chip's own
    assert auto_vmem_kib(128 << 20, **{**big, "scanned": True}) == 0  # scanned: 47% -> 36% with it
    assert auto_vmem_kib(128 << 20, scanned=False, cache_bytes=13, weight_bytes=2472) == 0  # llama batch 1
    assert auto_vmem_kib(128 << 20, scanned=False, cache_bytes=250, weight_bytes=1000) == 114688
    assert auto_vmem_kib(128 << 20, scanned=False, cache_bytes=249, weight_bytes=1000) == 0
    with pytest.raises(ModelError, match=r"decode_vmem_kib=-2 must be an integer: -1 \(auto\)"):
        config.replace(decode_vmem_kib=-2)


@pytest.mark.parametrize("name,overrides", [
    ("llama-tiny", dict(num_hidden_layers=6, scan_layout=(1, 2, 2))),  # GQA; unrolled and scanned layers
    ("qwen2-tiny", dict(lora_rank=2)),  # q, k and v biases, and LoRA adapters beside the flat kernels
    ("qwen3-next-tiny", {}),  # the attention's output gate (a kernel onto heads too), linear attention beside
])
@pytest.mark.parametrize("decode_layers", ["unroll", "scan"])
def test_flat_head_kernels_give_the_same_tokens_and_logits(name, overrides, decode_layers):
    """``decode_flat_heads="on"``: decoding takes every kernel onto heads (q, k, v, the output
    gate) as ``[embed, heads x head_dim]`` (``models.decode.flat_head_kernels``; what "auto" does on
    a TPU for a head_dim below 128 lanes) and gives "off"'s greedy tokens and, step by step, its
    logits (1e-5); "auto" keeps them as declared off a TPU; nothing else is reshaped."""
    _, config = get_model(name, **TINY, **overrides, decode_layers=decode_layers)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    programs = {f: Program(config.replace(decode_flat_heads=f), get_rules("dp"), mesh) for f in ("on", "off", "auto")}
    params = programs["off"].init(np.asarray(jax.random.PRNGKey(5), np.uint32)).params
    if config.execution.lora_rank:  # the zero-initialised B made to matter
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.1 if jax.tree_util.keystr(p).endswith("['lora_b']") else x, params)
    assert programs["auto"].decoding._flat_head_dims is None and programs["off"].decoding._flat_head_dims is None
    shapes = {f: {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(
        jax.eval_shape(programs[f].decoding.decoding_params, params))} for f in ("on", "off")}
    changed = {k for k in shapes["on"] if shapes["on"][k] != shapes["off"][k]}
    assert changed and all(re.search(r"\['(q|k|v|gate)'\]\['kernel'\]$", k) for k in changed), changed
    for k in changed:
        assert shapes["on"][k] == shapes["off"][k][:-2] + (shapes["off"][k][-2] * shapes["off"][k][-1],), k
    prompt = np.asarray(jax.random.randint(jax.random.key(6), (B, PREFILL), 0, config.vocab_size))
    tokens = {f: programs[f].decoding.generate(params, prompt, max_new_tokens=L - PREFILL) for f in ("on", "off")}
    np.testing.assert_array_equal(tokens["on"], tokens["off"])
    step = jax.jit(dec.decode_step, static_argnums=0, compiler_options=FAST)
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    x, logits = tokens["off"], {}
    for f in ("on", "off"):
        d = programs[f].decoding
        weights, cache = d.decoding_params(params), d.new_cache(B, L)
        out, cache = step(d.decoder, weights, cache, x[:, :PREFILL], pos[:, :PREFILL])
        outs = [out]
        for i in range(PREFILL, L):
            out, cache = step(d.decoder, weights, cache, x[:, i:i + 1], pos[:, i:i + 1])
            outs.append(out)
        logits[f] = np.asarray(jnp.concatenate(outs, axis=1))
    np.testing.assert_allclose(logits["on"], logits["off"], atol=1e-5, rtol=0)
    assert np.abs(logits["off"]).max() > 0.1


def test_auto_flat_head_kernels_on_a_tpu_where_the_lanes_pad_head_dim():
    """"auto" takes a head_dim the TPU's 128 lanes pad (64, 80) and not one they hold (128, 256),
    on a TPU only and only where no mesh axis holds the heads (tp over tensor=2: None)."""
    from types import SimpleNamespace

    from shardzoo.sharding.partition import Placement
    from shardzoo.train.decoding import Decoding

    _, config = get_model("llama-tiny", **TINY)
    devices = jax.devices()[:2]

    def dims(platform, placement):
        mesh = SimpleNamespace(devices=np.array([SimpleNamespace(platform=platform)]))
        return Decoding(SimpleNamespace(config=config, placement=placement, mesh=mesh))._flat_head_dims

    one = Placement(make_mesh("data=1", devices=devices[:1]), get_rules("dp"))
    tpu = dims("tpu", one)
    assert [tpu(d) for d in (64, 80, 128, 256)] == [True, True, False, False]
    assert dims("cpu", one) is None and dims("gpu", one) is None
    assert dims("tpu", Placement(make_mesh("data=2", devices=devices), get_rules("fsdp"))) is not None
    assert dims("tpu", Placement(make_mesh("tensor=2", devices=devices), get_rules("tp"))) is None


def test_a_sampling_task_plans_on_an_abstract_mesh():
    """GRPO's plan counts its rollouts' cache (``rollout_bytes``, through decoding's params) on a
    mesh larger than this machine: an AbstractMesh has no devices to ask for their platform."""
    from shardzoo.sharding.mesh import make_abstract_mesh
    from shardzoo.train.tasks.registry import get_task

    _, config = get_model("llama-tiny", **TINY)
    programs = {f: Program(config.replace(decode_flat_heads=f), get_rules("dp"), make_abstract_mesh("data=16"),
                           task=get_task("grpo"), batch_size=16, seq_len=16) for f in ("auto", "off")}
    assert programs["auto"].decoding._flat_head_dims is None  # this machine's backend: a CPU
    cache = {f: p.decoding.cache_bytes(16, 16) for f, p in programs.items()}
    assert cache["auto"] == cache["off"] > 0
    plans = {f: p.plan() for f, p in programs.items()}
    assert plans["auto"].totals == plans["off"].totals and plans["auto"].totals["total"] > 0
