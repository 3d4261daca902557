"""Prompt datasets for reinforcement learning (GRPO): TRL's ``prompt`` column, as text or as a
conversation, and the other columns the reward functions are given.

A row's ``prompt`` is a text (tokenized as it is, ``[bos]`` first with ``add_bos``) or a list of
``{role, content}`` messages rendered with the tokenizer's chat template and its generation
prompt (TRL's conversational format). A prompt keeps its last ``max_prompt_length`` tokens (the
sampler's prompt width; TRL truncates on the left too). Every other column travels with the row
to the reward functions (``PromptSet.columns``). A null or empty prompt is a ``DataError`` naming
the data, the row (1-based) and the column, or with ``skip_bad`` skipped and counted.

``PromptIterator`` gives ``count`` prompt indices per step, a seeded permutation per epoch; an
epoch's tail shorter than ``count`` is dropped (every group of completions has a real prompt).
Its ``state()`` / ``restore()`` are JSON, like every data iterator's.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from shardzoo.data.chat import check_messages, renderer_for
from shardzoo.data.errors import DataError

PROMPT = "prompt"


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Tokenized prompts, what the reward functions see of them, and the other columns."""

    ids: list  # per prompt: int32 tokens (already truncated to max_prompt_length)
    prompts: list  # per prompt: the text, or the list of messages, as the data holds it
    columns: dict  # other column name -> list of values, one per prompt
    conversational: bool
    truncated: np.ndarray  # [prompts] bool: cut by max_prompt_length
    spec: str = ""

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, indices) -> PromptSet:
        """The prompts at ``indices``, in that order, with their columns."""
        indices = [int(i) for i in indices]
        return dataclasses.replace(self, ids=[self.ids[i] for i in indices],
                                   prompts=[self.prompts[i] for i in indices],
                                   columns={k: [v[i] for i in indices] for k, v in self.columns.items()},
                                   truncated=self.truncated[indices] if len(indices) else self.truncated[:0])


def split_prompts(prompts: PromptSet, fraction: float, seed: int) -> tuple[PromptSet, PromptSet]:
    """``(train, held out)``: ``round(fraction * len)`` prompts (at least one) chosen by ``seed``,
    each part in the data's order; the same for the same prompts, fraction and seed (what
    ``shardzoo eval --split eval`` of the run reads again)."""
    order = np.random.default_rng([int(seed), 7]).permutation(len(prompts))
    count = max(1, round(len(prompts) * fraction))
    if count >= len(prompts):
        raise DataError(f"--eval-fraction {fraction} holds out all {len(prompts)} prompts of {prompts.spec!r}")
    return prompts.subset(np.sort(order[count:])), prompts.subset(np.sort(order[:count]))


def tokenize_prompts(ds, tokenizer, spec: str, *, max_prompt_length: int, add_bos: bool = False,
                     skip_bad: bool = False) -> PromptSet:
    """Every row of ``ds`` as a prompt (see the module docstring)."""
    if PROMPT not in ds.column_names:
        raise DataError(f"data {spec!r} has no column 'prompt': a prompt dataset needs a 'prompt' column "
                        f"(text or {{role, content}} messages); its columns are: {', '.join(ds.column_names)}")
    first = ds[0][PROMPT]
    conversational = isinstance(first, (list, tuple))
    renderer = renderer_for(tokenizer, PROMPT) if conversational else None
    others = [c for c in ds.column_names if c != PROMPT]
    ids, prompts, bad, kept = [], [], [], []
    columns = {c: [] for c in others}
    for row, example in enumerate(ds):
        where = f"data {spec!r}: row {row + 1}, column 'prompt'"
        value = example[PROMPT]
        try:
            if value is None or (isinstance(value, str) and not value.strip()) or len(value) == 0:
                raise DataError(f"{where}: empty prompt" if value is not None else f"{where}: no value (null)")
            if isinstance(value, (list, tuple)) != conversational:
                raise DataError(f"{where}: holds a {type(value).__name__}, but row 1 holds "
                                f"{'messages' if conversational else 'text'}")
            if conversational:
                messages = check_messages(value, row + 1, PROMPT)
                text = renderer.render(messages, add_generation_prompt=True)
                value = messages
            else:
                text = value
        except DataError as e:
            if not skip_bad:
                raise DataError(f"{e} (or pass --skip-missing to skip such rows)") from None
            bad.append(str(e))
            continue
        tokens = list(tokenizer.encode(text))
        if add_bos and not (tokens and tokens[0] == tokenizer.bos_id):
            tokens = [tokenizer.bos_id] + tokens
        kept.append(len(tokens) > max_prompt_length)
        ids.append(np.asarray(tokens[-max_prompt_length:], np.int32))
        prompts.append(value)
        for c in others:
            columns[c].append(example[c])
    if bad:
        sys.stderr.write(f"shardzoo: warning: data {spec!r}: skipped {len(bad)} of {len(ds)} bad prompts "
                         f"(--skip-missing); the first: {bad[0]}\n")
    if not ids:
        raise DataError(f"data {spec!r}: no usable prompt in its {len(ds)} rows")
    return PromptSet(ids, prompts, columns, conversational, np.asarray(kept, bool), spec)


class PromptIterator:
    """``count`` prompt indices per ``next``, in a seeded order per epoch (see the module docstring)."""

    def __init__(self, num_prompts: int, count: int, seed: int = 0):
        if num_prompts < count:
            raise DataError(f"{num_prompts} prompts, fewer than the {count} prompts of one step "
                            "(--batch-size / --num-generations)")
        self.num_prompts, self.count = num_prompts, count
        self.seed, self.epoch, self.position = int(seed), 0, 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, 3, self.epoch]).permutation(self.num_prompts)

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if self.position + self.count > self.num_prompts:
            self.epoch, self.position = self.epoch + 1, 0
        picked = self._order()[self.position: self.position + self.count]
        self.position += self.count
        return picked

    def state(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "num_rows": self.num_prompts}

    def restore(self, state: dict) -> None:
        if state.get("num_rows") != self.num_prompts:
            raise DataError(f"the saved prompt iterator was over {state.get('num_rows')} prompts but this data "
                            f"has {self.num_prompts}: the data changed since the checkpoint")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
