"""shardzoo.data: sources, tokenizers, packing, labelled examples and the per-process batch iterator.

The API the trainer codes against::

    from shardzoo.data import DataConfig, make_datasets, make_labelled_datasets, load_tokenizer

    config = DataConfig(
        data="stdlib",            # "stdlib" (embedded, no download) | file | glob | directory
                                  # | hub:NAME[:CONFIG][@SPLIT] (a bare non-path name is a Hub name too)
        text_column="text",
        prompt_column=None,       # both given: one prompt+completion example per row,
        completion_column=None,   #   loss only on the completion tokens (and its closing eos)
        chat_column=None,         # conversations ({role, content} lists) rendered with the
                                  #   tokenizer's chat template, loss on assistant turns only
                                  #   (see chat.py)
        eval_data=None,           # a held-out data spec, or ...
        eval_fraction=0.0,        # ... this seeded fraction of the documents (not both)
        tokenizer="byte",         # "byte" | path/to/tokenizer.json | HF model directory
        add_bos=False,            # start every document with bos
        cache_dir=None,           # datasets' cache directory
        label_column=None,        # given: labelled examples (make_labelled_datasets, below)
        feature_columns=None,     # their feature columns; None: every column but the label
    )
    tokenizer = load_tokenizer(config.tokenizer)
    train_iter, eval_iter = make_datasets(
        config, tokenizer, seq_len, global_batch_size, mesh=None, rules=None, seed=0,
        process_index=None, process_count=None)

``make_eval_dataset(config, tokenizer, seq_len, global_batch_size, split="all", seed=0, mesh=None,
rules=None)``: one in-order pass over every row of ``config.data`` (``split="all"``) or over the
documents ``make_datasets`` keeps (``"train"``) or holds out (``"eval"``) under ``eval_fraction``
and ``seed`` (``shardzoo eval``); ``make_preference_eval_dataset`` (same arguments) the same of
preference pairs (``config.preference``).

``tokenizer=None`` loads ``config.tokenizer``. ``eval_iter`` is None without eval data. Text
files are one document per file; ``eval_fraction`` holds out whole documents (seeded by ``seed``).

Batches (``next(train_iter)``): a dict of ``inputs``, ``targets``, ``segment_ids``, ``positions``
(int32) and ``weights`` (float32 loss mask), each ``[batch, length]``.

- With ``mesh`` (and ``rules``, a rule table): global ``jax.Array`` s of shape
  ``[global_batch_size, seq_len]`` with sharding
  ``spec_to_sharding((ax.BATCH, ax.LENGTH), mesh, rules)``, built with
  ``jax.make_array_from_process_local_data``; each process computes only the rows (and columns)
  its devices hold (the sharding decides; ``process_index``/``process_count`` are not used).
- Without ``mesh``: numpy, this process's rows only: rows ``[i * B / n, (i + 1) * B / n)`` of each
  global batch for ``process_index`` i of ``process_count`` n (defaults: jax's).

Rows: packed documents (each ends with eos; ``segment_ids`` 1, 2, ... per document in the row,
0 = padding; ``positions`` restart at 0 at each document start in the row), one example per
row in prompt/completion mode, or whole conversations (each cut to ``seq_len``) packed in order,
several per row, in chat mode. ``targets[t]`` is the next token of the same segment;
``weights`` is 0 on each segment's last position in the row, on padding, on prompt targets
and on targets outside assistant turns.
Loss = sum(weights * token_loss) / sum(weights): the last batch of an epoch is filled up with
all-padding rows (weights 0).

Iterators: ``train_iter`` is endless; the row order is a seeded permutation per epoch (same
seed, same order; every epoch different). ``state() -> {"seed", "epoch", "position",
"num_rows"}`` (JSON-able; position counts rows done in the epoch) and ``restore(state)`` make
the next batches exactly those of an uninterrupted run. ``eval_iter`` goes through its rows in
order; each ``for batch in eval_iter`` is one full pass. Both have ``batches_per_epoch``.

Tokenizers: ``encode(text) -> list[int]`` (no special tokens), ``decode(ids) -> str``,
``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``save(dir)``, ``spec`` (a string
``load_tokenizer`` accepts again). ``"byte"``: ids 0..255 are bytes, pad 256, bos 257, eos 258,
vocab_size 259.

Preference pairs (``preference=True``: DPO and its variants; ``preference.py``): TRL's
``prompt``/``chosen``/``rejected`` columns as text or conversations (or ``chosen``/``rejected``
conversations sharing their first turns), one pair per row, batches of ``[batch, 2, seq_len]``
sequences (chosen first) with a completion-token ``loss_mask``, pair ``weights`` and
``truncated`` flags; ``max_prompt_length``/``max_completion_length`` truncate; bad rows are a
``DataError`` naming file, row and column, or skipped and counted with ``skip_missing``.
With ``unpaired=True`` (KTO): TRL's ``prompt``/``completion``/bool ``label`` rows, each as the same
``[2, seq_len]`` layout (the row, then its prompt with the previous row's completion within each
batch-sized run: the KL row) and a ``labels`` entry.

Prompts for reinforcement learning (GRPO; ``prompts.py``): TRL's ``prompt`` column as text or as
conversations (rendered with the chat template and its generation prompt), each kept to its last
``max_prompt_length`` tokens, the other columns kept for the reward functions
(``tokenize_prompts``); ``PromptIterator`` picks a step's prompts, resumable like the others.

Labelled examples (``label_column`` given; no tokenizer, no text)::

    train_iter, eval_iter = make_labelled_datasets(
        config, global_batch_size, mesh=None, rules=None, seed=0,
        process_index=None, process_count=None)

One example per row of the data; batches are dicts of

- ``inputs``: float32 ``[batch, num_features]``, the feature columns concatenated in order:
  numeric scalars (one feature each), fixed-length numeric lists/arrays (flattened), images
  (``datasets.Image`` or ``{bytes, path}`` structs; flattened). uint8 values of list, array and
  image columns (pixels) are divided by 255; nothing else is scaled.
- ``targets``: classification (integer class ids, ``ClassLabel``, bool, or strings mapped to ids
  in sorted order): int32 ``[batch]``; regression (a float or a fixed-length list of numbers):
  float32 ``[batch, num_outputs]``.
- ``weights``: float32 ``[batch]``, 1 per example and 0 for the zero rows that fill up the last
  batch of an epoch. Loss = sum(weights * example_loss) / sum(weights).

With ``mesh``, each is a global ``jax.Array`` of sharding
``spec_to_sharding((ax.BATCH,) + (None,) * (ndim - 1), mesh, rules)``; without it, numpy rows of
this process, exactly as above. Shuffling, ``state()``/``restore()``, eval passes,
``eval_fraction`` (whole examples held out, seeded as documents are) and ``eval_data`` (read with
the train data's feature columns; one label id space for both) are those of the LM path. The
iterators also have ``task`` (``"classification"`` | ``"regression"``), ``num_features``,
``num_classes`` (None for regression), ``num_outputs`` (classes, or the target width) and
``label_names`` (the class names of string or ``ClassLabel`` labels, else None).

Errors: every bad input raises ``DataError`` (a ``UserError``) naming the file, column,
spec or tokenizer.
"""

import importlib

# name -> the submodule that defines it, imported on first use: a command that only touches one
# submodule (generate, export, plan) does not pay for ``datasets`` and pyarrow (~0.7 s)
_WHERE = {
    "BatchIterator": "batches", "LabelledBatchIterator": "batches", "DataError": "errors",
    "DataConfig": "loader", "make_datasets": "loader", "make_eval_dataset": "loader",
    "make_labelled_datasets": "loader", "make_preference_eval_dataset": "loader",
    "load_source": "sources", "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


def __dir__():
    return sorted(list(globals()) + list(_WHERE))


__all__ = [
    "BatchIterator",
    "ByteTokenizer",
    "DataConfig",
    "DataError",
    "HFTokenizer",
    "LabelledBatchIterator",
    "load_source",
    "load_tokenizer",
    "make_datasets",
    "make_eval_dataset",
    "make_labelled_datasets",
    "make_preference_eval_dataset",
]
