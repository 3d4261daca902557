"""What an existing ``--out`` may hold, checked before a run writes anything: not a place inside
another run's checkpoints, and a run to resume only with the model, optimizer, tokenizer,
sequence length and batch size it was trained with. Reads only.
"""

from __future__ import annotations

import os

from shardzoo.errors import UserError
from shardzoo.sharding.mesh import describe_mesh
from shardzoo.train.config import ConfigError
from shardzoo.train.io.checkpoint import (
    CHECKPOINTS,
    DamagedCheckpoint,
    all_steps,
    no_restorable,
    read_meta,
    verify,
)
from shardzoo.train.io.runmeta import check_same_model, config_to_dict
from shardzoo.train.io.sources import WORDS, classify, is_checkpoints_dir, is_step_dir


def check_out(out: str) -> None:
    """``--out`` names a run directory: not a checkpoint step, a run's checkpoints dir or a
    directory inside one (a new run would nest in the old one), nor a Hugging Face model or PEFT
    adapter directory that is no run."""
    path = probe = os.path.abspath(os.path.expanduser(out))
    while True:
        inside = " inside" if probe != path else ""
        if is_step_dir(probe):
            run_dir = os.path.dirname(os.path.dirname(probe))
            raise ConfigError(f"--out {path} is{inside} checkpoint step {os.path.basename(probe)} of the "
                              f"run {run_dir}: resume that run with --out {run_dir}, or choose a new directory")
        parent = os.path.dirname(probe)
        if is_checkpoints_dir(probe):
            raise ConfigError(f"--out {path} is{inside} the {CHECKPOINTS} directory of the run {parent}: "
                              f"resume that run with --out {parent}, or choose a new directory")
        if probe == path and classify(path) in ("hf", "adapter") and not (
                os.path.isdir(os.path.join(path, CHECKPOINTS)) or os.path.isfile(os.path.join(path, "run.json"))):
            raise ConfigError(f"--out {path} is {WORDS[classify(path)]}: a run's files would mix with its "
                              f"files; choose a new directory (--init-from takes it as the model)")
        if parent == probe:
            return
        probe = parent


def check_resume(cfg, out, config, tokenizer, mesh, rules) -> tuple[int | None, tuple[str, ...]]:
    """The step a run in ``out`` resumes from (None: a fresh run), checked against this run's
    model, overrides, optimizer, tokenizer, sequence length and batch size; reads only.

    Steps whose meta cannot be read are passed over here (the Trainer moves them aside), and so
    is a final step whose arrays do not read back (before "nothing to do"); a run whose every step
    is damaged is refused. A changed mesh or rule table is allowed (the restore reshards) and
    said in one line.
    """
    root = os.path.join(out, CHECKPOINTS)
    steps, damaged = all_steps(root), []
    for step in steps:
        try:
            meta = read_meta(root, step)
            problem = verify(root, step) if cfg.steps <= step else None  # before "nothing to do"
            if problem:
                raise DamagedCheckpoint(root, step, problem)
        except DamagedCheckpoint as e:
            damaged.append(e)
            continue
        break
    else:
        if damaged:
            raise no_restorable(root, damaged)
        return None, ()
    where = os.path.join(root, str(step))
    check_same_model(meta, cfg.model, config_to_dict(config), cfg.optimizer, where)
    sizes = (("seq_len", cfg.seq_len),) * (tokenizer is not None) + (("batch_size", cfg.batch_size),)
    for key, value in sizes:
        flag = "--" + key.replace("_", "-")
        if meta.get(key) not in (None, value):
            raise ConfigError(f"{where} was trained with {flag} {meta[key]}, not {value}: resume with "
                              f"{flag} {meta[key]} or choose another --out")
    if tokenizer is not None and not _same_tokenizer(tokenizer, meta.get("tokenizer"),
                                                      os.path.join(out, "tokenizer")):
        raise ConfigError(f"{where} was trained with --tokenizer {meta.get('tokenizer')}, not "
                          f"{cfg.tokenizer}: resume with --tokenizer {meta.get('tokenizer')} (or "
                          f"{out}/tokenizer) or choose another --out")
    notes = []
    now = (describe_mesh(mesh), cfg.rules or rules.name)
    then = (meta.get("mesh"), meta.get("rules"))
    if None not in then and then != now:
        notes.append(f"resuming step {step}, saved on mesh {then[0]} under rules {then[1]}, onto mesh "
                     f"{now[0]} under rules {now[1]}: the state is resharded")
    return step, tuple(notes)


def _tokenizer_key(tokenizer):
    inner = getattr(tokenizer, "tokenizer", None)  # an HFTokenizer's tokenizers.Tokenizer
    if inner is None:
        return (type(tokenizer).__name__,)
    return (inner.to_str(), tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)


def _same_tokenizer(tokenizer, saved_spec, saved_dir: str) -> bool:
    """Whether ``tokenizer`` is the one a run was trained with (its spec, or its saved files)."""
    from shardzoo.data import load_tokenizer

    if saved_spec is None or tokenizer.spec == saved_spec:
        return True
    for spec in (saved_dir, saved_spec):
        try:
            return _tokenizer_key(load_tokenizer(spec)) == _tokenizer_key(tokenizer)
        except UserError:
            continue
    return False
