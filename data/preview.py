"""``shardzoo data``: what a data spec becomes in training, shown before training on it.

The rows come from the calls training makes (``loader.split_rows`` and ``make_labelled_datasets``
with the same flags), so what is shown is what trains: each row's tokens decoded one by one, which
of them are loss targets (a token trains when the position before it has weight 1 in the batch,
``packing.batch_arrays``), where documents start, padding, and how many tokens ``--seq-len`` cut.
Labelled data shows its features, labels and class names.
"""

from __future__ import annotations

import numpy as np

from shardzoo.data.loader import DataConfig, make_labelled_datasets, split_rows
from shardzoo.data.tokenizer import load_tokenizer

CHUNK = 4096  # rows whose batch arrays are built at once when counting targets


def layout_of(config: DataConfig) -> str:
    """The row layout: ``chat``, ``prompt/completion`` or ``text`` (packed documents)."""
    return "chat" if config.chat else "prompt/completion" if config.examples else "text"


def _targets(rows) -> int:
    return int(sum(rows.batch(np.arange(i, min(i + CHUNK, len(rows))))["weights"].sum()
                   for i in range(0, len(rows), CHUNK)))


def summarize(docs, rows, seq_len: int, layout: str) -> dict:
    """Counts of one split: documents, tokens, rows, padding, tokens that train, truncation."""
    lengths = docs.lengths
    summary = {"documents": len(docs), "tokens": int(lengths.sum()), "rows": len(rows), "seq_len": seq_len,
               "padding_tokens": int((rows.segment_ids == 0).sum()), "train_tokens": _targets(rows),
               "longest_document": int(lengths.max()) if len(lengths) else 0}
    if layout == "text":  # packed: a long document continues in the next row, nothing is cut
        summary["truncated_documents"] = summary["tokens_cut"] = 0
    else:  # one example (or conversation) per row, cut at --seq-len
        summary["truncated_documents"] = int((lengths > seq_len).sum())
        summary["tokens_cut"] = int(np.maximum(lengths - seq_len, 0).sum())
    return summary


def _piece(tokenizer, token: int) -> str:
    """A token's text, special tokens by their own (``<|user|>``); one with none (the byte
    tokenizer's) by its role. Only called for tokens inside a document, so an id that is also the
    pad id (an end of turn, GPT-2's eos) is named by its other role: padding is decided by segment."""
    text = tokenizer.decode([token], skip_special=False)
    if not text:
        names = {tokenizer.pad_id: "<pad>", tokenizer.bos_id: "<bos>", tokenizer.eos_id: "<eos>"}
        text = names.get(token, "")
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def row_tokens(rows, index: int, tokenizer) -> list[dict]:
    """Row ``index`` token by token: ``id``, decoded ``text``, ``segment`` (0 = padding) and
    ``train`` (whether the token is a loss target, as the batch weights say)."""
    batch = rows.batch(np.asarray([index]))
    weights, segments, tokens = batch["weights"][0], rows.segment_ids[index], rows.tokens[index]
    return [{"id": int(t), "text": "<pad>" if s == 0 else _piece(tokenizer, int(t)), "segment": int(s),
             "train": bool(j > 0 and weights[j - 1] > 0)}
            for j, (t, s) in enumerate(zip(tokens.tolist(), segments.tolist(), strict=True))]


def format_row(index: int, tokens: list[dict]) -> str:
    """Two lines: the row's counts, then its tokens separated by ``|``; tokens that do not train
    are between ``[[`` and ``]]``, a new document starts after ``||``, padding is counted."""
    pads = sum(t["segment"] == 0 for t in tokens)
    train = sum(t["train"] for t in tokens)
    segments = len({t["segment"] for t in tokens} - {0})
    parts, quiet = [], False
    previous = None
    for t in tokens:
        if t["segment"] == 0:
            break
        sep = "" if previous is None else "||" if t["segment"] != previous else "|"
        previous = t["segment"]
        if quiet and (t["train"] or sep == "||"):
            parts.append("]]")
            quiet = False
        parts.append(sep)
        if not t["train"] and not quiet:
            parts.append("[[")
            quiet = True
        parts.append(t["text"])
    if quiet:
        parts.append("]]")
    if pads:
        parts.append(f" + {pads} x <pad>")
    return (f"row {index}: {len(tokens)} tokens, {segments} document{'s' if segments != 1 else ''}, "
            f"{train} train\n  " + "".join(parts))


def preview_lm(config: DataConfig, seq_len: int, seed: int, show: int, split: str = "train") -> dict:
    """The summary of both splits and the first ``show`` rows of ``split`` (``eval``: the config
    holds one out), token by token."""
    tokenizer = load_tokenizer(config.tokenizer)
    rows_of = split_rows(config, tokenizer, seq_len, seed)
    layout = layout_of(config)
    out = {"layout": layout, "tokenizer": tokenizer.spec, "add_bos": config.add_bos,
           "train": summarize(rows_of.train_docs, rows_of.train_rows, seq_len, layout)}
    if rows_of.eval_rows is not None:
        out["eval"] = summarize(rows_of.eval_docs, rows_of.eval_rows, seq_len, layout)
    rows = rows_of.train_rows if split == "train" else rows_of.eval_rows
    out["split"] = split
    out["shown"] = [{"row": i, "tokens": row_tokens(rows, i, tokenizer)} for i in range(min(show, len(rows)))]
    return out


def preview_labelled(config: DataConfig, batch_size: int, seed: int, show: int, split: str = "train") -> dict:
    """The summary of labelled examples (task, features, classes and their counts) and the first
    ``show`` examples of ``split``."""
    train, evaluation = make_labelled_datasets(config, batch_size, seed=seed)
    chosen = train if split == "train" else evaluation
    names = train.label_names
    out = {"layout": "labelled", "task": train.task, "features": train.num_features,
           "classes": list(names) if names else train.num_classes, "split": split}
    for key, it in (("train", train), ("eval", evaluation)):
        if it is None:
            continue
        part = {"examples": len(it.rows)}
        if it.num_classes is not None:  # classification: the examples of each class
            counts = np.bincount(it.rows.targets, minlength=it.num_classes)
            part["class_counts"] = {(names[i] if names else str(i)): int(c) for i, c in enumerate(counts)}
        out[key] = part
    rows = chosen.rows
    out["shown"] = []
    for i in range(min(show, len(rows))):
        target = rows.targets[i]
        label = int(target) if target.ndim == 0 else target.tolist()
        item = {"row": i, "features": rows.features[i].tolist(), "label": label}
        if names and target.ndim == 0:
            item["class"] = names[int(target)]
        out["shown"].append(item)
    return out


def format_preview(p: dict, data: str) -> str:
    """The human form of ``preview_lm``/``preview_labelled``."""
    lines = []
    if p["layout"] == "labelled":
        classes = p["classes"]
        what = (f"{len(classes)} classes ({', '.join(map(str, classes))})" if isinstance(classes, list)
                else f"{classes} classes" if p["task"] == "classification" else "regression targets")
        lines.append(f"data {data}: labelled examples, {p['features']} features each, {what}")
        for key in ("train", "eval"):
            if key in p:
                counts = p[key].get("class_counts")
                extra = f"; per class: {', '.join(f'{k} {v}' for k, v in counts.items())}" if counts else ""
                lines.append(f"{key}: {p[key]['examples']} examples{extra}")
        n = len(p["shown"])
        lines.append(f"first {n} {p['split']} example{'s' if n != 1 else ''}:")
        for item in p["shown"]:
            feats = item["features"]
            head = ", ".join(f"{v:.4g}" for v in feats[:8]) + (f", ... ({len(feats)} in all)" if len(feats) > 8 else "")
            label = f"{item['label']} ({item['class']})" if "class" in item else str(item["label"])
            lines.append(f"example {item['row']}: label {label}; features [{head}]")
        return "\n".join(lines)
    lines.append(f"data {data}: {p['layout']} rows, tokenizer {p['tokenizer']}"
                 + (", bos added" if p["add_bos"] else ""))
    for key in ("train", "eval"):
        if key in p:
            s = p[key]
            cut = ("no document cut (a long one continues in the next row)" if p["layout"] == "text"
                   else f"{s['truncated_documents']} cut at --seq-len {s['seq_len']} ({s['tokens_cut']} tokens dropped)")
            lines.append(f"{key}: {s['documents']} documents, {s['tokens']} tokens -> {s['rows']} rows of "
                         f"{s['seq_len']} ({s['padding_tokens']} padding); {s['train_tokens']} tokens train; "
                         f"{cut}; longest {s['longest_document']}")
    n = len(p["shown"])
    lines.append(f"first {n} {p['split']} row{'s' if n != 1 else ''} (in packing order; training shuffles them). "
                 "Tokens are separated by |, documents by ||; [[ ]] holds tokens that do not train:")
    lines.extend(format_row(r["row"], r["tokens"]) for r in p["shown"])
    return "\n".join(lines)
