"""The component tables (models/components.py): every layer_types name finds its mixer, and a new
token mixer is its record plus one table line: a toy mixer put on the table is built by the
block, counted by the costs (parameters, FLOPs, activations, decoding cache) and checked by the
architecture, with no other edit."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

from shardzoo.models import ModelError, components, get_config
from shardzoo.models.arch import FULL, TransformerArch
from shardzoo.models.component import Mixer
from shardzoo.models.costs import decode_cache_bytes, transformer_params
from shardzoo.models.layers import Linear, linear_kw
from shardzoo.models.transformer import TransformerConfig
from shardzoo.sharding import axes as ax

SHIFT = "shift"
BLE = (ax.BATCH, ax.LENGTH, ax.EMBED)
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
            max_position_embeddings=32, layer_types=(SHIFT, FULL, SHIFT))


def _apply(block, h, positions, segment_ids):
    """The previous token's features through one matmul."""
    d = block.config.arch.hidden_size
    shifted = jnp.pad(h, ((0, 0), (1, 0), (0, 0)))[:, :-1]
    return Linear((d,), (ax.EMBED, ax.CONV_CHANNELS), True, name="shift", **linear_kw(block.config))(shifted)


def _check(a):
    if a.hidden_size > 64:
        raise ModelError(f"layer_types has {SHIFT} layers: hidden_size={a.hidden_size} must be <= 64")


TOY = Mixer(SHIFT, (SHIFT,), _apply, params=lambda a: (a.hidden_size**2, a.hidden_size),
            flops=lambda a, spec, seq_len: 1000.0,
            activations=lambda cost, spec: {"attn_context": cost.t(cost.config.arch.hidden_size, BLE)},
            cache_bytes=lambda a, batch, length, nbytes: 7 * batch, context_parallel="none needed: one token back",
            check=_check)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(components.MIXERS, SHIFT, TOY)
    monkeypatch.setitem(components.MIXER_OF_LAYER_TYPE, SHIFT, SHIFT)


def test_every_layer_type_and_mlp_kind_is_on_a_table():
    assert set(components.MIXER_OF_LAYER_TYPE) == {"full_attention", "sliding_attention", "chunked_attention", "conv",
                                                   "linear_attention", "mamba", "attention+mamba", "mamba1", "kimi_delta",
                                                   "indexed_attention", "recurrent", "moa",
                                                   "none"}
    assert set(components.MLPS) == {"dense", "moe", "dense_and_moe", "none"}
    for mixer in components.MIXERS.values():  # each says how it runs on a sharded sequence (or why not)
        assert mixer.name == "none" or mixer.context_parallel, mixer.name
    with pytest.raises(ModelError, match="layer_types must name 2 layers.*each one of full_attention"):
        TransformerArch(num_hidden_layers=2, layer_types=("full_attention", SHIFT))  # not on the table


def test_a_new_mixer_is_its_record_and_one_table_line(toy):
    config = TransformerConfig.from_fields(**TINY, scan_layers=False)
    assert [s.mixer for s in config.arch.layer_specs()] == [SHIFT, "attention", SHIFT]
    module = config.build()
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 64
    params = nn.unbox(module.init(jax.random.key(0), tokens)["params"])
    assert params["layers_0"]["shift"]["kernel"].shape == (16, 16) and "attn" in params["layers_1"]
    assert config.num_params() == sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    d = 16
    # two shift layers in attention's place: their matmuls and FLOPs instead of attention's
    attention = 4 * d * d
    assert config.flops_per_token(8) == pytest.approx(
        TransformerConfig.from_fields(**{**TINY, "layer_types": None}).flops_per_token(8)
        + 2 * (6 * (d * d - attention) + 1000.0 - 6 * 2 * 16 * 4.0))
    est = config.activation_estimate(2, 8, lambda names: 1)
    assert est.terms["attn_context"] == 2 * 8 * d * 4  # the first layer's kind: the toy's term
    assert decode_cache_bytes(config.arch, 3, 8, 4) == {SHIFT: 2 * 21, "attention": 3 * 8 * (2 * d * 4 + 4) + 4}
    with pytest.raises(ModelError, match="shift layers: hidden_size=128"):
        TransformerConfig.from_fields(**{**TINY, "hidden_size": 128})
    # the logits depend on the toy's weights
    logits = module.apply({"params": params}, tokens)
    bumped = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.5 if "shift" in jax.tree_util.keystr(p) else x, params)
    assert float(jnp.abs(module.apply({"params": bumped}, tokens) - logits).max()) > 1e-3
    assert transformer_params(config.arch) == config.num_params()


@pytest.mark.parametrize("name", ["falcon-h1-tiny", "lfm2-tiny", "qwen3-next-tiny", "llama4-tiny", "deepseek-v3-tiny",
                                  "mamba2-tiny", "jamba-tiny", "qwen2-moe-tiny",
                                  "recurrentgemma-tiny"])
def test_sub_records_are_stored_nested_and_older_flat_configs_load_into_them(name):
    """A checkpoint stores each sub-record as its own mapping; a two-record config written before
    the sub-records (their fields flat among the others, a switch for the temperature) reads back
    as the same config (so the same params and logits)."""
    config = get_config(name)
    stored = json.loads(json.dumps(config.to_dict()))
    present = [r for r in components.RECORDS.values() if getattr(config.arch, r.NAME) is not None]
    assert present and all(isinstance(stored["arch"][r.NAME], dict) for r in present)
    assert TransformerConfig.from_dict(stored) == config
    flat = {k: v for k, v in stored["arch"].items() if k not in components.RECORDS}
    for record in present:
        flat.update(getattr(config.arch, record.NAME).flat())
    if config.arch.attn_temperature_tuning:
        flat["attn_temperature_tuning"] = True
    assert TransformerConfig.from_dict({"arch": flat, "execution": stored["execution"]}) == config
    # the flat names stay what --override sets (strings parsed to the sub-record field's type)
    record = present[0]
    key, field = next(iter(record.FLAT.items()))
    value = getattr(getattr(config.arch, record.NAME), field)
    bumped = get_config(name, **{key: str(value * 2)})
    assert getattr(getattr(bumped.arch, record.NAME), field) == value * 2
    assert dataclasses.replace(getattr(bumped.arch, record.NAME), **{field: value}) == getattr(config.arch, record.NAME)
