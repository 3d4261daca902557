"""On-policy distillation: ``--task distill`` with ``--lmbda`` / ``--seq-kd``, as TRL's ``GKDTrainer``.

The data are TRL's prompt-completion rows (``prompt`` and ``completion``, text or messages). Each
step takes ``--batch-size`` prompts and, as ``GKDTrainer.training_step`` decides per step: with
probability ``lmbda`` the *student* continues them (on-policy: ``Program.generate`` on the params
the step trains, the sampler's settings ``--temperature``, ``--top-k``, ``--top-p`` and
``--max-completion-length`` new tokens); otherwise, with ``--seq-kd``, the *teacher* does
(sequence-level KD); otherwise the data's completions are the batch's. A row is the prompt
right-aligned in ``seq_len - max_completion_length`` slots, then the completion up to and
including its first eos (``train/tasks/grpo.py``'s ``rollout_rows``, TRL's labels: the prompt and what
follows the eos masked). The teacher then scores the rows and the loss is ``train/tasks/distill.py``'s
generalized JSD over the completion tokens (TRL's ``generalized_jsd_loss``, ``batchmean``).

The draw of a step (a uniform number from the seed and the step, compared with ``lmbda``) and its
sampler key (from the seed and the step) make a resumed run repeat the uninterrupted one; the
data state is the prompt iterator's position. The step's metrics add ``on_policy`` (1: the
student's completions, 0: the teacher's or the data's) and ``completions/mean_length``.
"""

from __future__ import annotations

import jax
import numpy as np

from shardzoo.data.errors import DataError
from shardzoo.data.prompts import PromptIterator
from shardzoo.train.tasks.reward_functions import completion_lengths, left_pad, rollout_rows
from shardzoo.train.tasks.rollouts import sampler_key, train_prompts
from shardzoo.train.trainer import Trainer

COMPLETION = "completion"
DRAW_STREAM = 0x6CD  # the per-step draw against lmbda: default_rng([seed, DRAW_STREAM, step])
MODES = ("student", "teacher", "data")  # who wrote a step's completions


def completion_tokens(prompts, tokenizer, spec: str, limit: int) -> list[np.ndarray]:
    """Each row's ``completion`` tokens and an eos, cut to ``limit``: a text tokenized as it is,
    messages as the chat template renders them after the prompt's generation prompt (TRL's
    prompt-completion format). A missing column, or an empty value, is a DataError naming it."""
    if COMPLETION not in prompts.columns:
        raise DataError(f"data {spec!r} has no column 'completion': --task distill with --lmbda < 1 and no "
                        "--seq-kd trains on the data's completions (TRL's prompt-completion rows)")
    renderer = None
    if prompts.conversational:
        from shardzoo.data.chat import renderer_for

        renderer = renderer_for(tokenizer, COMPLETION)
    out = []
    for row, (prompt, value) in enumerate(zip(prompts.prompts, prompts.columns[COMPLETION], strict=True)):
        if not value or (isinstance(value, str) and not value.strip()):
            raise DataError(f"data {spec!r}: row {row + 1}, column 'completion': empty completion")
        if renderer is not None:
            head = renderer.render(list(prompt), add_generation_prompt=True)
            whole = renderer.render(list(prompt) + list(value))
            value = whole[len(head):] if whole.startswith(head) else whole
        out.append(np.asarray((list(tokenizer.encode(value)) + [tokenizer.eos_id])[:limit], np.int32))
    return out


class GKDData:
    """The train data of on-policy distillation (see the module docstring)."""

    def __init__(self, prompts, completions, tokenizer, *, batch_size: int, seed: int, prompt_width: int,
                 completion: int, lmbda: float, seq_kd: bool, sampling: dict):
        self.prompts, self.completions, self.tokenizer = prompts, completions, tokenizer
        self.prompt_width, self.completion, self.sampling = prompt_width, completion, sampling
        self.lmbda, self.seq_kd, self.seed = float(lmbda), bool(seq_kd), int(seed)
        self.iterator = PromptIterator(len(prompts), batch_size, seed)
        self.sampler_key = sampler_key(seed)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.iterator)

    def state(self) -> dict:
        return {"prompts": self.iterator.state()}

    def restore(self, state: dict) -> None:
        self.iterator.restore(state["prompts"])

    def mode(self, step: int) -> str:
        """Who writes the completions of the step after ``step``: TRL's ``random() <= lmbda``."""
        draw = np.random.default_rng([self.seed, DRAW_STREAM, int(step)]).random()
        if self.lmbda > 0 and draw <= self.lmbda:
            return "student"
        return "teacher" if self.seq_kd else "data"

    def key(self, step: int) -> np.ndarray:
        key = jax.random.fold_in(jax.random.wrap_key_data(self.sampler_key), step)
        return np.asarray(jax.random.key_data(key), np.uint32)

    def rows(self, indices, sample=None) -> dict:
        """The host batch (``lm``'s layout, ``weights`` the completion tokens) of the prompts at
        ``indices``: continued by ``sample(prompt, prompt_lengths) -> tokens``, or with the data's
        completions when ``sample`` is None."""
        tok, width = self.tokenizer, self.prompt_width
        prompt, prompt_lengths = left_pad([self.prompts.ids[i] for i in indices], width, tok.pad_id)
        if sample is None:  # the data's completions, each with its eos (or cut at the width)
            tokens = np.full((len(indices), width + self.completion), tok.pad_id, np.int32)
            tokens[:, :width] = prompt
            lengths = np.asarray([len(self.completions[i]) for i in indices], np.int32)
            for r, i in enumerate(indices):
                tokens[r, width: width + lengths[r]] = self.completions[i]
        else:  # sampled: up to and including the first eos
            tokens = np.asarray(sample(prompt, prompt_lengths), np.int32)
            lengths, _ = completion_lengths(tokens[:, width:], (tok.eos_id,))
        rows = rollout_rows(tokens, prompt_lengths, lengths, width, tok.pad_id)
        rows["weights"] = rows.pop("loss_mask")
        return rows


def gkd_data(cfg, tokenizer) -> GKDData:
    """The ``GKDData`` of a run's settings: its prompts (and completions, where the data's are
    used) read and tokenized, one-line errors naming the data, row and column."""

    prompts, width, completion = train_prompts(cfg, tokenizer)
    completions = None
    if cfg.lmbda < 1 and not cfg.seq_kd:
        completions = completion_tokens(prompts, tokenizer, cfg.data, completion)
    sampling = {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
    return GKDData(prompts, completions, tokenizer, batch_size=cfg.batch_size, seed=cfg.seed, prompt_width=width,
                   completion=completion, lmbda=cfg.lmbda, seq_kd=cfg.seq_kd, sampling=sampling)


class GKDTrainer(Trainer):
    """The Trainer of on-policy distillation: each step's completions written, then the step."""


    def train_step(self, state, indices) -> tuple:
        step = int(jax.device_get(state.step))
        host, metrics = self.batch(state.params, indices, step)
        placed = self.complete(self.program.place_global(host), state.params)  # the teacher's logits
        new_state, step_metrics = self._train_step(state, placed, self.rng)
        return new_state, {**step_metrics, **metrics}

    def batch(self, params, indices, step: int) -> tuple[dict, dict]:
        """``(host batch, metrics)`` of the step after ``step`` (``GKDData.mode`` decides who writes)."""
        data = self.train_data
        mode = data.mode(step)
        sample = None
        if mode != "data":
            program = self.program if mode == "student" else self.program.teacher.sampler()
            weights = params if mode == "student" else self.reference_params
            sample = lambda prompt, lengths: program.decoding.generate(  # noqa: E731
                weights, prompt, lengths, max_new_tokens=data.completion, key=data.key(step),
                eos_ids=(data.tokenizer.eos_id,), pad_id=data.tokenizer.pad_id, **data.sampling)
        host = data.rows([int(i) for i in indices], sample)
        lengths = host["weights"].sum(1)
        return host, {"on_policy": float(mode == "student"), "completions/mean_length": float(lengths.mean())}

