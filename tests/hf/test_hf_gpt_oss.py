"""GPT-OSS: attention sinks, q/k/v/o biases, sliding and full layers alternating, YaRN (untruncated),
and a sparse MoE in every layer (a router with a bias, top-k then a softmax over the k, experts
with biases and a clamped SwiGLU, gate and up interleaved in ``gate_up_proj``).

A tiny random HF model (window 4 < the 16 tokens, sinks, biases and router random, 4 experts
top-2): logits equal transformers' on one device, under fsdp_tp and under ep on 8 devices (the
indexed dispatch with a slot for every token: HF drops nothing), greedy tokens equal, export
then ``from_pretrained`` equal. An MXFP4 checkpoint (experts as ``*_blocks``/``*_scales``, random
bytes) imports as transformers dequantizes it. Presets count as transformers' on the meta device.
Tolerance: 1e-4 on float32 logits, as for every family.
"""

import json
import os
import sys

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig

from shardzoo.models import ModelError, get_config
from shardzoo.models.hf import export_hf, load_hf_config
from shardzoo.models.hf.registry import PRESETS
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf

sys.path.insert(0, os.path.dirname(__file__))
from harness import (  # noqa: E402
    TOKENS,
    TOL,
    apply,
    apply_mutable,
    hf_logits,
    load_ep,
    one_device,
    randomized,
    saved,
)

E, K = 4, 2
HF_CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=4, head_dim=8,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=K,
                 sliding_window=4, max_position_embeddings=64, eos_token_id=2, swiglu_limit=1.5,
                 rope_parameters=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                      original_max_position_embeddings=8, rope_theta=1000.0))


def draw(name, p):
    """Every weight random (sinks, biases and the router too), norm scales near 1; the scale
    big enough that the SwiGLU's clamps (limit 1.5) act."""
    return (1 + 0.1 * torch.randn_like(p) if "norm" in name
            else torch.randn_like(p) if "sinks" in name else 0.3 * torch.randn_like(p))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(HF dir, HF model, reference logits)."""
    return saved(randomized(GptOssConfig(**HF_CONFIG), seed=3, draw=draw), tmp_path_factory.mktemp("gpt_oss"))


def test_the_config_reads_as_sinks_alternating_windows_and_biased_experts(built):
    path, model, _ = built
    config = load_hf_config(path)
    assert config.attention_sinks and config.moe.router_bias and config.moe.expert_bias
    assert (config.moe.swiglu_limit, config.moe.swiglu_alpha, config.moe.norm_topk_prob) == (1.5, 1.702, True)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2 and config.sliding_window == 4
    assert dict(config.rope_scaling)["truncate"] is False and config.rope_theta == 1000.0
    assert config.moe_dispatch == "dropless" and config.router_z_loss_coef == 0
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    # the clamps act on this model: some gate or up value is past the limit
    with torch.no_grad():
        x = model.model.embed_tokens(torch.tensor(TOKENS, dtype=torch.long)).reshape(-1, 32)
        experts = model.model.layers[0].mlp.experts
        gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert float(gate_up.abs().max()) > 1.5


def test_logits_match_on_one_device_and_under_fsdp_tp(built):
    path, _, ref = built
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    assert params["layers"]["sub_0"]["attn"]["sinks"].shape == (2, 4)  # [layers, heads]: 2 periods of 2
    assert params["layers"]["sub_0"]["moe"]["wi_gate_bias"].shape == (2, E, 16)
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("fsdp_tp"))
    assert params["layers"]["sub_0"]["attn"]["sinks"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    got = apply(module, params, mesh)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_logits_match_under_ep_on_8_devices_with_the_indexed_dispatch(built):
    path, _, ref = built
    # capacity factor E / K: every expert has a slot for every token, so nothing is dropped
    module, _, params, mesh = load_ep(path, moe_dispatch="indexed", capacity_factor=E / K)
    assert params["layers"]["sub_0"]["moe"]["wo_bias"].addressable_shards[0].data.shape[1] == 1  # split 4 ways
    got, state = apply_mutable(module, params, mesh, ["metrics"])
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert float(np.max(state["metrics"]["layers"]["sub_0"]["moe"]["dropped_fraction"])) == pytest.approx(0)


def test_logits_match_with_the_einsum_dispatches_under_ep(built):
    """The experts' biases reach every dispatch: capacity's einsums, and shard_map's explicit
    all-to-all (built on the same placement and params: the import validates the einsum one)."""
    path, _, ref = built
    module, config, params, mesh = load_ep(path, moe_dispatch="capacity", capacity_factor=E / K)
    got = apply(module, params, mesh)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    explicit = config.replace(moe_dispatch="shard_map").build(module.placement)
    got = apply(explicit, params, mesh, tokens=np.tile(TOKENS, (2, 1)))  # a row for each of 8 devices
    np.testing.assert_allclose(got, np.tile(ref, (2, 1, 1)), atol=TOL, rtol=0)


def test_greedy_generate_matches_transformers(built, parity):
    """Decoding from the cache: sinks, the window (4) shorter than the 24 tokens, YaRN."""
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    path, model, ref = built
    _, _, config, params = parity.load(path)
    hf = export_hf(config, params, str(tmp_path))
    assert (hf["model_type"], hf["num_local_experts"], hf["swiglu_limit"]) == ("gpt_oss", E, 1.5)
    assert hf["layer_types"] == ["sliding_attention", "full_attention"] * 2
    parity.export_matches(str(tmp_path), model, TOKENS, ref, TOL)


def _mxfp4_checkpoint(src: str, out: str, rng) -> dict:
    """``src``'s checkpoint with every expert matrix replaced by random MXFP4 bytes (as published
    checkpoints store them: ``*_blocks`` [E, out, in/32, 16], ``*_scales`` [E, out, in/32])."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    packed = {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        e, fan_in, fan_out = tensors.pop(name).shape
        packed[name] = (rng.integers(0, 256, (e, fan_out, fan_in // 32, 16)).astype(np.uint8),
                        rng.integers(116, 123, (e, fan_out, fan_in // 32)).astype(np.uint8))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = packed[name]
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return packed


def test_an_mxfp4_checkpoint_imports_as_transformers_dequantizes_it(tmp_path):
    """Random MXFP4 experts (hidden 64: two blocks of 32 per row; scales 2**-11 .. 2**-5) import as
    transformers' ``convert_moe_packed_tensors`` dequantizes them (exactly: powers of two times
    FP4 values); the imported model's logits equal those of the HF model holding those weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_config = GptOssConfig(**(HF_CONFIG | dict(hidden_size=64, intermediate_size=32)))
    model = randomized(hf_config, seed=5, draw=draw)
    model.save_pretrained(tmp_path / "float")
    packed = _mxfp4_checkpoint(str(tmp_path / "float"), str(tmp_path / "mxfp4"), np.random.default_rng(1))
    with torch.no_grad():  # the reference: transformers' dequantization in the HF model
        for name, (blocks, scales) in packed.items():
            value = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            model.get_parameter(name).copy_(value)
    _, config, params = load_hf(str(tmp_path / "mxfp4"))
    for i in range(2):
        sub = params["layers"][f"sub_{i}"]["moe"]
        gate_up = model.model.layers[i].mlp.experts.gate_up_proj.detach().numpy()  # [E, in, 2 * out]
        np.testing.assert_array_equal(np.asarray(sub["wi_gate"][0]), gate_up[..., 0::2])
        np.testing.assert_array_equal(np.asarray(sub["wi_up"][0]), gate_up[..., 1::2])
        np.testing.assert_array_equal(np.asarray(sub["wo"][0]), model.model.layers[i].mlp.experts.down_proj.numpy(force=True))
    assert len(np.unique(np.asarray(params["layers"]["sub_0"]["moe"]["wo"]))) > 20  # many FP4 values and scales
    got = apply(config.build(), params, one_device())
    np.testing.assert_allclose(got, hf_logits(model, TOKENS), atol=TOL, rtol=0)


def test_presets_count_as_transformers_on_the_meta_device():
    for name, fields in (("gpt-oss-20b", dict(num_hidden_layers=24, num_local_experts=32)),
                         ("gpt-oss-120b", dict(num_hidden_layers=36, num_local_experts=128))):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(GptOssConfig(**fields))
        assert PRESETS[name].num_params() == sum(p.numel() for p in model.parameters())
    assert PRESETS["gpt-oss-20b"].num_params() == 20_914_757_184
    assert PRESETS["gpt-oss-120b"].num_params() == 116_829_156_672
    tiny = PRESETS["gpt-oss-tiny"]
    assert tiny.attention_sinks and tiny.layer_types == ("sliding_attention", "full_attention") * 2


# https://huggingface.co/openai/gpt-oss-120b/raw/main/config.json (the 20b's: 24 layers, 32 experts)
PUBLISHED_120B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def test_the_published_configs_read_as_the_presets():
    """The published config.json (legacy rope_scaling and rope_theta keys, a quantization_config)
    reads as the preset's architecture, field for field; a config.json without rope keys reads as
    GptOssConfig's default YaRN."""
    from shardzoo.models.hf import family_of_model_type
    from shardzoo.models.hf.registry import arch_from_hf

    family = family_of_model_type("gpt_oss")
    assert arch_from_hf(family, PUBLISHED_120B) == PRESETS["gpt-oss-120b"].arch
    small = PUBLISHED_120B | dict(num_hidden_layers=24, num_local_experts=32,
                                  layer_types=["sliding_attention", "full_attention"] * 12)
    assert arch_from_hf(family, small) == PRESETS["gpt-oss-20b"].arch
    bare = {k: v for k, v in small.items() if k not in ("rope_scaling", "rope_theta", "layer_types")}
    assert arch_from_hf(family, bare) == PRESETS["gpt-oss-20b"].arch


def test_a_config_without_the_swiglu_clamp_is_refused_naming_it():
    from shardzoo.models.hf import HFError, family_of_model_type
    from shardzoo.models.hf.registry import arch_from_hf

    with pytest.raises(HFError, match="swiglu_limit=None"):
        arch_from_hf(family_of_model_type("gpt_oss"), PUBLISHED_120B | {"swiglu_limit": None})


def test_sinks_with_cudnn_attention_are_refused_naming_both():
    with pytest.raises(ModelError, match="attention_sinks.*attention_impl='cudnn'"):
        get_config("gpt-oss-tiny", attention_impl="cudnn")


def test_logits_match_under_context_parallelism(built):
    """Sinks run in plain XLA attention, masked by position: right in the ring's zig-zag token
    order too (the softcap's path), the window and the sinks included."""
    path, _, ref = built
    mesh = make_mesh("context=4,data=2")
    module, _, params = load_hf(path, mesh=mesh, rules=get_rules("cp"))
    got = apply(module, params, mesh)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_train_init_from_the_hf_dir_under_fsdp_then_export_loads_in_transformers(tmp_path, parity):
    """``shardzoo train --init-from`` a tiny GPT-OSS under fsdp on 8 devices, every weight trained
    (sinks and experts): the loss falls; the export loads in transformers and computes what the run
    computes (1e-4). LoRA on its attention is plain attention's, test_lora_peft's on a Llama."""
    model = randomized(GptOssConfig(**HF_CONFIG), seed=7, draw=draw)
    config = parity.trains_from_hf_dir(tmp_path, model, TOKENS[:2], False, TOL)
    assert config.attention_sinks
