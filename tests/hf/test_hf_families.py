"""One module per Hugging Face family: the registry, config.json round trips of tiny random
models of every family, an unsupported family on every entry point, and checkpoints that
record the family and the whole config (not a zoo preset)."""

import dataclasses
import importlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import (
    ApertusConfig,
    ArceeConfig,
    AutoConfig,
    AutoModelForCausalLM,
    BambaConfig,
    BioGptConfig,
    BloomConfig,
    CodeGenConfig,
    Cohere2Config,
    CohereConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    DeepseekV32Config,
    Dots1Config,
    Ernie4_5_MoeConfig,
    Ernie4_5Config,
    Exaone4Config,
    ExaoneConfig,
    FalconConfig,
    FalconH1Config,
    FalconMambaConfig,
    FlexOlmoConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    Glm4Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GlmConfig,
    GlmMoeDsaConfig,
    GPT2Config,
    GPTBigCodeConfig,
    GPTJConfig,
    GPTNeoConfig,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    GraniteMoeSharedConfig,
    GraniteSWAConfig,
    HeliumConfig,
    HunYuanDenseV1Config,
    HunYuanMoEV1Config,
    InternLM3Config,
    JambaConfig,
    KimiLinearConfig,
    Lfm2Config,
    Llama4Config,
    Llama4TextConfig,
    LlamaConfig,
    Mamba2Config,
    MambaConfig,
    MinistralConfig,
    MistralConfig,
    MixtralConfig,
    MptConfig,
    NemotronConfig,
    NemotronHConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoConfig,
    OlmoeConfig,
    OPTConfig,
    PersimmonConfig,
    Phi3Config,
    PhiConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    RwkvConfig,
    SarvamMoEConfig,
    SeedOssConfig,
    SmolLM3Config,
    SolarOpenConfig,
    StableLmConfig,
    Starcoder2Config,
    VaultGemmaConfig,
    XGLMConfig,
)

from shardzoo import cli
from shardzoo.models import get_config
from shardzoo.models.hf import (
    FAMILIES,
    SUPPORTED,
    Family,
    config_from_hf,
    config_to_hf,
    family_of_config,
    load_hf_config,
    write_hf_config,
)
from shardzoo.models.hf.registry import PRESETS
from shardzoo.models.transformer import TransformerConfig
from shardzoo.train.io.checkpoint import CheckpointError, read_meta
from shardzoo.train.io.hf_io import load_hf
from shardzoo.train.io.runmeta import config_from_meta, config_to_dict
from shardzoo.train.io.sources import resolve_checkpoint

FAMILY_MODULES = ("llama", "mixtral", "gpt2", "qwen3", "olmo2", "phi3", "qwen3_moe", "gemma", "granite",
                  "olmoe", "qwen2_moe", "olmo3", "smollm3", "ministral", "starcoder2", "phi",
                  "cohere", "arcee", "exaone4", "hunyuan", "seed_oss", "deepseek_v2",
                  "deepseek_v3", "gpt_oss", "llama4", "glm", "glm4_moe", "cohere2",
                  "stablelm", "ernie4_5", "apertus", "lfm2", "mamba2", "bamba",
                  "nemotron_h", "qwen3_next", "falcon_h1", "deepseek_v32", "glm_moe_dsa", "kimi_linear", "helium", "vaultgemma",
                  "granitemoeshared", "dots1", "glm4_moe_lite", "gptj", "persimmon", "exaone",
                  "solar_open", "internlm3", "flex_olmo", "sarvam_moe",
                  "granite_swa", "bloom", "mpt", "opt", "gpt_neo", "gpt_bigcode", "codegen", "xglm",
                  "biogpt", "mamba", "jamba", "nemotron", "olmo", "gpt_neox", "falcon",
                  "qwen3_5", "lfm2_moe", "minimax_m2", "exaone_moe", "granitemoehybrid", "cohere2_moe", "minicpm3", "iquestcoder", "sarvam_mla", "param2moe", "youtu", "cwm", "hyperclovax", "jais2", "granitemoe_swa", "afmoe", "hy_v3", "minicpm5_moe",
                  "dbrx", "phimoe", "axk1", "flint", "modernbert_decoder", "gemma4", "gemma3n",
                  "ministral3", "mellum", "nanochat", "kolibri1", "lara_mini", "lfm3",
                  "openai", "gpt_neox_japanese", "diffllama", "bitnet", "recurrent_gemma",
                  "olmo_hybrid", "bailing_hybrid", "mimo_v2_flash", "zamba2",
                  "longcat_flash", "jetmoe")  # apertus1p5_text: apertus.py; models/hf/<name>.py
DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
MLA = dict(DIMS, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           first_k_dense_replace=1)  # latent attention, a dense layer then MoE ones
LLAMA4_TEXT = dict(DIMS, num_hidden_layers=4, intermediate_size=16, intermediate_size_mlp=48, head_dim=8,
                   num_local_experts=4, interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=4,
                   max_position_embeddings=64)  # every 4th layer NoPE (transformers' default), MoE on 1 and 3
LLAMA4_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                     patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=32)
TINY = {  # model_type -> a tiny HF config of that family, with its distinguishing options set
    "llama": lambda: LlamaConfig(**DIMS, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                                 attention_bias=True),
    "mistral": lambda: MistralConfig(**DIMS, sliding_window=4),
    "qwen2": lambda: Qwen2Config(**DIMS, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**DIMS, head_dim=16, use_sliding_window=True, sliding_window=4,
                                 max_window_layers=0),
    "olmo2": lambda: Olmo2Config(**DIMS, attention_bias=True),
    "phi3": lambda: Phi3Config(**DIMS, sliding_window=4, pad_token_id=2, bos_token_id=1,
                               eos_token_id=2),
    "mixtral": lambda: MixtralConfig(**DIMS, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(**DIMS, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=16, norm_topk_prob=True),
    "olmoe": lambda: OlmoeConfig(**DIMS, num_experts=4, num_experts_per_tok=2, attention_bias=True,
                                 norm_topk_prob=True, eos_token_id=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(**(DIMS | dict(num_hidden_layers=3)), num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                        mlp_only_layers=[0], use_sliding_window=True, sliding_window=4,
                                        max_window_layers=1),
    "gpt2": lambda: GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                               bos_token_id=1, eos_token_id=2),
    "gemma": lambda: GemmaConfig(**DIMS, head_dim=16),
    "gemma2": lambda: Gemma2Config(**DIMS, sliding_window=4, attn_logit_softcapping=20.0),
    "granite": lambda: GraniteConfig(**DIMS, embedding_multiplier=4.0, residual_multiplier=0.5,
                                     attention_multiplier=0.3, logits_scaling=2.5),
    "granitemoe": lambda: GraniteMoeConfig(**DIMS, num_local_experts=4, embedding_multiplier=2.0,
                                           logits_scaling=3.0),
    "gemma3_text": lambda: Gemma3TextConfig(**(DIMS | dict(num_hidden_layers=8)), sliding_window=4,
                                            rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "olmo3": lambda: Olmo3Config(**(DIMS | dict(num_hidden_layers=4)), sliding_window=4,
                                 rope_scaling={"rope_type": "linear", "factor": 2.0}),  # 3 sliding : 1 full
    "smollm3": lambda: SmolLM3Config(**DIMS, no_rope_layer_interval=2, pad_token_id=None, bos_token_id=None,
                                     eos_token_id=None),  # layer 1 NoPE
    "ministral": lambda: MinistralConfig(**DIMS, head_dim=8, sliding_window=4, layer_types=["sliding_attention",
                                                                                          "full_attention"]),
    "starcoder2": lambda: Starcoder2Config(**DIMS, sliding_window=4, bos_token_id=1, eos_token_id=2),
    "phi": lambda: PhiConfig(**DIMS, qk_layernorm=True, partial_rotary_factor=0.5),
    "cohere": lambda: CohereConfig(**DIMS, use_qk_norm=True, attention_bias=True, logit_scale=0.3),
    "cohere2": lambda: Cohere2Config(**(DIMS | dict(num_hidden_layers=4)), sliding_window=4, sliding_window_pattern=2,
                                     attention_bias=True, logit_scale=0.3),  # sliding rotary : full NoPE
    "stablelm": lambda: StableLmConfig(**DIMS, use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True,
                                       partial_rotary_factor=0.5),
    "arcee": lambda: ArceeConfig(**DIMS, attention_bias=True),
    "exaone4": lambda: Exaone4Config(**(DIMS | dict(num_hidden_layers=4)), sliding_window=4,
                                     sliding_window_pattern=2),
    "hunyuan_v1_dense": lambda: HunYuanDenseV1Config(**DIMS, head_dim=8, attention_bias=True),
    "seed_oss": lambda: SeedOssConfig(**DIMS, head_dim=16, mlp_bias=True),
    "deepseek_v2": lambda: DeepseekV2Config(**MLA, q_lora_rank=None, n_shared_experts=2,
                                            topk_method="group_limited_greedy", n_group=2, topk_group=1),
    "deepseek_v3": lambda: DeepseekV3Config(**MLA, q_lora_rank=24, n_group=2, topk_group=1, rope_interleave=False),
    # DeepSeek-V3 with the lightning indexer keeping 4 keys; GLM-5's, its rotary on interleaved pairs
    "deepseek_v32": lambda: DeepseekV32Config(**MLA, q_lora_rank=24, n_group=2, topk_group=1, index_topk=4,
                                              index_n_heads=4, index_head_dim=16),
    "glm_moe_dsa": lambda: GlmMoeDsaConfig(**MLA, q_lora_rank=24, index_topk=4, index_n_heads=4, index_head_dim=16),
    "gpt_oss": lambda: GptOssConfig(**(DIMS | dict(intermediate_size=16)), head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=4, swiglu_limit=3.0),  # sinks, YaRN
    "llama4_text": lambda: Llama4TextConfig(**LLAMA4_TEXT),
    # AutoModelForCausalLM builds (and saves) its text model: the llama4_text config, written back as llama4
    "llama4": lambda: Llama4Config(text_config=LLAMA4_TEXT, vision_config=LLAMA4_VISION),
    # GLM's pad id defaults to 151329: the first eos id here, as export writes it
    "glm": lambda: GlmConfig(**DIMS, head_dim=16, pad_token_id=2, eos_token_id=2),  # half of each head rotates
    "glm4": lambda: Glm4Config(**DIMS, head_dim=16, partial_rotary_factor=0.25, pad_token_id=2, eos_token_id=[2, 3]),
    "glm4_moe": lambda: Glm4MoeConfig(**(DIMS | dict(num_hidden_layers=3)), n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, n_group=2, topk_group=1, routed_scaling_factor=1.5,
                                      use_qk_norm=True, attention_bias=True),  # a dense layer, then MoE ones
    "ernie4_5": lambda: Ernie4_5Config(**DIMS, head_dim=16, use_bias=True),  # head_dim: 128 if absent
    "ernie4_5_moe": lambda: Ernie4_5_MoeConfig(**(DIMS | dict(num_hidden_layers=3)), use_bias=True, moe_k=2,
                                               moe_num_experts=4, moe_intermediate_size=16, moe_num_shared_experts=1),
    "apertus": lambda: ApertusConfig(**DIMS, attention_bias=True),  # xIELU, qk-norm, llama3 rotary
    "lfm2": lambda: Lfm2Config(**(DIMS | dict(num_hidden_layers=3)), layer_types=["conv", "full_attention", "conv"],
                               block_auto_adjust_ff_dim=False),  # conv layers beside attention
    "mamba2": lambda: Mamba2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                                   n_groups=2, state_size=8, chunk_size=4),  # mamba layers, no MLP
    "mamba": lambda: MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8,
                                 time_step_rank=4),  # mamba1 layers, no MLP
    "falcon_mamba": lambda: FalconMambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8,
                                              time_step_rank=4),  # and the norms of dt, B, C
    "jamba": lambda: JambaConfig(**(DIMS | dict(num_hidden_layers=4)), num_experts=4, attn_layer_period=4,
                                 attn_layer_offset=2, mamba_d_state=8, mamba_dt_rank=4),  # mamba1, attention, MoE
    "bamba": lambda: BambaConfig(**(DIMS | dict(num_hidden_layers=3)), attn_layer_indices=[1], mamba_n_heads=8,
                                 mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4),
    "nemotron_h": lambda: NemotronHConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=8, layers_block_type=[
                                              "linear_attention", "mlp", "full_attention", "mlp"],
                                          mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
                                          chunk_size=4),  # mamba, attention and MLP layers
    # attention and a mamba mixer side by side in every layer, muP multipliers, no gated norm
    "falcon_h1": lambda: FalconH1Config(**DIMS, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
                                        mamba_d_state=8, mamba_chunk_size=4, key_multiplier=0.5,
                                        ssm_multipliers=[0.5, 1.0, 2.0, 1.0, 0.25], mlp_multipliers=[1.5, 0.5]),
    # Gated DeltaNet layers beside output-gated attention, a dense layer then MoE with a shared expert
    "kimi_linear": lambda: KimiLinearConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
        first_k_dense_replace=1, num_expert_group=2, topk_group=1, pad_token_id=None, bos_token_id=1, eos_token_id=2,
        linear_attn_config=dict(num_heads=2, head_dim=8, short_conv_kernel_size=4, kda_layers=[1, 2, 4],
                                full_attn_layers=[3])),
    "qwen3_next": lambda: Qwen3NextConfig(**(DIMS | dict(num_hidden_layers=3)), head_dim=16,
                                          layer_types=["linear_attention", "linear_attention", "full_attention"],
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                          linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                          mlp_only_layers=[0]),
    "helium": lambda: HeliumConfig(**DIMS, head_dim=8, attention_bias=True, mlp_bias=True),
    "vaultgemma": lambda: VaultGemmaConfig(**DIMS, head_dim=8, query_pre_attn_scalar=8, sliding_window=4),
    "granitemoeshared": lambda: GraniteMoeSharedConfig(**DIMS, num_local_experts=4, shared_intermediate_size=16,
                                                       embedding_multiplier=2.0),
    "hunyuan_v1_moe": lambda: HunYuanMoEV1Config(**DIMS, head_dim=8, num_experts=4, moe_topk=2),
    "dots1": lambda: Dots1Config(**(DIMS | dict(num_hidden_layers=3)), n_routed_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                                 sliding_window=4, max_window_layers=1),
    "glm4_moe_lite": lambda: Glm4MoeLiteConfig(**{k: v for k, v in MLA.items() if k != "first_k_dense_replace"},
                                               q_lora_rank=24,
                                               mlp_layer_types=["dense", "sparse", "sparse"]),
    "gptj": lambda: GPTJConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, rotary_dim=4),
    "persimmon": lambda: PersimmonConfig(**{k: v for k, v in DIMS.items() if k != "num_key_value_heads"}),
    "exaone": lambda: ExaoneConfig(**DIMS, attention_bias=True, eos_token_id=2, pad_token_id=0),
    "solar_open": lambda: SolarOpenConfig(**{k: v for k, v in DIMS.items() if k != "intermediate_size"}, head_dim=8,
                                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "internlm3": lambda: InternLM3Config(**DIMS, head_dim=8),
    "flex_olmo": lambda: FlexOlmoConfig(**DIMS, num_experts=4, num_experts_per_tok=2, pad_token_id=None),
    "sarvam_moe": lambda: SarvamMoEConfig(**(DIMS | dict(num_hidden_layers=3)), head_dim=8, n_routed_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=16,
                                          pad_token_id=1),  # GLM's export writes the eos id as pad
    "granite_swa": lambda: GraniteSWAConfig(**(DIMS | dict(num_hidden_layers=3)), sliding_window=4,
                                            layer_rope_theta=[10000.0, 0, 10000.0], bos_token_id=1, eos_token_id=2),
    "bloom": lambda: BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4),
    "mpt": lambda: MptConfig(vocab_size=128, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                             attn_config=dict(clip_qkv=6.0)),
    "opt": lambda: OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                             max_position_embeddings=64),
    "gpt_neo": lambda: GPTNeoConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                                    attention_types=[[["global", "local"], 1]], max_position_embeddings=64),
    "gpt_bigcode": lambda: GPTBigCodeConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "codegen": lambda: CodeGenConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64),
    "xglm": lambda: XGLMConfig(vocab_size=128, d_model=32, ffn_dim=64, num_layers=2, attention_heads=4,
                               max_position_embeddings=64),
    "biogpt": lambda: BioGptConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=64),
    "nemotron": lambda: NemotronConfig(**DIMS, partial_rotary_factor=0.5),
    "olmo": lambda: OlmoConfig(**DIMS, clip_qkv=8.0),
    "gpt_neox": lambda: GPTNeoXConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4),
    "falcon": lambda: FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_kv_heads=1),  # multi-query, as Falcon-7B writes it
}
# the families that only combine existing components, with their tiny configs (tests/hf/test_hf_combined_families2.py)
sys.path.insert(0, os.path.dirname(__file__))
from test_hf_combined_families2 import CONFIGS as COMBINED  # noqa: E402

TINY.update({t: config for t, config in COMBINED.items() if t in SUPPORTED})
from test_hf_famC import CONFIGS as FAM_C  # noqa: E402

TINY.update({t: config for t, config in FAM_C.items() if t in SUPPORTED})
from test_hf_famH import CONFIGS as FAMH  # noqa: E402

TINY.update(FAMH)
from test_hf_famE import CONFIGS as FAME  # noqa: E402

TINY.update({t: config for t, config in FAME.items() if t in SUPPORTED})
from test_hf_famF import CONFIGS as FAMF  # noqa: E402

TINY.update({t: config for t, config in FAMF.items() if t in SUPPORTED})
from test_hf_famG import CONFIGS as FAMG  # noqa: E402

TINY.update({t: config for t, config in FAMG.items() if t in SUPPORTED})
from test_hf_famD import CONFIGS as FAM_D  # noqa: E402

TINY.update({t: config for t, config in FAM_D.items() if t in SUPPORTED})
from test_hf_mimo import CONFIGS as MIMO  # noqa: E402

TINY.update(MIMO)
from test_hf_zamba import CONFIGS as ZAMBA  # noqa: E402

TINY.update({t: config for t, config in ZAMBA.items() if t in SUPPORTED})
from test_hf_longcat import CONFIGS as LONGCAT  # noqa: E402

TINY.update(LONGCAT)
from test_hf_jetmoe import CONFIGS as JETMOE  # noqa: E402

TINY.update(JETMOE)
from test_hf_gemma3n import CONFIGS as GEMMA3N  # noqa: E402

TINY.update(GEMMA3N)
# Keys transformers fills in that say nothing about the model (or, for max_window_layers, not
# while use_sliding_window is false; n_ctx is GPT-2's unused alias of n_positions).
BOOKKEEPING = {"_name_or_path", "architectures", "dtype", "transformers_version", "n_ctx"}


def save_tiny(hf_config, path) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(path)
    return str(path)


def test_each_model_type_is_read_by_exactly_one_family_module():
    """A family is one ``Family`` value declared in one module (its mapping functions may be
    shared helpers of other family modules, e.g. Llama's weight map), and every one is registered."""
    assert set(SUPPORTED) == set(TINY)
    family_modules = {f"shardzoo.models.hf.{m}" for m in FAMILY_MODULES}
    homes = {}
    for m in family_modules:
        for v in vars(importlib.import_module(m)).values():
            if isinstance(v, Family):
                homes.setdefault(id(v), set()).add(m)
    for model_type in SUPPORTED:
        owners = [f for f in FAMILIES if model_type in f.model_types]
        assert len(owners) == 1, model_type
        family = owners[0]
        assert len(homes[id(family)]) == 1, (model_type, homes[id(family)])  # declared in one place
        for fn in (family.from_hf, family.to_hf, family.global_weights, family.layer_weights):
            assert fn.__module__ in family_modules, (model_type, fn)
    assert len(homes) == len(FAMILIES)  # all registered


@pytest.mark.parametrize("model_type", list(TINY))
def test_config_json_round_trips_through_the_family(model_type, tmp_path):
    hf_dir = save_tiny(TINY[model_type](), tmp_path / "hf")
    config = load_hf_config(hf_dir)
    # Exports as the family it came from, but Phi-3 (Mistral's config with fused tensors) as
    # Mistral unless the family is named (as a checkpoint records it); GLM-4.7-Flash with a dense
    # prefix and Sarvam-MLA as DeepSeek-V3, EXAONE 3, InternLM3 and IQuest-Coder as Llama, Solar Open
    # (no dense layer, full rotary), Sarvam-MoE and Param2-MoE as GLM-4.5, Qwen3.5-MoE as Qwen3-Next,
    # CWM as Ministral, Jais 2 as StarCoder2, Hunyuan V3 as dots1, Apertus 1.5 as Apertus: the same architecture under
    # another model_type, the earlier family in the registry's order of preference.
    assert family_of_config(config).name == {
        "phi3": "mistral", "llama4": "llama4_text", "glm4_moe_lite": "deepseek_v3", "exaone": "llama",
        "solar_open": "glm4_moe", "internlm3": "llama", "sarvam_moe": "glm4_moe", "codegen": "gptj",
        "iquestcoder": "llama", "sarvam_mla": "deepseek_v3", "param2moe": "glm4_moe",
        "qwen3_5_moe_text": "qwen3_next", "cwm": "ministral", "jais2": "starcoder2",
        "hy_v3": "dots1", "apertus1p5_text": "apertus"}.get(model_type, model_type)
    written = json.loads(json.dumps(config_to_hf(config, family=model_type)))
    assert written["model_type"] == model_type
    assert TransformerConfig.from_fields(**config_from_hf(written)).arch == config.arch

    # transformers reads the written config.json as the original, key by key.
    want = AutoConfig.from_pretrained(hf_dir).to_dict()
    got = AutoConfig.for_model(**written).to_dict()
    if "text_config" in written:  # a multimodal config (llama4): its text part is the model
        got = got["text_config"]
    derived = {"head_dim": want.get("hidden_size", 0) // want.get("num_attention_heads", 1),
               "n_inner": 4 * want.get("n_embd", 0)}  # what None means
    ignore = BOOKKEEPING | ({"max_window_layers"} if want.get("use_sliding_window") is False else set())
    for key in sorted((set(want) | set(got)) - ignore):
        expected = derived[key] if want.get(key) is None and key in derived else want.get(key)
        assert got.get(key) == expected, key


@pytest.mark.parametrize("edit, field", [
    # a rotary scaling the family does not compute (Gemma 4's proportional, which only LFM3 reads)
    (lambda hf: hf.pop("rope_parameters", None) and None or hf.update(
        rope_scaling={"rope_type": "proportional", "factor": 2.0}), "rope_scaling"),
    # a schema field shardzoo's family does not read, set away from transformers' default
    (lambda hf: hf.update(model_type="gemma2", use_bidirectional_attention=True), "use_bidirectional_attention"),
])
def test_a_config_field_that_changes_the_math_and_is_not_implemented_is_refused(
        edit, field, tmp_path, capsys, snapshot):
    """import-hf and train --init-from: exit 2, one line naming the field, nothing written."""
    hf_config = Gemma2Config(**DIMS, sliding_window=4) if "bidirectional" in field else LlamaConfig(**DIMS)
    hf_dir = save_tiny(hf_config, tmp_path / "hf")
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    edit(hf)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf, f)
    before = snapshot(hf_dir)
    for argv in (["import-hf", hf_dir, str(tmp_path / "imported")],
                 ["train", "--init-from", hf_dir, "--out", str(tmp_path / "run")]):
        capsys.readouterr()
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and field in err, err
    assert not os.path.exists(tmp_path / "imported") and not os.path.exists(tmp_path / "run")
    assert snapshot(hf_dir) == before


def test_a_field_transformers_ignores_for_the_family_is_no_reason_to_refuse(tmp_path):
    """Unknown keys, and keys the family's config class holds but its model never reads
    (Llama's pretraining_tp, which transformers 5 ignores; dropout, which shardzoo does not
    apply), import as the same model."""
    hf_dir = save_tiny(LlamaConfig(**DIMS), tmp_path / "hf")
    want = load_hf_config(hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    hf.update(pretraining_tp=2, attention_dropout=0.1, some_future_field={"x": 1})
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf, f)
    assert load_hf_config(hf_dir) == want


def test_an_unsupported_family_is_one_line_exit_2_from_import_and_train(tmp_path, capsys):
    rwkv = RwkvConfig(vocab_size=320, hidden_size=32, attention_hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2)  # RWKV: a recurrence shardzoo has no mixer for
    hf_dir = save_tiny(rwkv, tmp_path / "rwkv")
    capsys.readouterr()
    errors = []
    for argv in (["import-hf", hf_dir, str(tmp_path / "imported")],
                 ["train", "--init-from", hf_dir, "--out", str(tmp_path / "run")]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "unsupported model_type 'rwkv'; supported: " + ", ".join(SUPPORTED) in err
        errors.append(err.split(": error: ", 1)[1])
    assert errors[0] == errors[1]
    assert not os.path.exists(tmp_path / "run") and not os.path.exists(tmp_path / "imported")


def test_import_records_family_and_whole_config_and_init_from_restores_it(tmp_path):
    hf_config = LlamaConfig(**(DIMS | dict(vocab_size=320)), rope_theta=500000.0,
                            rope_scaling=LLAMA3_ROPE)  # vocab above the byte tokenizer's 259
    hf_dir = save_tiny(hf_config, tmp_path / "llama32")
    want = load_hf_config(hf_dir)
    assert want.rope_scaling_dict["rope_type"] == "llama3"
    imported, run = str(tmp_path / "imported"), str(tmp_path / "run")

    assert cli.main(["import-hf", hf_dir, imported]) == 0
    meta = read_meta(*resolve_checkpoint(imported))
    assert meta["family"] == "llama" and meta["model"] is None  # no zoo preset claimed
    assert meta["config"] == config_to_dict(want)
    assert set(meta["config"]) == {"arch", "execution"}
    assert set(meta["config"]["arch"]) == {f.name for f in dataclasses.fields(TransformerConfig.ARCH)}
    assert set(meta["config"]["execution"]) == {f.name for f in dataclasses.fields(TransformerConfig.EXECUTION)}
    assert config_from_meta(meta) == want.resolved()  # the scan layout written out

    assert cli.main(["train", "--init-from", imported, "--out", run, "--steps", "1",
                     "--batch-size", "8", "--seq-len", "16", "--save-every", "0",
                     "--eval-every", "0", "--eval-fraction", "0"]) == 0
    trained = read_meta(*resolve_checkpoint(run))
    assert trained["family"] == "llama" and trained["model"] is None
    assert config_from_meta(trained) == want.resolved()
    with open(os.path.join(run, "run.json")) as f:
        assert json.load(f)["config"] == config_to_dict(want)


def test_old_meta_preset_plus_config_still_loads_and_unknown_family_is_refused():
    config = get_config("llama3.2-1b").replace(num_hidden_layers=2)
    old = {"model": "llama2-7b", "config": json.loads(json.dumps(config_to_dict(config)))}
    assert config_from_meta(old) == config.resolved()
    flat = {**old["config"]["arch"], **old["config"]["execution"]}  # before the records split
    assert config_from_meta({"model": "llama2-7b", "config": flat}) == config.resolved()
    with pytest.raises(CheckpointError, match="family 'rwkv'"):
        config_from_meta({"family": "rwkv", "config": old["config"]})
    with pytest.raises(CheckpointError, match="unknown field"):
        config_from_meta({"family": "llama", "config": {**flat, "rope_kind": 1}})


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_has_the_parameter_count_of_its_transformers_model(name):
    config = PRESETS[name]
    family = "phi3" if name.startswith(("phi3", "phi-3")) else None  # else Mistral's, whose config it is
    hf_config = AutoConfig.for_model(**config_to_hf(config, family=family))
    with torch.device("meta"):  # shapes only, no weights
        model = AutoModelForCausalLM.from_config(hf_config)
    assert type(model).__name__ == config_to_hf(config, family=family)["architectures"][0]
    # tied counted once; AFMoE keeps its router's correction bias (no gradient) as a parameter where
    # DeepSeek-V3 and the families after it keep a buffer, which shardzoo does not count
    bias = "mlp.expert_bias" if type(model).__name__ == "AfmoeForCausalLM" else None
    assert config.num_params() == sum(p.numel() for n, p in model.named_parameters() if not bias or bias not in n)


def test_phi3_longrope_imports_and_computes_as_transformers(tmp_path):
    """The 128k models' layout: longrope's factor lists, original_max_position_embeddings at the
    top; 16 tokens past the original 8 (long factors). More: tests/hf/test_hf_rope_scaling.py."""
    hf_config = Phi3Config(**DIMS, pad_token_id=0, max_position_embeddings=64, original_max_position_embeddings=8,
                           rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0],
                                         "long_factor": [2.0, 3.0, 5.0, 9.0]})
    hf_dir = save_tiny(hf_config, tmp_path / "phi3")
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokens = np.random.default_rng(0).integers(0, DIMS["vocab_size"], size=(2, 16))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    module, config, params = load_hf(hf_dir)
    assert config.arch.rope_scaling_dict["original_max_position_embeddings"] == 8
    got = np.asarray(jax.jit(lambda p, t: module.apply({"params": p}, t))(params, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_phi3_import_then_export_hf_writes_phi3_again(tmp_path):
    """The checkpoint's recorded family decides the export: Phi-3's fused tensors come back."""
    hf_dir = save_tiny(TINY["phi3"](), tmp_path / "phi3")
    imported, exported = str(tmp_path / "imported"), str(tmp_path / "exported")
    assert cli.main(["import-hf", hf_dir, imported]) == 0
    assert read_meta(*resolve_checkpoint(imported))["family"] == "phi3"
    assert cli.main(["export-hf", imported, exported]) == 0
    with open(os.path.join(exported, "config.json")) as f:
        assert json.load(f)["model_type"] == "phi3"
    from safetensors import safe_open

    with safe_open(os.path.join(exported, "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any("q_proj" in n for n in names)


FILLED = {"architectures", "dtype", "transformers_version"}  # a model's save adds them to its config's


def exported_config(hf_config, tmp_path, model_type) -> tuple[dict, dict]:
    """(config.json as transformers saved ``hf_config``, config.json of its import exported):
    configs only, no weights."""
    src, out = tmp_path / "hf", tmp_path / "out"
    hf_config.save_pretrained(src)
    imported = json.loads((src / "config.json").read_text())
    out.mkdir()
    write_hf_config(config_to_hf(load_hf_config(str(src)), family=model_type, base=imported), str(out))
    return imported, json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("model_type", list(TINY))
def test_export_writes_back_every_config_json_field_of_the_import(model_type, tmp_path):
    """Key by key in the installed transformers' spelling, but the keys a model's save fills in;
    with a generation_config.json naming the same special tokens."""
    imported, exported = exported_config(TINY[model_type](), tmp_path, model_type)
    assert set(exported) - set(imported) <= FILLED
    for key in sorted(set(imported) - FILLED):
        assert exported.get(key, "missing") == imported[key], key
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    text = imported.get("text_config", imported)
    for key in ("bos_token_id", "eos_token_id"):
        assert generation.get(key) == text.get(key), key


def test_an_import_without_pad_token_exports_none_and_transformers_builds_it(tmp_path):
    """GLM-4's pad id defaults to 151329: an import that says null must not export it into a
    vocabulary of 128 (transformers then refuses: padding_idx must be within num_embeddings)."""
    imported, exported = exported_config(Glm4Config(**DIMS, head_dim=16, pad_token_id=None), tmp_path, "glm4")
    assert imported["pad_token_id"] is None and exported["pad_token_id"] is None
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "out"))  # builds
