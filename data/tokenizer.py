"""Tokenizers: a byte-level one (the default) and Hugging Face ``tokenizers`` files.

Every tokenizer has ``encode(text) -> list[int]`` (no special tokens added), ``decode(ids) -> str``
(special ids dropped), ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``save(dir)`` and a
``spec`` string that ``load_tokenizer`` accepts again (recorded in checkpoints).
"""

from __future__ import annotations

import json
import os

import numpy as np

from shardzoo.data.errors import DataError

BYTE_SPEC = "byte"
BYTE_FILE = "shardzoo_tokenizer.json"  # what ByteTokenizer.save writes, so a saved dir loads back
HF_FILE = "tokenizer.json"
# Names of special tokens tried, in order, when no config file names them.
_GUESSES = {
    "eos": ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]"),
    "bos": ("<s>", "<bos>", "<|begin_of_text|>", "[CLS]"),
    "pad": ("<pad>", "<|pad|>", "[PAD]"),
}


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then pad 256, bos 257, eos 258 (vocab_size 259)."""

    spec = BYTE_SPEC
    pad_id, bos_id, eos_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of many texts, as int32 arrays (no Python lists: fast on whole corpora)."""
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, BYTE_FILE), "w") as f:
            json.dump({"type": BYTE_SPEC, "vocab_size": self.vocab_size}, f)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with its bos/eos/pad ids resolved."""

    def __init__(self, tokenizer, spec: str, bos_id: int, eos_id: int, pad_id: int):
        self.tokenizer = tokenizer
        self.spec = spec
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: str) -> None:
        """Write ``tokenizer.json`` and a ``tokenizer_config.json`` naming the special tokens."""
        os.makedirs(directory, exist_ok=True)
        self.tokenizer.save(os.path.join(directory, HF_FILE))
        config = {}
        for kind in ("bos", "eos", "pad"):
            token_id = getattr(self, f"{kind}_id")
            token = self.tokenizer.id_to_token(token_id)
            config[f"{kind}_token"] = token
            config[f"{kind}_token_id"] = token_id
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=1)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.spec!r}, vocab_size={self.vocab_size})"


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"tokenizer file {path}: cannot read: {e}") from None
    return data if isinstance(data, dict) else {}


def _special_ids(tokenizer, directory: str) -> dict[str, int | None]:
    """bos/eos/pad ids from tokenizer_config.json, special_tokens_map.json, config.json, or guesses."""
    found: dict[str, int | None] = {"bos": None, "eos": None, "pad": None}
    token_files = [
        _read_json(os.path.join(directory, n))
        for n in ("tokenizer_config.json", "special_tokens_map.json")
    ]
    model_config = _read_json(os.path.join(directory, "config.json"))
    for kind in found:
        candidates = []
        for data in token_files:
            token = data.get(f"{kind}_token")
            if isinstance(token, dict):  # serialized AddedToken
                token = token.get("content")
            candidates.append(tokenizer.token_to_id(token) if isinstance(token, str) else None)
        for data in token_files + [model_config]:
            value = data.get(f"{kind}_token_id")
            if isinstance(
                value, list
            ):  # e.g. Llama 3 lists several eos ids; the first ends documents
                value = value[0] if value else None
            candidates.append(value if isinstance(value, int) else None)
        candidates += [tokenizer.token_to_id(t) for t in _GUESSES[kind]]
        found[kind] = next((c for c in candidates if c is not None), None)
    return found


def load_tokenizer(spec: str | None = BYTE_SPEC):
    """``"byte"``, a ``tokenizer.json`` path, or a directory holding ``tokenizer.json`` (an HF model
    directory) or a saved byte tokenizer. Special ids come from the files beside ``tokenizer.json``."""
    if spec in (None, "", BYTE_SPEC):
        return ByteTokenizer()
    path = os.path.expanduser(str(spec))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, BYTE_FILE)):
            return ByteTokenizer()
        file = os.path.join(path, HF_FILE)
        if not os.path.isfile(file):
            raise DataError(f"tokenizer directory {path} holds no {HF_FILE} (nor {BYTE_FILE})")
    elif os.path.isfile(path):
        file = path
    else:
        raise DataError(
            f"tokenizer {spec!r}: no such file or directory; give 'byte', a {HF_FILE} "
            "or a Hugging Face model directory"
        )
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise DataError(f"tokenizer file {file}: cannot load: {e}".splitlines()[0]) from None
    ids = _special_ids(tokenizer, os.path.dirname(os.path.abspath(file)))
    if ids["eos"] is None:
        raise DataError(
            f"tokenizer {file}: no end-of-text token found (eos_token in tokenizer_config.json, "
            f"eos_token_id in config.json, or one of {', '.join(_GUESSES['eos'])})"
        )
    bos = ids["eos"] if ids["bos"] is None else ids["bos"]  # GPT-2 style: one token for both
    pad = ids["eos"] if ids["pad"] is None else ids["pad"]
    return HFTokenizer(tokenizer, os.path.abspath(path), bos_id=bos, eos_id=ids["eos"], pad_id=pad)
