"""config.json <-> TransformerConfig without weights: Hub-style files (legacy rope keys, Qwen2's
disabled window, GPT-2 without the ``transformer.`` prefix) and configs HF cannot express."""

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from shardzoo.models import get_config
from shardzoo.models.hf import HFError, config_from_hf, config_to_hf, load_hf_config
from shardzoo.models.transformer import TransformerConfig
from shardzoo.train.io.hf_io import load_hf

LLAMA31 = {  # the shape of meta-llama/Llama-3.1-8B's config.json (transformers 4 keys)
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
}


def test_legacy_and_transformers5_rope_keys_map_alike():
    v5 = {k: v for k, v in LLAMA31.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**LLAMA31["rope_scaling"], "rope_theta": 500000.0}
    legacy = config_from_hf(LLAMA31)
    assert legacy == config_from_hf(v5)
    assert legacy["rope_theta"] == 500000.0 and dict(legacy["rope_scaling"])["rope_type"] == "llama3"
    assert legacy["eos_token_id"] == (128001, 128008, 128009)
    # the zoo's own llama3.1-8b preset is exactly this config (but for its single eos id)
    preset = get_config("llama3.1-8b")
    assert TransformerConfig.ARCH(**(legacy | {"eos_token_id": 128001})) == preset.arch


def test_qwen2_disabled_window_and_unsupported_inputs():
    qwen = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21,
            "rope_theta": 1000000.0, "tie_word_embeddings": True}
    fields = config_from_hf(qwen)
    assert fields["sliding_window"] is None and fields["attention_bias"] and not fields["attention_out_bias"]
    with pytest.raises(HFError, match="rope_scaling type 'su' is not supported"):
        config_from_hf({**LLAMA31, "rope_scaling": {"type": "su", "factor": 4.0}})
    with pytest.raises(HFError, match="unsupported model_type 'rwkv'"):
        config_from_hf({**LLAMA31, "model_type": "rwkv"})
    with pytest.raises(HFError, match="no hidden_size"):
        config_from_hf({k: v for k, v in LLAMA31.items() if k != "hidden_size"})


@pytest.mark.parametrize("preset", ["llama2-7b", "llama3.1-8b", "mistral-7b", "qwen2.5-0.5b", "mixtral-8x7b",
                                    "gpt2"])
def test_presets_survive_config_to_hf_and_back(preset):
    config = get_config(preset)
    hf = config_to_hf(config)
    assert hf["model_type"] == {"llama2-7b": "llama", "llama3.1-8b": "llama", "mistral-7b": "mistral",
                                "qwen2.5-0.5b": "qwen2", "mixtral-8x7b": "mixtral", "gpt2": "gpt2"}[preset]
    back = config_from_hf(json.loads(json.dumps(hf)))
    assert back == dataclasses.asdict(config.arch)  # the whole architecture, field by field


def test_configs_hf_cannot_express_are_refused():
    gpt2 = get_config("gpt2-tiny")
    with pytest.raises(HFError, match="norm_type='rmsnorm'"):
        config_to_hf(gpt2.replace(norm_type="rmsnorm"))
    # Mixtral has no field for dense layers among its MoE layers: the feature is named
    with pytest.raises(HFError, match=r"mixtral cannot express feature moe_pattern \(mlp_layer_types="):
        config_to_hf(get_config("mixtral-tiny").replace(mlp_layer_types=("moe", "dense")), family="mixtral")


def test_gpt2_hub_layout_without_prefix_and_with_mask_buffers(tmp_path):
    """openai-community/gpt2 stores ``h.0.attn.c_attn.weight`` (no prefix) and ``h.0.attn.bias``."""
    config = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 2,
              "n_positions": 32}
    rng = np.random.default_rng(0)
    shapes = {"wte.weight": (64, 16), "wpe.weight": (32, 16), "ln_f.weight": (16,), "ln_f.bias": (16,)}
    for i in range(2):
        h = f"h.{i}."
        shapes |= {h + "ln_1.weight": (16,), h + "ln_1.bias": (16,), h + "ln_2.weight": (16,),
                   h + "ln_2.bias": (16,), h + "attn.c_attn.weight": (16, 48), h + "attn.c_attn.bias": (48,),
                   h + "attn.c_proj.weight": (16, 16), h + "attn.c_proj.bias": (16,),
                   h + "mlp.c_fc.weight": (16, 64), h + "mlp.c_fc.bias": (64,),
                   h + "mlp.c_proj.weight": (64, 16), h + "mlp.c_proj.bias": (16,)}
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    for name, prefix, extra in (("hub", "", {"h.0.attn.bias": np.ones((1, 1, 32, 32), np.float32)}),
                                ("v5", "transformer.", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        save_file({prefix + k: v for k, v in tensors.items()} | extra, str(tmp_path / name / "model.safetensors"))
    assert load_hf_config(str(tmp_path / "hub")).position_embedding == "learned"
    _, _, hub = load_hf(str(tmp_path / "hub"))
    _, _, v5 = load_hf(str(tmp_path / "v5"))
    k = np.asarray(hub["layers"]["attn"]["k"]["kernel"])  # [layers, embed, heads, head_dim]
    np.testing.assert_array_equal(k[1], tensors["h.1.attn.c_attn.weight"][:, 16:32].reshape(16, 2, 8))
    for a, b in zip(_leaves(hub), _leaves(v5), strict=True):
        np.testing.assert_array_equal(a, b)


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_partial_rotary_factor_is_read_inside_rope_parameters():
    """transformers 5 may keep it only inside rope_parameters (Phi-3, Phi-4-mini): read it there,
    and never mistake it for a rope scaling."""
    hf = {"model_type": "phi3", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}
    fields = config_from_hf(hf)
    assert fields["partial_rotary_factor"] == 0.75 and fields["rope_scaling"] is None
    top = {k: v for k, v in hf.items() if k != "rope_parameters"} | {"partial_rotary_factor": 0.75}
    assert config_from_hf(top) == fields
