"""Packing, shuffling, per-process slices, resuming and prompt/completion rows (numpy mode)."""

import collections
import json

import numpy as np
import pytest

from shardzoo.data import DataConfig, DataError, load_tokenizer, make_datasets

SEQ, BATCH = 16, 4
DOCS = [f"doc {i}: " + "lorem ipsum é " * (i % 5) + "x" * (3 * i % 7) for i in range(23)]
TOK = load_tokenizer("byte")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "docs.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS)])


def make(path, tmp_path, seed=0, **kw):
    config = DataConfig(data=path, cache_dir=str(tmp_path / "cache"), **kw)
    return make_datasets(config, TOK, SEQ, BATCH, seed=seed, process_index=0, process_count=1)


def documents_in(rows):
    """The documents in packed rows, as texts (rows are in packing order, documents end with eos)."""
    stream = rows.tokens[rows.segment_ids > 0].tolist()
    texts, start = [], 0
    for i, t in enumerate(stream):
        if t == TOK.eos_id:
            texts.append(TOK.decode(stream[start:i]))
            start = i + 1
    return texts


def take(it, n):
    return [next(it) for _ in range(n)]


def test_every_token_once_per_epoch_over_both_processes(corpus, tmp_path):
    config = DataConfig(data=corpus, cache_dir=str(tmp_path / "cache"))
    seen = collections.Counter()
    for index in (0, 1):
        train, _ = make_datasets(
            config, TOK, SEQ, BATCH, seed=3, process_index=index, process_count=2
        )
        for batch in take(train, train.batches_per_epoch):
            assert batch["inputs"].shape == (BATCH // 2, SEQ)
            seen.update(batch["inputs"][batch["segment_ids"] > 0].tolist())
    expected = collections.Counter()
    for d in DOCS:
        expected.update(TOK.encode(d) + [TOK.eos_id])
    assert seen == expected
    assert seen[TOK.eos_id] == len(DOCS)


def test_targets_stay_within_documents(corpus, tmp_path):
    train, _ = make(corpus, tmp_path)
    docs = {tuple(TOK.encode(d) + [TOK.eos_id]) for d in DOCS}
    for batch in take(train, train.batches_per_epoch):
        seg, inp, tgt, w, pos = (
            batch[k] for k in ("segment_ids", "inputs", "targets", "weights", "positions")
        )
        assert set(np.unique(w)) <= {0.0, 1.0}
        nxt_same = np.zeros_like(seg, bool)
        nxt_same[:, :-1] = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] > 0)
        np.testing.assert_array_equal(
            w, nxt_same.astype(np.float32)
        )  # weight 0 at each piece's end
        np.testing.assert_array_equal(tgt[:, :-1][nxt_same[:, :-1]], inp[:, 1:][nxt_same[:, :-1]])
        assert (inp[seg == 0] == TOK.pad_id).all() and (w[seg == 0] == 0).all()
        for row in range(BATCH):
            for s in np.unique(seg[row][seg[row] > 0]):
                where = np.flatnonzero(seg[row] == s)
                assert (np.diff(where) == 1).all()  # one contiguous piece per segment
                np.testing.assert_array_equal(pos[row, where], np.arange(len(where)))
                piece = tuple(inp[row, where])
                # Each piece is a slice of one real document (so no target crosses documents).
                assert any(piece == d[i : i + len(piece)] for d in docs for i in range(len(d)))


def test_process_slices_are_disjoint_and_cover_the_global_batch(corpus, tmp_path):
    config = DataConfig(data=corpus, cache_dir=str(tmp_path / "cache"))
    whole, _ = make_datasets(config, TOK, SEQ, BATCH, seed=1, process_index=0, process_count=1)
    parts = [
        make_datasets(config, TOK, SEQ, BATCH, seed=1, process_index=i, process_count=2)[0]
        for i in (0, 1)
    ]
    for _ in range(whole.batches_per_epoch + 2):
        full = next(whole)
        halves = [next(p) for p in parts]
        for key in full:
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), full[key])


def test_shuffle_is_deterministic_by_seed_and_differs_per_epoch(corpus, tmp_path):
    def epoch_rows(seed, epochs=2):
        train, _ = make(corpus, tmp_path, seed=seed)
        out = []
        for _ in range(epochs):
            batches = take(train, train.batches_per_epoch)
            out.append(np.concatenate([b["inputs"] for b in batches]))
        return out

    a, b, c = epoch_rows(0), epoch_rows(0), epoch_rows(1)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[0], a[1])  # a new order each epoch ...
    assert sorted(map(tuple, a[0])) == sorted(map(tuple, a[1]))  # ... of the same rows


@pytest.mark.parametrize("skip", [3, "end_of_epoch", "before_boundary"])
def test_restore_reproduces_the_next_batches(corpus, tmp_path, skip):
    train, _ = make(corpus, tmp_path, seed=7)
    per_epoch = train.batches_per_epoch
    skip = {"end_of_epoch": per_epoch, "before_boundary": per_epoch - 1}.get(skip, skip)
    take(train, skip)
    state = json.loads(json.dumps(train.state()))
    expected = take(train, per_epoch + 2)  # crosses into the next epoch(s)

    resumed, _ = make(corpus, tmp_path, seed=123)  # the state's seed wins
    resumed.restore(state)
    for want, got in zip(expected, take(resumed, per_epoch + 2), strict=True):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_restore_refuses_other_data(corpus, tmp_path):
    train, _ = make(corpus, tmp_path)
    with pytest.raises(DataError, match="rows"):
        train.restore(dict(train.state(), num_rows=train.state()["num_rows"] + 1))


def test_last_batch_of_an_epoch_is_padded_with_empty_rows(corpus, tmp_path):
    train, _ = make(corpus, tmp_path)
    rows = len(train.rows)
    assert rows % BATCH  # the fixture must leave a partial last batch
    last = take(train, train.batches_per_epoch)[-1]
    empty = (last["segment_ids"] == 0).all(axis=1)
    assert empty.sum() == BATCH - rows % BATCH
    assert (last["weights"][empty] == 0).all() and (last["inputs"][empty] == TOK.pad_id).all()


def test_eval_fraction_holds_out_documents_and_eval_passes_repeat(corpus, tmp_path):
    train, evaluation = make(corpus, tmp_path, eval_fraction=0.25, seed=5)
    train_docs, eval_docs = documents_in(train.rows), documents_in(evaluation.rows)
    assert len(eval_docs) == round(0.25 * len(DOCS))
    assert sorted(train_docs + eval_docs) == sorted(DOCS)  # disjoint, and together all of them
    assert eval_docs == [d for d in DOCS if d in eval_docs]  # eval keeps corpus order
    assert documents_in(make(corpus, tmp_path, eval_fraction=0.25, seed=5)[1].rows) == eval_docs
    assert documents_in(make(corpus, tmp_path, eval_fraction=0.25, seed=6)[1].rows) != eval_docs

    first = [b["inputs"] for b in evaluation]
    second = [b["inputs"] for b in evaluation]  # each for loop is one full pass
    assert len(first) == evaluation.batches_per_epoch
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_prompt_completion_weights_only_on_completion(tmp_path):
    pairs = [(f"Q{i}?", f" A{2 * i}" + "!" * i) for i in range(8)]
    pairs.append(("long prompt", " cut off here"))  # longer than SEQ: truncated
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "answer": c} for p, c in pairs])
    config = DataConfig(
        data=path, prompt_column="prompt", completion_column="answer", cache_dir=str(tmp_path)
    )
    train, _ = make_datasets(config, TOK, SEQ, BATCH, seed=0)
    assert len(train.rows) == len(pairs)  # one example per row
    seen = 0
    for batch in take(train, train.batches_per_epoch):
        for row in range(BATCH):
            seg = batch["segment_ids"][row]
            if not seg.any():
                continue
            inputs = batch["inputs"][row][seg > 0].tolist()
            full = {p: TOK.encode(p) + TOK.encode(c) + [TOK.eos_id] for p, c in pairs}
            (p,) = [p for p in full if full[p][:SEQ] == inputs]
            full, n = full[p], min(len(full[p]), SEQ)
            assert set(seg[:n]) == {1} and not seg[n:].any()
            np.testing.assert_array_equal(batch["positions"][row][:n], np.arange(n))
            completion = np.zeros(SEQ, bool)
            completion[: n - 1] = np.arange(1, n) >= len(
                TOK.encode(p)
            )  # target index t+1 in completion
            np.testing.assert_array_equal(batch["weights"][row], completion.astype(np.float32))
            np.testing.assert_array_equal(batch["targets"][row][: n - 1], full[1:n])
            seen += 1
    assert seen == len(pairs)


def test_tokenizing_is_fingerprinted_by_its_inputs_not_by_hashing_the_function(caplog):
    """datasets hashes a map's function with dill unless given ``new_fingerprint``; on the TPU
    machine (datasets 5.0.1) it could not, and warned of a random fingerprint on every run. The
    map is fingerprinted by the input, the tokenizer and the arguments instead: equal for equal
    inputs, apart for any one changed, and without a warning for a tokenizer dill cannot pickle."""
    import datasets

    from shardzoo.data.packing import _map, tokenize_documents
    from shardzoo.data.tokenizer import ByteTokenizer, ChatTemplateSource

    ds = datasets.Dataset.from_dict({"text": DOCS[:5], "other": DOCS[5:10]})

    def mapped(tokenizer, *what):
        return _map(ds, lambda b: {"input_ids": b["text"], "loss_mask": b["text"]}, tokenizer, *what)._fingerprint

    class Unpicklable(ByteTokenizer):
        def __init__(self):
            super().__init__()
            self.stream = (i for i in range(3))  # dill cannot pickle a generator

    base = mapped(TOK, "text", False)
    assert mapped(ByteTokenizer(), "text", False) == base
    templated = ByteTokenizer(ChatTemplateSource("{{ messages }}", None))
    assert len({base, mapped(TOK, "other", False), mapped(TOK, "text", True), mapped(templated, "text", False)}) == 4
    with caplog.at_level("WARNING"):
        docs = tokenize_documents(ds, Unpicklable(), "text")
    assert not [r for r in caplog.records if "hashed" in r.getMessage()]
    assert TOK.decode(docs.tokens[docs.offsets[0]:docs.offsets[1]]) == DOCS[0]
