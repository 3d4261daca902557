"""The text model of a multimodal checkpoint (``gemma3``, ``mistral3``, ``qwen3_5``, ``gemma4``,
``gemma3n``):
shardzoo reads its ``text_config`` as the text family's config.json and its ``language_model``
tensors as that family's, leaving the vision tower and projector out (``read_hf_config`` says so
once per directory). An export writes the text-only model; ``write_full`` puts the trained
language model back into a copy of the original multimodal checkpoint.

``llama4`` keeps its own family (llama4.LLAMA4_MM), which already reads the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from shardzoo.models.hf.base import HFError

# model_type of a multimodal config.json -> the model_type its text_config defaults to
TEXT_MODEL = {"gemma3": "gemma3_text", "mistral3": "mistral", "qwen3_5": "qwen3_5_text",
              "qwen3_5_moe": "qwen3_5_moe_text", "gemma4": "gemma4_text",
              "gemma3n": "gemma3n_text"}
# top-level keys of the multimodal config that the text model takes where its text_config lacks them
_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_NOTED: set[str] = set()


def text_part(hf: dict, where: str = "config.json") -> dict:
    """``hf`` itself, or of a multimodal config.json its text model's config.json: ``text_config``
    with the token ids it lacks and the top-level ``tie_word_embeddings`` (the one transformers'
    conditional-generation model ties its head by)."""
    kind = hf.get("model_type")
    if kind not in TEXT_MODEL:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise HFError(f"{where}: a {kind} config.json needs its text_config (a mapping)")
    out = {"model_type": TEXT_MODEL[kind]} | text
    out |= {k: hf[k] for k in _IDS if k not in text and k in hf}
    if "tie_word_embeddings" in hf:
        out["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return out


def note(hf_dir: str, hf: dict) -> None:
    """One line on stderr, once per directory, that a multimodal checkpoint's vision part is left out."""
    kind = hf.get("model_type")
    if kind in TEXT_MODEL and hf_dir not in _NOTED:
        _NOTED.add(hf_dir)
        text = (hf.get("text_config") or {}).get("model_type", TEXT_MODEL[kind])
        print(f"shardzoo: note: {hf_dir} is a multimodal {kind} checkpoint: reading its text model ({text}); "
              f"the vision tower and projector are left out", file=sys.stderr, flush=True)


def stored_names(name: str) -> tuple[str, ...]:
    """Where a text model's tensor ``name`` (``model.layers.0...``, ``lm_head.weight``) lies in a
    multimodal checkpoint: ``language_model.`` before it (the layout transformers saves), or
    ``model.language_model.`` in place of ``model.`` (its in-memory layout)."""
    out = ("language_model." + name,)
    return out + (("model.language_model." + name[len("model."):],) if name.startswith("model.") else ())


def _is_text(name: str) -> bool:
    return name.startswith(("language_model.", "model.language_model."))


def original_config(original: str) -> dict:
    """The config.json of ``original``, a multimodal checkpoint (else an HFError naming --into)."""
    try:
        with open(os.path.join(original, "config.json")) as f:
            full = json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"--into {original}: cannot read its config.json: {e}") from None
    if full.get("model_type") not in TEXT_MODEL:
        raise HFError(f"--into {original}: not a multimodal checkpoint (model_type {full.get('model_type')!r}; "
                      f"--into takes {', '.join(TEXT_MODEL)})")
    return full


def write_full(text_dir: str, original: str, max_shard_bytes: int = 5 * 2**30) -> dict:
    """Rewrite ``text_dir`` (an exported text model) as the multimodal checkpoint ``original``
    with that language model in place: the original's config.json with the exported text config
    as its ``text_config``, its vision and projector tensors, the exported tensors under its
    names, and its other files (processor, generation config) where ``text_dir`` has none.
    Returns the written config.json dict."""
    from safetensors.numpy import save_file

    from shardzoo.models.hf.tensors import INDEX_FILE, SINGLE_FILE, SafetensorsReader

    full = original_config(original)
    with open(os.path.join(text_dir, "config.json")) as f:
        text = json.load(f)
    drop = {"architectures", "transformers_version", "dtype", "torch_dtype"}
    full["text_config"] = {k: v for k, v in text.items() if k not in drop}
    full["tie_word_embeddings"] = text.get("tie_word_embeddings", full.get("tie_word_embeddings"))
    orig, trained = SafetensorsReader(original), SafetensorsReader(text_dir)
    legacy = any(n.startswith("language_model.") for n in orig._where)
    tensors = {n: orig.get(n) for n in orig._where if not _is_text(n) and n != "lm_head.weight"}
    for name in trained._where:
        tensors[stored_names(name)[0 if legacy else -1] if legacy or name.startswith("model.") else name] = \
            trained.get(name)
    for name in os.listdir(text_dir):
        if name.endswith(".safetensors") or name == INDEX_FILE:
            os.remove(os.path.join(text_dir, name))
    shards, current = [], {}
    for name, arr in tensors.items():
        if current and sum(a.nbytes for a in current.values()) + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current = {}
        current[name] = arr
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(text_dir, SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(text_dir, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(a.nbytes for a in tensors.values())
        with open(os.path.join(text_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(text_dir, "config.json"), "w") as f:
        json.dump(full, f, indent=1)
    if os.path.isfile(os.path.join(original, "generation_config.json")):
        shutil.copyfile(os.path.join(original, "generation_config.json"),
                        os.path.join(text_dir, "generation_config.json"))
    for name in os.listdir(original):
        src, dst = os.path.join(original, name), os.path.join(text_dir, name)
        if os.path.isfile(src) and not os.path.exists(dst) and not name.endswith(".safetensors") \
                and name != INDEX_FILE:
            shutil.copyfile(src, dst)
    return full
