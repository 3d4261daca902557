"""Hugging Face model dirs <-> shardzoo runs: ``import-hf``, ``export-hf``, ``generate``'s loader.

An imported model is a run directory like a trained one (``OUT/checkpoints/0`` with the params
under ``state``, ``OUT/tokenizer/``, ``OUT/run.json``), so ``train --init-from``,
``generate --checkpoint`` and ``export-hf`` read it as they read any run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from shardzoo.errors import UserError
from shardzoo.models import hf
from shardzoo.models.decode import generate
from shardzoo.sharding.mesh import describe_mesh, make_mesh
from shardzoo.sharding.partition import activate
from shardzoo.sharding.rules import get_rules
from shardzoo.train.checkpoint import (
    CHECKPOINTS,
    Checkpointer,
    config_to_dict,
    latest_step,
    load_model_and_params,
)
from shardzoo.train.program import Program

# Files of an HF tokenizer, carried between HF dirs and runs' tokenizer/ dirs.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja")


def copy_tokenizer_files(src: str, dst: str) -> bool:
    """Copy the HF tokenizer files of ``src`` into ``dst``; whether ``src`` had a tokenizer.json."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    if "tokenizer.json" not in names:
        return False
    os.makedirs(dst, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return True


def mesh_and_rules(mesh_spec: str | None, rules: str | None):
    """The CLI's mesh and rules; defaults: rules fsdp, and every local device on the first of
    fsdp, tensor, data that the rules use."""
    rules = get_rules(rules or "fsdp")
    used = rules.mesh_axes_used()
    axis = next((a for a in ("fsdp", "tensor") if a in used), "data")
    return make_mesh(mesh_spec or f"{axis}=-1"), rules


def model_settings(config, preset: str) -> tuple[str, ...]:
    """``KEY=VALUE`` overrides that turn the zoo preset ``preset`` into ``config``."""
    from shardzoo.models import get_config

    base = config_to_dict(get_config(preset))
    items = []
    for key, value in config_to_dict(config).items():
        if value != base[key]:
            value = dict(value) if key == "rope_scaling" and value else value
            items.append(f"{key}={_yaml_value(value)}")
    return tuple(items)


def hf_train_settings(hf_dir: str) -> dict:
    """TrainConfig fields that make ``shardzoo train`` build an HF model dir's model: ``model``
    (the family's preset) with ``override``s giving its config, its ``tokenizer``, and
    ``add_bos`` when that tokenizer starts every text with bos (Llama's post-processor), so
    training sees what ``generate`` feeds."""
    from tokenizers import Tokenizer

    preset = hf.FAMILY_PRESETS[hf.read_hf_config(hf_dir)["model_type"]]
    settings = {"model": preset, "override": model_settings(hf.load_hf_config(hf_dir), preset),
                "tokenizer": hf_dir, "add_bos": False}
    path = os.path.join(hf_dir, "tokenizer.json")
    if os.path.isfile(path):
        tokenizer = Tokenizer.from_file(path)
        plain = tokenizer.encode("a", add_special_tokens=False).ids
        settings["add_bos"] = len(tokenizer.encode("a").ids) > len(plain)
    return settings


def hf_train_args(hf_dir: str) -> list[str]:
    """``hf_train_settings`` as ``shardzoo train`` flags."""
    s = hf_train_settings(hf_dir)
    args = ["--model", s["model"], *(f for item in s["override"] for f in ("--override", item))]
    return args + ["--tokenizer", s["tokenizer"]] + (["--add-bos"] if s["add_bos"] else [])


def with_hf_model(cfg):
    """The TrainConfig ``cfg`` with, when its ``init_from`` is an HF model dir, that model's
    config and tokenizer: ``--init-from HF_DIR`` sets ``--model``; the user's ``--override``s
    apply after the HF ones, and a ``--tokenizer`` other than byte is kept."""
    if not (cfg.init_from and hf.is_hf_dir(cfg.init_from)):
        return cfg
    s = hf_train_settings(cfg.init_from)
    return dataclasses.replace(
        cfg, model=s["model"], override=s["override"] + tuple(cfg.override),
        tokenizer=s["tokenizer"] if cfg.tokenizer in (None, "byte") else cfg.tokenizer,
        add_bos=cfg.add_bos or s["add_bos"],
    )


def _yaml_value(value) -> str:
    """A value as text that ``--override`` parses back (YAML 1.1 reads ``1e-06`` as a string)."""
    if isinstance(value, str):
        return value
    text = json.dumps(value)
    if isinstance(value, float) and "e" in text and "." not in text:
        return text.replace("e", ".0e", 1)
    return text


def load_hf(hf_dir: str, mesh=None, rules=None, dtype=None, scan_layers: bool = True,
            overrides=None):
    """``(module, config, params)`` from an HF model directory, the params sharded under
    ``rules`` (default fsdp) on ``mesh`` (default: the first device), placed as the one
    ``Program`` of that model lays them out. See ``models.hf.load_hf_config``."""
    config = hf.load_hf_config(hf_dir, dtype, scan_layers, overrides)
    mesh = make_mesh("", devices=jax.devices()[:1]) if mesh is None else mesh
    program = Program(config, get_rules(rules or "fsdp"), mesh)
    return program.module, config, hf.load_hf_params(hf_dir, program.params_target(), config)


def import_hf(hf_dir: str, out_dir: str, mesh=None, rules=None, dtype=None,
              scan_layers=True) -> dict:
    """Convert an HF model dir into a shardzoo run dir at ``out_dir``; return the checkpoint meta.
    Nothing is written until every tensor has been read."""
    mesh = mesh if mesh is not None else make_mesh("fsdp=-1")
    rules = get_rules(rules or "fsdp")
    model_type = hf.read_hf_config(hf_dir)["model_type"]
    out_dir = os.path.abspath(out_dir)
    if latest_step(os.path.join(out_dir, CHECKPOINTS)) is not None:
        raise UserError(f"{out_dir} already holds checkpoints: import into a new directory")
    _, config, params = load_hf(hf_dir, mesh, rules, dtype=dtype, scan_layers=scan_layers)
    tokenizer_dir = os.path.join(out_dir, "tokenizer")
    has_tokenizer = os.path.isfile(os.path.join(hf_dir, "tokenizer.json"))
    if has_tokenizer and jax.process_index() == 0:
        copy_tokenizer_files(hf_dir, tokenizer_dir)
    model = hf.FAMILY_PRESETS[model_type]
    meta = {"model": model, "config": config_to_dict(config), "rules": rules.name,
            "mesh": describe_mesh(mesh), "tokenizer": tokenizer_dir if has_tokenizer else "byte",
            "tokenizer_saved": has_tokenizer, "hf_source": os.path.abspath(hf_dir),
            "hf_model_type": model_type}
    checkpointer = Checkpointer(out_dir, keep=1)
    state = {"step": jnp.zeros((), jnp.int32), "params": params}
    checkpointer.save(0, state, {"train": None, "imported_from": meta["hf_source"]}, meta)
    checkpointer.close()
    if jax.process_index() == 0:
        run = {"command": "import-hf", "model": model,
               "override": list(model_settings(config, model)),
               **{k: meta[k] for k in ("rules", "mesh", "tokenizer", "hf_source", "hf_model_type")}}
        with open(os.path.join(out_dir, "run.json"), "w") as f:
            json.dump(run, f, indent=1)
    return meta


def export_hf(checkpoint_dir: str, out_dir: str, mesh=None, rules=None, dtype=None,
              max_shard_bytes: int = 5 * 2**30) -> dict:
    """Write a run's (or checkpoint's) model as an HF dir, with the run's tokenizer files."""
    mesh = mesh if mesh is not None else make_mesh("fsdp=-1")
    _, config, params, tokenizer_spec = load_model_and_params(checkpoint_dir, mesh, rules or "fsdp")
    hf_config = hf.export_hf(config, params, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if tokenizer_spec and jax.process_index() == 0:
        src = tokenizer_spec if os.path.isdir(tokenizer_spec) else os.path.dirname(tokenizer_spec)
        if os.path.isdir(src):
            copy_tokenizer_files(src, out_dir)
    return hf_config


def load_for_generate(checkpoint: str | None = None, hf_dir: str | None = None, mesh=None,
                      rules=None, dtype=None):
    """``(module, config, params, tokenizer)`` from a shardzoo run/checkpoint or an HF model dir."""
    from shardzoo.data.tokenizer import load_tokenizer

    mesh = mesh if mesh is not None else make_mesh("fsdp=-1")
    rules = get_rules(rules or "fsdp")
    if hf_dir is not None:
        tokenizer = load_tokenizer(hf_dir)  # first: a missing tokenizer.json fails fast
        module, config, params = load_hf(hf_dir, mesh, rules, dtype=dtype)
        return module, config, params, tokenizer
    module, config, params, spec = load_model_and_params(checkpoint, mesh, rules)
    if dtype is not None and dtype != config.param_dtype:
        config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
        module, params = config.build(), jax.tree.map(lambda x: x.astype(dtype), params)
    return module, config, params, load_tokenizer(spec or "byte")


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt ids as the model saw text in training: an HF tokenizer adds its own special tokens
    (e.g. Llama's bos) through its post-processor, as transformers does; others add none."""
    inner = getattr(tokenizer, "tokenizer", None)  # HFTokenizer's tokenizers.Tokenizer
    return inner.encode(text).ids if inner is not None else tokenizer.encode(text)


def generate_text(module, config, params, tokenizer, prompt: str, mesh, rules,
                  max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0) -> str:
    """The prompt and its continuation, decoded; stops at the config's eos token(s), if any."""
    ids = encode_prompt(tokenizer, prompt)
    if not ids:
        raise UserError("--prompt encodes to no tokens")
    if max(ids) >= config.vocab_size:
        raise UserError(f"the tokenizer gives id {max(ids)}, beyond the model's "
                        f"vocab_size {config.vocab_size}")
    positions = config.max_position_embeddings
    if config.position_embedding == "learned" and len(ids) + max_new_tokens > positions:
        raise UserError(f"{len(ids)} prompt tokens + --max-new-tokens {max_new_tokens} exceed the "
                        f"model's {positions} positions")
    eos = config.eos_token_id
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    with activate(mesh, rules):
        out = generate(module, params, np.asarray([ids], np.int32), max_new_tokens, temperature,
                       top_k, top_p, seed, eos_ids or None)
    new = [int(t) for t in np.asarray(out)[0, len(ids):]]
    ends = [i for i, t in enumerate(new) if t in eos_ids]
    new = new[: ends[0]] if ends else new
    head, full = tokenizer.decode(ids), tokenizer.decode(ids + new)
    return prompt + (full[len(head):] if full.startswith(head) else tokenizer.decode(new))
