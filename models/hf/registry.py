"""The Hugging Face families shardzoo reads and writes, the config.json <-> config mapping that
dispatches to them, and the families' presets in the zoo. A new family is a module like
``llama.py`` and one line in FAMILIES.

Import reads config.json through the family's ``from_hf`` and the generic check of
``base.HFConfig``. Export refuses, naming the fields, a config that uses a feature the family
does not declare, or whose config.json would not read back to the same architecture (the
family cannot express a value, e.g. Llama's single bias flag for q/k/v and o).
"""

from __future__ import annotations

import dataclasses
import json
import os

from shardzoo.models import apply_overrides, register
from shardzoo.models.arch import arch_of
from shardzoo.models.component import SubRecord
from shardzoo.models.features import FEATURES, used_features
from shardzoo.models.hf import (
    afmoe,
    apertus,
    arcee,
    axk1,
    bailing_hybrid,
    bamba,
    biogpt,
    bitnet,
    bloom,
    codegen,
    cohere,
    cohere2,
    cohere2_moe,
    cwm,
    dbrx,
    deepseek_v2,
    deepseek_v3,
    deepseek_v32,
    diffllama,
    dots1,
    ernie4_5,
    exaone,
    exaone4,
    exaone_moe,
    falcon,
    falcon_h1,
    flex_olmo,
    flint,
    gemma,
    gemma3n,
    gemma4,
    glm,
    glm4_moe,
    glm4_moe_lite,
    glm_moe_dsa,
    gpt2,
    gpt_bigcode,
    gpt_neo,
    gpt_neox,
    gpt_neox_japanese,
    gpt_oss,
    gptj,
    granite,
    granite_swa,
    granitemoe_swa,
    granitemoehybrid,
    granitemoeshared,
    helium,
    hunyuan,
    hy_v3,
    hyperclovax,
    internlm3,
    iquestcoder,
    jais2,
    jamba,
    jetmoe,
    kimi_linear,
    kolibri1,
    lara_mini,
    lfm2,
    lfm2_moe,
    lfm3,
    llama,
    llama4,
    longcat_flash,
    mamba,
    mamba2,
    mellum,
    mimo_v2_flash,
    minicpm3,
    minicpm5_moe,
    minimax_m2,
    ministral,
    ministral3,
    mixtral,
    modernbert_decoder,
    mpt,
    nanochat,
    nemotron,
    nemotron_h,
    olmo,
    olmo2,
    olmo3,
    olmo_hybrid,
    olmoe,
    openai,
    opt,
    param2moe,
    persimmon,
    phi,
    phi3,
    phimoe,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    recurrent_gemma,
    sarvam_mla,
    sarvam_moe,
    seed_oss,
    smollm3,
    solar_open,
    stablelm,
    starcoder2,
    vaultgemma,
    xglm,
    youtu,
    zamba2,
)
from shardzoo.models.hf.base import INERT, ROPE_KEYS, Family, HFConfig, HFError, read_hf_config
from shardzoo.models.transformer import TransformerConfig

# In order of preference: a config two families express exports as the first (llama over mistral).
FAMILIES: tuple[Family, ...] = (
    llama.LLAMA,
    llama.MISTRAL,
    ministral.MINISTRAL,  # Mistral's config with layer_types
    llama.QWEN2,
    qwen3.QWEN3,
    olmo2.OLMO2,
    phi3.PHI3,
    gemma.GEMMA, gemma.GEMMA2, gemma.GEMMA3,
    mixtral.MIXTRAL,
    qwen3_moe.QWEN3_MOE,
    olmoe.OLMOE,
    qwen2_moe.QWEN2_MOE,
    gpt2.GPT2,
    granite.GRANITE, granite.GRANITE_MOE,
    olmo3.OLMO3,
    smollm3.SMOLLM3,
    starcoder2.STARCODER2,
    phi.PHI,
    cohere.COHERE, cohere2.COHERE2,
    stablelm.STABLELM,
    arcee.ARCEE, exaone4.EXAONE4, hunyuan.HUNYUAN_DENSE, seed_oss.SEED_OSS,
    ernie4_5.ERNIE4_5, ernie4_5.ERNIE4_5_MOE,  # before llama4_text, which also expresses a dense model with interleaved rotary
    deepseek_v2.DEEPSEEK_V2, deepseek_v3.DEEPSEEK_V3,
    longcat_flash.LONGCAT_FLASH,  # shortcut MoE layers of two halves, zero-computation experts
    gpt_oss.GPT_OSS,
    llama4.LLAMA4, llama4.LLAMA4_MM,
    glm.GLM, glm.GLM4, glm4_moe.GLM4_MOE,
    apertus.APERTUS,
    lfm2.LFM2,
    mamba2.MAMBA2, bamba.BAMBA, nemotron_h.NEMOTRON_H, falcon_h1.FALCON_H1,
    zamba2.ZAMBA2,  # Mamba2 layers and weight-shared attention + MLP blocks (models/shared_block.py)
    mamba.MAMBA, mamba.FALCON_MAMBA, jamba.JAMBA,  # Mamba1's selective scan (models/mamba1.py)
    qwen3_5.QWEN3_5,  # a dense Gated DeltaNet model: Qwen3.5's (Qwen3-Next's without experts)
    qwen3_next.QWEN3_NEXT,
    olmo_hybrid.OLMO_HYBRID,  # Gated DeltaNet beside OLMo 3's attention, per-layer norm positions
    bailing_hybrid.BAILING_HYBRID,  # KDA (full-rank, bounded gates) beside head-gated latent attention
    kimi_linear.KIMI_LINEAR,
    deepseek_v32.DEEPSEEK_V32, glm_moe_dsa.GLM_MOE_DSA,  # DeepSeek Sparse Attention (models/sparse_attention.py)
    helium.HELIUM, vaultgemma.VAULTGEMMA, granitemoeshared.GRANITEMOESHARED, hunyuan.HUNYUAN_MOE, dots1.DOTS1,
    glm4_moe_lite.GLM4_MOE_LITE, gptj.GPTJ, persimmon.PERSIMMON, exaone.EXAONE,
    solar_open.SOLAR_OPEN, internlm3.INTERNLM3, flex_olmo.FLEX_OLMO,
    sarvam_moe.SARVAM_MOE, granite_swa.GRANITE_SWA,
    nemotron.NEMOTRON, olmo.OLMO, gpt_neox.GPT_NEOX, falcon.FALCON,  # LayerNorm1P, weightless norms, two-norm parallel blocks
    bloom.BLOOM, mpt.MPT,  # ALiBi (models/alibi.py)
    opt.OPT, gpt_neo.GPT_NEO, gpt_bigcode.GPT_BIGCODE, codegen.CODEGEN, xglm.XGLM,
    biogpt.BIOGPT,
    qwen3_5.QWEN3_5_MOE, lfm2_moe.LFM2_MOE, minimax_m2.MINIMAX_M2, exaone_moe.EXAONE_MOE,
    granitemoehybrid.GRANITEMOEHYBRID, cohere2_moe.COHERE2_MOE,
    minicpm3.MINICPM3, iquestcoder.IQUESTCODER, sarvam_mla.SARVAM_MLA, param2moe.PARAM2MOE,
    youtu.YOUTU, cwm.CWM, hyperclovax.HYPERCLOVAX, jais2.JAIS2,
    granitemoe_swa.GRANITEMOE_SWA, afmoe.AFMOE, hy_v3.HY_V3, minicpm5_moe.MINICPM5_MOE,
    dbrx.DBRX, phimoe.PHIMOE,  # SparseMixer's router (models/moe_routing.py)
    axk1.AXK1, flint.FLINT,  # the MoE output's norm, the sigmoid top-k router
    modernbert_decoder.MODERNBERT_DECODER,  # no first pre-norm, the prediction head
    gemma4.GEMMA4,  # Gemma 3's layers, the global ones shaped apart (models/attention.py GlobalAttention)
    gemma3n.GEMMA3N,  # per-layer inputs, KV sharing, AltUp, Laurel, activation sparsity (models/per_layer.py)
    ministral3.MINISTRAL3,  # Llama 4's query temperature on every layer (models/query_scaling.py)
    mellum.MELLUM, apertus.APERTUS1P5_TEXT,
    kolibri1.KOLIBRI1,  # the router's top-k of logits plus a correction bias (router_kind logit_bias)
    lara_mini.LARA_MINI,
    lfm3.LFM3,  # a sigmoid gate per attention head (attn_head_gate), proportional rotary
    nanochat.NANOCHAT,  # weightless norms, a rotary turning the other way (its q/k heads' halves swapped)
    openai.OPENAI_GPT,  # post-LN blocks (block form post_residual)
    gpt_neox_japanese.GPT_NEOX_JAPANESE,  # an output bias on the last layer only (attention_out_bias_layers)
    diffllama.DIFFLLAMA,  # differential attention (models/differential.py)
    bitnet.BITNET,  # sub-norms before o_proj and down_proj (BitLinear's quantization refused)
    recurrent_gemma.RECURRENT_GEMMA,  # RG-LRU recurrent blocks (models/rglru.py) and local attention
    mimo_v2_flash.MIMO_V2_FLASH,  # values apart (ValueHeads), sinks and kv heads per layer kind (GlobalAttention)
    jetmoe.JETMOE,  # a mixture of attention heads (models/moa.py) and MoE MLPs with an output bias
)

BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
BY_NAME = {f.name: f for f in FAMILIES}
SUPPORTED = tuple(BY_MODEL_TYPE)
if len(BY_MODEL_TYPE) != sum(len(f.model_types) for f in FAMILIES) or len(BY_NAME) != len(FAMILIES):
    raise ImportError("models/hf/registry.py: two families claim one model_type or name")


def family_of_model_type(model_type, where: str = "config.json") -> Family:
    """The family that reads config.json's ``model_type``; an HFError naming the supported ones."""
    if model_type not in BY_MODEL_TYPE:
        raise HFError(f"{where}: unsupported model_type {model_type!r}; "
                      f"supported: {', '.join(SUPPORTED)}")
    return BY_MODEL_TYPE[model_type]


def family_named(name: str) -> Family | None:
    """The family a checkpoint recorded by name (None for a name this version does not know)."""
    return BY_NAME.get(name)


# quantized checkpoints import reads: block-wise fp8 (DeepSeek-V3's) and GPT-OSS's mxfp4 dequantized
# (models/hf/tensors.py), bitnet's online quantization (models/hf/bitnet.py checks it)
READ_QUANTIZATIONS = ("fp8", "mxfp4", "bitnet")


def arch_from_hf(family: Family, hf: dict, where: str = "config.json"):
    """The architecture record of ``hf`` (a config.json dict) read by ``family``."""
    q = hf.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") not in READ_QUANTIZATIONS:
        raise HFError(f"{where}: quantization_config quant_method={q.get('quant_method')!r}: shardzoo imports "
                      f"{', '.join(READ_QUANTIZATIONS)} checkpoints (dequantized; bitnet's online quantization as "
                      "it is); use the model's unquantized checkpoint")
    view = HFConfig(hf, family, where)
    fields = family.from_hf(view)
    view.finish()
    arch = arch_of(**fields, score_head=is_reward_model(hf))
    # what the family read uses a feature it does not declare (a value it cannot compute right)
    missing = {name: used for name, used in used_features(arch).items() if name not in family.features}
    if missing:
        name, used = next(iter(missing.items()))
        raise HFError(f"{where}: {', '.join(used)} uses {name} ({FEATURES.get(name, name)}), which shardzoo's "
                      f"{family.name} does not implement")
    return arch


def is_reward_model(hf: dict) -> bool:
    """Whether a config.json is a one-score ``*ForSequenceClassification`` (a reward model)."""
    names = hf.get("architectures") or []
    if not (names and names[0].endswith("ForSequenceClassification")):
        return False
    labels = hf.get("num_labels", len(hf.get("id2label") or {0: 0, 1: 1}))
    if labels != 1:
        raise HFError(f"config.json: {names[0]} with num_labels={labels}; shardzoo reads reward models (num_labels=1)")
    return True


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The architecture fields (a dict) of an HF ``config.json``, by its family's mapping."""
    family = family_of_model_type(hf.get("model_type"), where)
    return dataclasses.asdict(arch_from_hf(family, hf, where))


def obstacles(family: Family, arch) -> list[str]:
    """What of ``arch`` the family cannot express: features it does not declare, then fields
    its config.json would not read back the same."""
    used = used_features(arch)
    missing = [f"{name} ({', '.join(fields)})" for name, fields in used.items() if name not in family.features]
    if missing:
        return [f"feature {m}" for m in missing]
    try:
        back = arch_from_hf(family, _shared_to_hf(family, arch) | family.to_hf(arch))
    except HFError as e:
        return [str(e)]
    return [f"{name}={mine!r} (reads back as {theirs!r})" for name, mine, theirs in _differences(arch, back)]


def _differences(arch, back) -> list[tuple]:
    """(name, value, value read back) of the fields that differ, a sub-record's by their flat names."""
    out = []
    for f in dataclasses.fields(arch):
        mine, theirs = getattr(arch, f.name), getattr(back, f.name)
        if mine != theirs and isinstance(mine, SubRecord) and isinstance(theirs, SubRecord):
            out += [(flat, getattr(mine, name), getattr(theirs, name)) for flat, name in mine.FLAT.items()
                    if getattr(mine, name) != getattr(theirs, name)]
        elif mine != theirs:
            out.append((f.name, mine, theirs))
    return out


def family_of_config(config, name: str | None = None) -> Family:
    """The first family that expresses ``config``'s architecture exactly (or family ``name``,
    e.g. the one a checkpoint recorded: Phi-3's config is also Mistral's); an HFError naming
    what stops the closest ones if none does."""
    arch = getattr(config, "arch", config)
    if not isinstance(arch, TransformerConfig.ARCH):
        raise HFError(f"no Hugging Face family exports a {type(config).__name__}")
    problems = {}
    for family in FAMILIES if name is None else [BY_NAME.get(name)]:
        if family is None:
            raise HFError(f"unknown Hugging Face family {name!r}; known: {', '.join(BY_NAME)}")
        problems[family.name] = obstacles(family, arch)
        if not problems[family.name]:
            return family
    fewest = min(len(p) for p in problems.values())
    closest = "; ".join(f"{n} cannot express {', '.join(p)}" for n, p in problems.items() if len(p) == fewest)
    raise HFError(f"no Hugging Face family expresses this config: {closest}")


def _shared_to_hf(family: Family, a) -> dict:
    eos = list(a.eos_token_id) if isinstance(a.eos_token_id, tuple) else a.eos_token_id
    name = family.architecture
    if getattr(a, "score_head", False):  # a reward model: HF's one-label sequence classifier
        return dict(architectures=[name.replace("ForCausalLM", "ForSequenceClassification")],
                    model_type=family.model_types[0], num_labels=1, id2label={"0": "LABEL_0"},
                    label2id={"LABEL_0": 0}, vocab_size=a.vocab_size, bos_token_id=a.bos_token_id, eos_token_id=eos,
                    tie_word_embeddings=a.tie_word_embeddings, initializer_range=a.initializer_range)
    if "text_config" in family.schema:  # a multimodal config: the family writes them in its text_config
        return dict(architectures=[name], model_type=family.model_types[0])
    init = {"initializer_range": a.initializer_range} if "initializer_range" in family.schema else {}  # OPT: init_std
    return dict(architectures=[name], model_type=family.model_types[0],
                vocab_size=a.vocab_size, bos_token_id=a.bos_token_id, eos_token_id=eos,
                tie_word_embeddings=a.tie_word_embeddings, **init)


# keys of an imported config.json an export never carries over: bookkeeping transformers writes
# afresh, the dtype and architectures the export sets, and what describes files the export does
# not write (quantized weights: they are written dequantized; remote code)
_NOT_CARRIED = {"_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype",
                "quantization_config", "auto_map"}


def _carried(base: dict, written: dict) -> dict:
    """``written`` over the imported ``base``: what the import had and the architecture does not
    say (``pad_token_id: null``, dropouts, ``use_cache``, ...) survives, the import's own value of
    an inert field (``INERT``) over the family's choice; rotary keys come from one side only."""
    out = {k: v for k, v in base.items() if k not in _NOT_CARRIED
           and not (k in ROPE_KEYS and any(r in written for r in ROPE_KEYS))}
    for key, value in written.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in ROPE_KEYS:
            out[key] = _carried(out[key], value)  # a nested config (llama4's text_config)
        elif not (key in INERT and key in base):
            out[key] = value
    return out


def _reads_as(family: Family, hf: dict, arch) -> bool:
    try:
        return arch_from_hf(family, hf) == arch
    except HFError:
        return False


def config_to_hf(config, dtype: str | None = None, family: str | None = None, base: dict | None = None) -> dict:
    """An HF ``config.json`` dict for ``config``, in ``family`` or the first that expresses it.
    With ``base``, the config.json it was imported from: every field of ``base`` kept, in its
    own spelling (``head_dim: null``, no ``n_ctx``, its rotary keys) wherever that reads back as
    the same architecture; what an ``--override`` changed is written as the family writes it."""
    chosen = family_of_config(config, family)
    arch = getattr(config, "arch", config)
    dtype = dtype or getattr(getattr(config, "execution", None), "param_dtype", "float32")
    written = _shared_to_hf(chosen, arch) | {"torch_dtype": dtype} | chosen.to_hf(arch)
    if not base or base.get("model_type") not in chosen.model_types:
        return written
    merged = _carried(base, written)
    if not _reads_as(chosen, merged, arch):  # keep the inert fields only
        return written | {k: base[k] for k in INERT if k in base}
    rope = [k for k in ROPE_KEYS if k in written]
    for keys in [rope] + [[k] for k in written if k not in ROPE_KEYS and k not in _NOT_CARRIED]:
        trial = {k: v for k, v in merged.items() if k not in keys} | {k: base[k] for k in keys + (
            [r for r in ROPE_KEYS if r in base] if keys is rope else []) if k in base}
        if keys and trial != merged and _reads_as(chosen, trial, arch):
            merged = trial  # the import's spelling means the same
    return merged


def write_hf_config(hf_config: dict, out_dir: str) -> None:
    """``config.json`` and ``generation_config.json`` of ``hf_config``, in the key spelling of
    the installed transformers (``rope_parameters``, ``dtype`` in 5.x) when it is installed;
    else as given (keys transformers 4 and 5 both read)."""
    try:
        from transformers import AutoConfig, GenerationConfig, PretrainedConfig
    except ImportError:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=1)
        ids = {k: hf_config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=1)
        return
    # the config.json transformers writes spells infinity {"__float__": "Infinity"}
    config = AutoConfig.for_model(**getattr(PretrainedConfig, "_decode_special_floats", lambda d: d)(hf_config))
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)


def load_hf_config(hf_dir: str, dtype=None, scan_layers: bool = True, overrides=None) -> TransformerConfig:
    """The config of an HF model directory: its family's architecture, and the execution that
    computes as transformers does (the family's ``execution``).

    ``dtype`` ("float32" | "bfloat16") sets both the parameter and the compute dtype (default
    float32); ``overrides`` are further fields of either record (e.g. ``moe_dispatch``).
    """
    where = os.path.join(hf_dir, "config.json")
    hf = read_hf_config(hf_dir)
    family = family_of_model_type(hf.get("model_type"), where)
    execution = dict(family.execution, scan_layers=scan_layers)
    if dtype is not None:
        execution.update(dtype=str(dtype), param_dtype=str(dtype))
    config = TransformerConfig(arch_from_hf(family, hf, where), TransformerConfig.EXECUTION(**execution))
    return apply_overrides(config, dict(overrides or {}), where=hf_dir)


# every family's zoo presets: name -> config
PRESETS = {name: TransformerConfig.from_fields(**fields) for family in FAMILIES
           for name, fields in family.presets.items()}
for _name, _config in PRESETS.items():
    register(_name, _config)


# ------------------------------------------------------------------ the README's list of families
KINDS = ("dense", "MoE", "hybrid", "state-space")
_MIXERS = {"mamba1", "mamba2", "short_conv", "gated_deltanet", "kimi_delta", "rglru"}  # token mixers other than attention


def kind_of(family: Family) -> str:
    """The family's kind, read off its features and presets: "state-space" (no attention layer in
    any preset), "hybrid" (another token mixer beside attention), "MoE", else "dense"."""
    if family.features & _MIXERS:
        specs = [s for fields in family.presets.values()
                 for s in TransformerConfig.from_fields(**fields).arch.layer_specs()]
        return "hybrid" if any("attention" in s.mixer for s in specs) else "state-space"
    return "MoE" if "moe" in family.features else "dense"


def families_markdown() -> str:
    """The README's list of the ``model_type``s shardzoo reads, grouped by kind, and the multimodal
    checkpoints whose text model it reads (``python -m shardzoo.models.hf --markdown``)."""
    from shardzoo.models.hf import multimodal

    groups = {kind: [] for kind in KINDS}
    for family in FAMILIES:
        groups[kind_of(family)] += family.model_types
    lines = [f"- {kind} ({len(types)}): {', '.join(f'`{t}`' for t in sorted(types))}"
             for kind, types in groups.items()]
    texts = sorted(t for t, text in multimodal.TEXT_MODEL.items() if text in BY_MODEL_TYPE)
    lines.append(f"- multimodal checkpoints, their text model ({len(texts)}): "
                 f"{', '.join(f'`{t}` ({multimodal.TEXT_MODEL[t]})' for t in texts)}")
    return f"{len(SUPPORTED)} `model_type`s:\n\n" + "\n".join(lines) + "\n"

