"""Hugging Face model dirs <-> shardzoo runs: ``import-hf``, ``export-hf`` and ``generate``.

An imported model is a run directory like a trained one (``OUT/checkpoints/0`` with the params
under ``state``, ``OUT/tokenizer/``, ``OUT/run.json``), so ``train --init-from``,
``generate --checkpoint`` and ``export-hf`` read it as they read any run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError

from shardzoo.errors import EnvironmentFault, UserError
from shardzoo.models import hf, lora
from shardzoo.sharding.mesh import describe_mesh, make_mesh
from shardzoo.sharding.rules import get_rules
from shardzoo.train import model_info
from shardzoo.train.defaults import mesh_and_rules, pad_vocab
from shardzoo.train.io.checkpoint import CHECKPOINTS, Checkpointer, latest_step
from shardzoo.train.io.hub import resolve_model_dir
from shardzoo.train.io.rundir import LOCK_FILE, check_empty_target, describe_os_error, locked
from shardzoo.train.io.runmeta import model_meta
from shardzoo.train.io.sources import READS_RUNS, load_model, open_source
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


def load_hf(hf_dir: str, mesh=None, rules=None, dtype=None, scan_layers: bool = True,
            overrides=None):
    """``(module, config, params)`` from an HF model directory, the params sharded under
    ``rules`` (default fsdp) on ``mesh`` (default: the first device), placed as the one
    ``Program`` of that model lays them out. See ``models.hf.load_hf_config``."""
    config = hf.load_hf_config(hf_dir, dtype, scan_layers, overrides)
    mesh = make_mesh("", devices=jax.devices()[:1]) if mesh is None else mesh
    rules = get_rules(rules or "fsdp")
    config, _ = pad_vocab(config, rules, mesh)  # a tensor-parallel table: the padded embedding and head
    program = Program(config, rules, mesh)
    return program.module, config, hf.load_hf_params(hf_dir, program.params_target(), config)


def import_hf(hf_dir: str, out_dir: str, mesh=None, rules=None, dtype=None,
              scan_layers=True) -> dict:
    """Convert an HF model dir into a shardzoo run dir at ``out_dir``; return the checkpoint meta.
    Nothing is written until every tensor has been read."""
    mesh, rules = mesh_and_rules(mesh, rules)
    hf_dir = resolve_model_dir(hf_dir, "HF_DIR")  # a Hub model id: its snapshot in the cache
    model_type = hf.read_hf_config(hf_dir).get("model_type")
    family = hf.family_of_model_type(model_type, os.path.join(hf_dir, "config.json"))
    out_dir = os.path.abspath(out_dir)
    if latest_step(os.path.join(out_dir, CHECKPOINTS)) is not None:
        raise UserError(f"{out_dir} already holds checkpoints: import into a new directory")
    check_empty_target(out_dir, "OUT_DIR")
    with locked(out_dir, "OUT_DIR"):
        check_empty_target(out_dir, "OUT_DIR")  # again, now that no one else can write there
        return _import_hf(hf_dir, out_dir, mesh, rules, dtype, scan_layers, model_type, family)


def _import_hf(hf_dir, out_dir, mesh, rules, dtype, scan_layers, model_type, family) -> dict:
    _, config, params = load_hf(hf_dir, mesh, rules, dtype=dtype, scan_layers=scan_layers)
    tokenizer_dir = os.path.join(out_dir, "tokenizer")
    has_tokenizer = os.path.isfile(os.path.join(hf_dir, "tokenizer.json"))
    if has_tokenizer and jax.process_index() == 0:
        copy_tokenizer_files(hf_dir, tokenizer_dir)
    meta = {**model_meta(config, None, family.name, hf.read_hf_config(hf_dir)), "rules": rules.name,
            "mesh": describe_mesh(mesh), "tokenizer": tokenizer_dir if has_tokenizer else "byte",
            "tokenizer_saved": has_tokenizer, "hf_source": os.path.abspath(hf_dir),
            "hf_model_type": model_type}
    checkpointer = Checkpointer(out_dir, keep=1)
    state = {"step": jnp.zeros((), jnp.int32), "params": params}
    checkpointer.save(0, state, {"train": None, "imported_from": meta["hf_source"]}, meta)
    checkpointer.close()
    if jax.process_index() == 0:
        keys = ("model", "family", "config", "rules", "mesh", "tokenizer", "hf_source",
                "hf_model_type")
        run = {"command": "import-hf", **{k: meta[k] for k in keys}}
        with open(os.path.join(out_dir, "run.json"), "w") as f:
            json.dump(run, f, indent=1)
    return meta


def export_hf(checkpoint_dir: str, out_dir: str, mesh=None, rules=None, dtype=None,
              max_shard_bytes: int = 5 * 2**30, overwrite: bool = False, step: int | None = None,
              merge_lora: bool = False, into: str | None = None) -> dict:
    """Write a run's (or checkpoint's) model as an HF dir, with the run's tokenizer files; with
    ``into`` (the multimodal checkpoint it was imported from), that whole checkpoint with the
    model as its language model (``models.hf.multimodal.write_full``).

    ``out_dir`` must be missing or empty unless ``overwrite``; it is locked while written. The
    newest restorable checkpoint is exported, or that of ``step``. A LoRA run's adapters are
    folded into their kernels with ``merge_lora`` (else refused: ``export-lora`` writes them)."""
    mesh, rules = mesh_and_rules(mesh, rules)
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    check_empty_target(out_dir, "OUT_DIR", overwrite)
    if into is not None:
        into = resolve_model_dir(into, "--into")
        hf.multimodal.original_config(into)
    source = open_source(checkpoint_dir, step=step, what="CHECKPOINT_DIR", accept=READS_RUNS)
    _, config, params = load_model(source, mesh, rules)
    tokenizer_spec = source.tokenizer
    if model_info.lora_rank(config) and not merge_lora:
        raise UserError(f"{checkpoint_dir} holds LoRA adapters: --merge-lora writes the merged "
                        f"weights, `shardzoo export-lora` the PEFT adapters")
    if model_info.lora_rank(config):
        config, params = lora.merge_lora(config, params)
    family = source.family  # e.g. phi3: fused tensors
    with locked(out_dir, "OUT_DIR"):
        check_empty_target(out_dir, "OUT_DIR", overwrite)
        before = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
        try:
            hf_config = hf.export_hf(config, params, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes,
                                     family=family, base=source.meta.get("hf_config"))
            if tokenizer_spec and jax.process_index() == 0:
                src = tokenizer_spec if os.path.isdir(tokenizer_spec) else os.path.dirname(tokenizer_spec)
                if os.path.isdir(src):
                    copy_tokenizer_files(src, out_dir)
            if into is not None and jax.process_index() == 0:
                hf_config = hf.multimodal.write_full(out_dir, into, max_shard_bytes)
        except (OSError, SafetensorError) as e:
            _remove_new_entries(out_dir, before)
            raise _write_error(out_dir, e) from None
    return hf_config


def _remove_new_entries(out_dir: str, before: set[str]) -> None:
    """A failed export leaves OUT_DIR as it found it: what this command wrote is removed."""
    if jax.process_index() != 0 or not os.path.isdir(out_dir):
        return
    for name in set(os.listdir(out_dir)) - before - {LOCK_FILE}:
        path = os.path.join(out_dir, name)
        with contextlib.suppress(OSError):
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def _write_error(out_dir: str, e: Exception) -> Exception:
    """A failed write as one line: a full disk is the machine's fault (exit 1), a read-only or
    forbidden OUT_DIR the user's (exit 2). safetensors reports I/O errors as its own type, with
    the OS's message and ``os error N`` in its text."""
    if isinstance(e, OSError):
        reason, user = describe_os_error(e)
    else:
        text = str(e)
        code = re.search(r"os error (\d+)", text)
        reason = re.sub(r"^.*I/O error: ", "", text).strip()
        user = code is not None and describe_os_error(OSError(int(code.group(1)), reason))[1]
    message = f"OUT_DIR {out_dir}: writing the export failed: {reason}; nothing was left there"
    return UserError(message) if user else EnvironmentFault(message + "; free space and run the same command")


def load_for_generate(checkpoint: str | None = None, hf_dir: str | None = None, mesh=None,
                      rules=None, dtype=None, step: int | None = None):
    """``(module, config, params, tokenizer)`` from a shardzoo run/checkpoint or an HF model dir."""
    from shardzoo.data.tokenizer import load_tokenizer

    mesh, rules = mesh_and_rules(mesh, rules)
    if hf_dir is not None:
        source = open_source(hf_dir, what="--hf", accept=("hf",))
        tokenizer = load_tokenizer(source.tokenizer)  # first: a missing tokenizer.json fails fast
    else:
        source = open_source(checkpoint, step=step, what="--checkpoint", accept=READS_RUNS)
    module, config, params = load_model(source, mesh, rules, dtype)
    if hf_dir is None:
        tokenizer = load_tokenizer(source.tokenizer or "byte")
    return module, config, params, tokenizer


def encode_prompt(tokenizer, text: str, special_tokens: bool = True) -> list[int]:
    """Prompt ids as the model saw text in training: an HF tokenizer adds its own special tokens
    (e.g. Llama's bos) through its post-processor, as transformers does; others add none.
    Without ``special_tokens`` (a rendered chat template, which writes its own) none are added."""
    inner = getattr(tokenizer, "tokenizer", None)  # HFTokenizer's tokenizers.Tokenizer
    return inner.encode(text).ids if inner is not None and special_tokens else list(tokenizer.encode(text))


def prompt_ids(tokenizer, text: str, special_tokens: bool = True, add_bos: bool = False) -> list[int]:
    """``encode_prompt``'s ids, started with bos when ``add_bos`` and the text does not (as chat
    fine-tuning with ``--add-bos`` starts a conversation)."""
    ids = encode_prompt(tokenizer, text, special_tokens)
    return [tokenizer.bos_id] + ids if add_bos and not (ids and ids[0] == tokenizer.bos_id) else ids


def generate_text(config, params, tokenizer, prompt: str, mesh, rules,
                  max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0, special_tokens: bool = True,
                  what: str = "--prompt", add_bos: bool = False) -> str:
    """The prompt and its continuation, decoded by the model's Program on ``mesh`` under
    ``rules`` (``params`` placed as that program lays them out); stops at the config's eos
    token(s), if any. ``special_tokens``: see ``encode_prompt``; ``what`` names the prompt's
    flag in errors; ``add_bos``: start with bos unless the text does (as chat SFT's ``add_bos``)."""
    ids = prompt_ids(tokenizer, prompt, special_tokens, add_bos)
    if not ids:
        raise UserError(f"{what} encodes to no tokens")
    if max(ids) >= config.vocab_size:
        raise UserError(f"the tokenizer gives id {max(ids)}, beyond the model's "
                        f"vocab_size {config.vocab_size}")
    positions = config.max_positions
    # a learned position table ends there; rotary positions go on (transformers generates on, and
    # dynamic NTK scaling exists for exactly that)
    if config.arch.position_embedding == "learned" and len(ids) + max_new_tokens > positions:
        raise UserError(f"{len(ids)} prompt tokens + --max-new-tokens {max_new_tokens} exceed the "
                        f"model's {positions} positions: use --max-new-tokens {max(positions - len(ids), 0)} "
                        f"or less")
    eos = config.arch.eos_token_id
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    program = Program(config, rules, mesh)
    out = program.decoding.generate(params, np.asarray([ids], np.int32), max_new_tokens=max_new_tokens,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_ids=eos_ids)
    new = [int(t) for t in np.asarray(out)[0, len(ids):]]
    ends = [i for i, t in enumerate(new) if t in eos_ids]
    new = new[: ends[0]] if ends else new
    head, full = tokenizer.decode(ids), tokenizer.decode(ids + new)
    return prompt + (full[len(head):] if full.startswith(head) else tokenizer.decode(new))
