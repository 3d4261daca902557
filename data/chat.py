"""Chat conversations: rendered with the tokenizer's chat template, loss on assistant turns only.

A row's conversation (a list of ``{role, content}`` messages) is rendered to text with jinja2 as
transformers' ``apply_chat_template`` renders it (a sandboxed environment with ``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``tojson``, ``strftime_now``, and the
tokenizer's special tokens as ``bos_token``, ``eos_token`` ...), then tokenized as one text. The
loss falls on the tokens of the assistant turns, found in the rendered text:

- a template with ``{% generation %}...{% endgeneration %}`` blocks marks them itself (what
  transformers' ``return_assistant_tokens_mask`` reads);
- otherwise each assistant turn ``i`` is located by rendering prefixes: its span runs from the
  end of ``messages[:i]`` rendered with the generation prompt (the ``<|assistant|>`` header) to
  the end of ``messages[:i + 1]``, so it holds the content and the end-of-turn text, never the
  header. When the template adds no generation prompt, the span starts where the content does.
  Both prefixes must be prefixes of the whole conversation's text; where they are not (a
  template that renders earlier turns differently once later ones follow), the row cannot be
  masked and a ``DataError`` says so: training on every token is never the fallback.

A token is a loss target when its characters overlap an assistant span (transformers' rule).
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime

import numpy as np

from shardzoo.data.errors import DataError
from shardzoo.data.packing import Documents, _documents_from, _map

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
ASSISTANT = "assistant"


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """The jinja2 template of ``source`` in transformers' chat-template environment; the
    ``generation`` tag records the character span of what it renders while a tracker is on."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

        def _track(self, caller):
            text = caller()
            tracker = self.environment.tracker
            if tracker is not None:  # (rendered blocks so far, spans)
                start = sum(len(b) for b in tracker[0])
                tracker[1].append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.tracker = None
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


class ChatRenderer:
    """Renders conversations with one chat template and finds their assistant spans.

    ``where`` names the template (its file) and ``column`` the data column in error messages."""

    def __init__(self, source: str, special_tokens: dict[str, str], where: str, column: str):
        import jinja2

        self.source, self.where, self.column = source, where, column
        self.special_tokens = dict(special_tokens)
        self.marked = bool(GENERATION_TAG.search(source))
        try:
            self.template = compile_template(source)
        except jinja2.TemplateError as e:
            raise DataError(f"chat template {where}: cannot parse: {e}".splitlines()[0]) from None

    def __reduce__(self):  # pickled (and hashed by datasets) by its source, not its jinja objects
        return ChatRenderer, (self.source, self.special_tokens, self.where, self.column)

    def render(self, messages, add_generation_prompt: bool = False, spans: list | None = None) -> str:
        """The text of ``messages``; with ``spans``, the ``{% generation %}`` spans are added to it."""
        kwargs = dict(self.special_tokens, messages=messages,
                      add_generation_prompt=add_generation_prompt)
        if spans is None:
            return self.template.render(**kwargs)
        env = self.template.environment
        blocks = []
        env.tracker = (blocks, spans)
        try:
            for block in self.template.generate(**kwargs):
                blocks.append(block)
        finally:
            env.tracker = None
        return "".join(blocks)

    def spans(self, messages, row: int) -> tuple[str, list[tuple[int, int]]]:
        """(text, character spans of the assistant turns) of one conversation (row ``row``)."""
        import jinja2

        try:
            if self.marked:
                spans = []
                text = self.render(messages, spans=spans)
                if spans or not any(m["role"] == ASSISTANT for m in messages):
                    return text, spans
                raise DataError(
                    f"chat template {self.where}: its {{% generation %}} blocks mark none of the "
                    f"assistant turns of row {row} of --chat-column {self.column}")
            return self._prefix_spans(messages, row)
        except jinja2.TemplateError as e:
            raise DataError(f"chat template {self.where} fails on row {row} of --chat-column "
                            f"{self.column}: {e}".splitlines()[0]) from None

    def _prefix_spans(self, messages, row: int) -> tuple[str, list[tuple[int, int]]]:
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            turn = self.render(messages[: i + 1])
            if not (turn.startswith(prompt) and text.startswith(turn)):
                raise DataError(
                    f"chat template {self.where} has no {{% generation %}} blocks and its render of "
                    f"the first {i + 1} messages of row {row} of --chat-column {self.column} is "
                    "not a prefix of the whole conversation's, so the assistant turns cannot be "
                    "found; add {% generation %} blocks around the assistant turns")
            start = len(prompt)
            if prompt == self.render(messages[:i]):  # no generation prompt: skip the turn's header
                content = message["content"] if isinstance(message["content"], str) else ""
                found = turn.find(content.strip(), start) if content.strip() else -1
                if found < 0:
                    raise DataError(
                        f"chat template {self.where} has no {{% generation %}} blocks nor a "
                        f"generation prompt, and assistant message {i} of row {row} of "
                        f"--chat-column {self.column} does not appear in its render, so its "
                        "turn cannot be found; add {% generation %} blocks")
                start = found
            if len(turn) > start:
                spans.append((start, len(turn)))
        return text, spans


def check_messages(messages, row: int, column: str) -> list[dict]:
    """The conversation of one row as plain dicts; a DataError for anything else."""
    if not isinstance(messages, (list, tuple)):
        raise DataError(f"row {row} of --chat-column {column} holds a {type(messages).__name__}, "
                        "not a list of {role, content} messages")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(f"message {i} of row {row} of --chat-column {column} is not a "
                            f"{{role, content}} mapping: {str(m)[:80]}")
        checked.append(dict(m))
    return checked


def token_mask(starts: np.ndarray, ends: np.ndarray, spans) -> np.ndarray:
    """Which tokens (character spans ``[starts, ends)``) overlap one of ``spans``."""
    mask = np.zeros(len(starts), bool)
    for a, b in spans:
        mask |= (ends > a) & (starts < b)
    return mask


def encode_chat(renderer: ChatRenderer, tokenizer, messages, row: int,
                add_bos: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of one conversation: the rendered text tokenized as one, the mask
    True on the tokens of assistant turns. ``add_bos``: start with bos unless the text does."""
    text, spans = renderer.spans(check_messages(messages, row, renderer.column), row)
    ids, starts, ends = tokenizer.encode_offsets(text)
    mask = token_mask(starts, ends, spans)
    if add_bos and not (len(ids) and ids[0] == tokenizer.bos_id):
        ids = np.concatenate([np.asarray([tokenizer.bos_id], np.int32), ids])
        mask = np.concatenate([[False], mask])
    return ids.astype(np.int32), mask


def renderer_for(tokenizer, column: str) -> ChatRenderer:
    """The renderer of ``tokenizer``'s chat template; a DataError when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise DataError(
            f"--chat-column {column}: tokenizer {tokenizer.spec} has no chat template "
            "(chat_template.jinja, or chat_template in tokenizer_config.json, in its directory)")
    return ChatRenderer(template.source, tokenizer.special_tokens, template.path, column)


def tokenize_chats(ds, tokenizer, column: str, add_bos: bool = False) -> Documents:
    """Render and tokenize every conversation of ``column`` with a batched ``datasets`` map; the
    loss mask is True on assistant tokens only (see the module docstring)."""
    renderer = renderer_for(tokenizer, column)

    def encode(batch, indices):
        ids, masks = [], []
        for messages, row in zip(batch[column], indices, strict=True):
            tokens, mask = encode_chat(renderer, tokenizer, messages, row, add_bos)
            ids.append(tokens)
            masks.append(mask)
        return {"input_ids": ids, "loss_mask": masks}

    return _documents_from(_map(ds, encode, tokenizer, column, add_bos, with_indices=True))
