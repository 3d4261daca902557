"""shardzoo.data: sources, tokenizers, packing and the per-process batch iterator.

The API the trainer codes against::

    from shardzoo.data import DataConfig, make_datasets, load_tokenizer

    config = DataConfig(
        data="stdlib",            # "stdlib" (embedded, no download) | file | glob | directory
                                  # | hub:NAME[:CONFIG][@SPLIT] (a bare non-path name is a Hub name too)
        text_column="text",
        prompt_column=None,       # both given: one prompt+completion example per row,
        completion_column=None,   #   loss only on the completion tokens (and its closing eos)
        eval_data=None,           # a held-out data spec, or ...
        eval_fraction=0.0,        # ... this seeded fraction of the documents (not both)
        tokenizer="byte",         # "byte" | path/to/tokenizer.json | HF model directory
        add_bos=False,            # start every document with bos
        cache_dir=None,           # datasets' cache directory
    )
    tokenizer = load_tokenizer(config.tokenizer)
    train_iter, eval_iter = make_datasets(
        config, tokenizer, seq_len, global_batch_size, mesh=None, rules=None, seed=0,
        process_index=None, process_count=None)

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
0 = padding; ``positions`` restart at 0 at each document start in the row), or one example per
row in prompt/completion mode. ``targets[t]`` is the next token of the same segment;
``weights`` is 0 on each segment's last position in the row, on padding, and on prompt targets.
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

Errors: every bad input raises ``DataError`` (a ``UserError``) naming the file, column,
spec or tokenizer.
"""

from shardzoo.data.errors import DataError
from shardzoo.data.loader import (
    BatchIterator,
    DataConfig,
    make_datasets,
)
from shardzoo.data.sources import load_source
from shardzoo.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "BatchIterator",
    "ByteTokenizer",
    "DataConfig",
    "DataError",
    "HFTokenizer",
    "load_source",
    "load_tokenizer",
    "make_datasets",
]
