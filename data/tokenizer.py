"""Tokenizers: a byte-level one (the default) and Hugging Face ``tokenizers`` files.

Every tokenizer has ``encode(text) -> list[int]`` (no special tokens added), ``decode(ids) -> str``
(special ids dropped), ``encode_offsets(text)`` (ids and each token's character span),
``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``special_tokens`` (the strings a chat
template sees as ``bos_token`` ...), ``chat_template`` (``ChatTemplateSource`` or None),
``save(dir)`` and a ``spec`` string that ``load_tokenizer`` accepts again (recorded in checkpoints).

A chat template comes from the tokenizer's directory as transformers reads it:
``chat_template.jinja`` first, else ``chat_template`` in ``tokenizer_config.json``; ``save``
writes it back in the same place, so a run's ``tokenizer/`` (and what ``export-hf`` copies from
it) keeps it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

import numpy as np

from shardzoo.data.errors import DataError

BYTE_SPEC = "byte"
BYTE_FILE = "shardzoo_tokenizer.json"  # what ByteTokenizer.save writes, so a saved dir loads back
HF_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# Names of special tokens tried, in order, when no config file names them.
_GUESSES = {
    "eos": ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]"),
    "bos": ("<s>", "<bos>", "<|begin_of_text|>", "[CLS]"),
    "pad": ("<pad>", "<|pad|>", "[PAD]"),
}


@dataclasses.dataclass(frozen=True)
class ChatTemplateSource:
    """A chat template's jinja source and the file it came from (``chat_template.jinja`` or
    ``tokenizer_config.json``), which names it in errors and tells ``save`` where to write it."""

    source: str
    path: str

    @property
    def in_config(self) -> bool:
        return os.path.basename(self.path) == CONFIG_FILE


def read_chat_template(directory: str) -> ChatTemplateSource | None:
    """The chat template of a tokenizer directory: ``chat_template.jinja``, else the
    ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates of
    which ``default`` is taken); None when it has neither."""
    path = os.path.join(directory, TEMPLATE_FILE)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return ChatTemplateSource(f.read(), path)
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"chat template {path}: cannot read: {e}") from None
    path = os.path.join(directory, CONFIG_FILE)
    template = _read_json(path).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(f"{path}: chat_template lists templates {', '.join(map(str, named))} "
                            "but none named 'default'")
        template = named["default"]
    if template is None:
        return None
    if not isinstance(template, str):
        raise DataError(f"{path}: chat_template is a {type(template).__name__}, not a string")
    return ChatTemplateSource(template, path)


def _write_chat_template(template: ChatTemplateSource | None, directory: str) -> None:
    if template is not None and not template.in_config:
        with open(os.path.join(directory, TEMPLATE_FILE), "w", encoding="utf-8") as f:
            f.write(template.source)


def _char_spans(text: str) -> tuple[np.ndarray, np.ndarray]:
    """Per UTF-8 byte of ``text``, the (start, end) of the character it belongs to."""
    widths = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text))
    starts = np.repeat(np.arange(len(text), dtype=np.int64), widths)
    return starts, starts + 1


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then pad 256, bos 257, eos 258 (vocab_size 259).

    Its special ids are no text, so a chat template sees no ``bos_token``/``eos_token``."""

    spec = BYTE_SPEC
    pad_id, bos_id, eos_id = 256, 257, 258
    vocab_size = 259
    special_tokens: dict = {}

    def __init__(self, chat_template: ChatTemplateSource | None = None):
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, start, end): each byte and the character span it belongs to."""
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        return (ids, *_char_spans(text))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of many texts, as int32 arrays (no Python lists: fast on whole corpora)."""
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids, skip_special: bool = True) -> str:
        """The text of ``ids``; the special ids (pad, bos, eos) have none either way."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, BYTE_FILE), "w") as f:
            json.dump({"type": BYTE_SPEC, "vocab_size": self.vocab_size}, f)
        if self.chat_template is not None:  # a byte tokenizer has no tokenizer_config.json
            with open(os.path.join(directory, TEMPLATE_FILE), "w", encoding="utf-8") as f:
                f.write(self.chat_template.source)

    @property
    def fingerprint(self) -> str:
        """What fixes its output (datasets' map fingerprint, ``data/packing.py``): its chat template."""
        return _digest(BYTE_SPEC, self.chat_template.source if self.chat_template else "")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with its bos/eos/pad ids resolved, the
    ``tokenizer_config.json`` it came with (``config``) and its chat template."""

    def __init__(self, tokenizer, spec: str, bos_id: int, eos_id: int, pad_id: int,
                 config: dict | None = None, chat_template: ChatTemplateSource | None = None):
        self.tokenizer = tokenizer
        self.spec = spec
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.config = dict(config or {})
        self.chat_template = chat_template

    @property
    def special_tokens(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``, ``pad_token`` (and ``unk_token`` when the config names
        one) as strings: what transformers hands a chat template."""
        tokens = {f"{k}_token": self.tokenizer.id_to_token(getattr(self, f"{k}_id"))
                  for k in ("bos", "eos", "pad")}
        unk = self.config.get("unk_token")
        unk = unk.get("content") if isinstance(unk, dict) else unk
        if isinstance(unk, str):
            tokens["unk_token"] = unk
        return {k: v for k, v in tokens.items() if v is not None}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, start, end): the tokens and the character span of each (as transformers'
        ``return_offsets_mapping``)."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, np.int32), offsets[:, 0], offsets[:, 1]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special: bool = True) -> str:
        """The text of ``ids``; ``skip_special=False`` keeps special tokens' own text (``<|user|>``)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def save(self, directory: str) -> None:
        """Write ``tokenizer.json``, the ``tokenizer_config.json`` it came with naming the special
        tokens (its chat template kept), and ``chat_template.jinja`` when it came with one."""
        os.makedirs(directory, exist_ok=True)
        self.tokenizer.save(os.path.join(directory, HF_FILE))
        config = dict(self.config)
        for kind in ("bos", "eos", "pad"):
            token_id = getattr(self, f"{kind}_id")
            token = self.tokenizer.id_to_token(token_id)
            config[f"{kind}_token"] = token
            config[f"{kind}_token_id"] = token_id
        with open(os.path.join(directory, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=1)
        _write_chat_template(self.chat_template, directory)

    @functools.cached_property
    def fingerprint(self) -> str:
        """What fixes its output (datasets' map fingerprint, ``data/packing.py``): its
        ``tokenizer.json``, special ids, config and chat template."""
        return _digest(self.tokenizer.to_str(), self.bos_id, self.eos_id, self.pad_id,
                       json.dumps(self.config, sort_keys=True, default=str),
                       self.chat_template.source if self.chat_template else "")

    def __repr__(self) -> str:
        return f"HFTokenizer({self.spec!r}, vocab_size={self.vocab_size})"


def _digest(*parts) -> str:
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).hexdigest()[:16]


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
            return ByteTokenizer(read_chat_template(path))
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
    directory = os.path.dirname(os.path.abspath(file))
    ids = _special_ids(tokenizer, directory)
    if ids["eos"] is None:
        raise DataError(
            f"tokenizer {file}: no end-of-text token found (eos_token in tokenizer_config.json, "
            f"eos_token_id in config.json, or one of {', '.join(_GUESSES['eos'])})"
        )
    bos = ids["eos"] if ids["bos"] is None else ids["bos"]  # GPT-2 style: one token for both
    pad = ids["eos"] if ids["pad"] is None else ids["pad"]
    return HFTokenizer(tokenizer, os.path.abspath(path), bos_id=bos, eos_id=ids["eos"], pad_id=pad,
                       config=_read_json(os.path.join(directory, CONFIG_FILE)),
                       chat_template=read_chat_template(directory))
