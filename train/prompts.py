"""What ``generate`` continues: ``--prompt TEXT``, ``--prompt-file FILE`` (its exact text, a
trailing newline kept) or ``--messages FILE`` (a JSON conversation rendered with the model's chat
template by the renderer chat fine-tuning uses, ``data.chat.ChatRenderer``, with the generation
prompt added, as transformers' ``apply_chat_template(..., add_generation_prompt=True)``).

Files are read and checked before the model is loaded; a bad one is one ``UserError`` line
naming the flag and the file.
"""

from __future__ import annotations

import dataclasses
import json
import os

from shardzoo.errors import UserError


@dataclasses.dataclass(frozen=True)
class Prompt:
    """The text to continue (``messages`` still to render) and how its ids are made:
    ``special_tokens`` adds the tokenizer's own (e.g. bos) as ``--prompt`` does; a rendered
    chat template writes its special tokens itself."""

    text: str | None
    messages: list | None = None
    source: str = "--prompt"

    @property
    def special_tokens(self) -> bool:
        return self.messages is None


def _read_bytes(path: str, flag: str) -> bytes:
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a directory, not a file")
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"{flag} {path}: no such file") from None
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read: {e.strerror}") from None


def _utf8(raw: bytes, path: str, flag: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at byte offset "
                        f"{e.start}): convert it to UTF-8") from None


def read_prompt_file(path: str) -> Prompt:
    """The exact text of ``path`` (nothing stripped)."""
    text = _utf8(_read_bytes(path, "--prompt-file"), path, "--prompt-file")
    if not text:
        raise UserError(f"--prompt-file {path} is empty: nothing to continue")
    return Prompt(text, source=f"--prompt-file {path}")


def read_messages(path: str) -> Prompt:
    """The conversation of ``path``: a JSON list of ``{role, content}`` messages (or an object
    with such a list under ``messages``), checked; rendered later by ``render``."""
    flag = "--messages"
    text = _utf8(_read_bytes(path, flag), path, flag)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{flag} {path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if not isinstance(value, list) or not value:
        what = "an empty list" if value == [] else f"a JSON {type(value).__name__}"
        raise UserError(f"{flag} {path} holds {what}, not a list of {{\"role\", \"content\"}} messages")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            raise UserError(f"{flag} {path}: message {i} is not a {{\"role\", \"content\"}} object: "
                            f"{json.dumps(m)[:80]}")
    return Prompt(None, messages=value, source=f"{flag} {path}")


def render(prompt: Prompt, tokenizer) -> Prompt:
    """``prompt`` with its messages rendered by ``tokenizer``'s chat template (as chat SFT renders
    them) and the generation prompt added; a plain prompt as it is."""
    if prompt.messages is None:
        return prompt
    import jinja2

    from shardzoo.data.chat import ChatRenderer

    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise UserError(f"{prompt.source}: the model's tokenizer ({tokenizer.spec}) has no chat template "
                        "(chat_template.jinja, or chat_template in tokenizer_config.json): use "
                        "--prompt-file with the text written out")
    renderer = ChatRenderer(template.source, tokenizer.special_tokens, template.path, "--messages")
    try:
        text = renderer.render(prompt.messages, add_generation_prompt=True)
    except jinja2.TemplateError as e:
        raise UserError(f"{prompt.source}: chat template {template.path} fails on it: {e}".splitlines()[0]) from None
    return dataclasses.replace(prompt, text=text)


def run_adds_bos(checkpoint: str, step: int | None = None) -> bool:
    """Whether the run ``checkpoint`` trained with ``--add-bos`` (its run.json says; False when it
    records nothing, e.g. an imported model)."""
    from shardzoo.train.io.sources import READS_RUNS, open_source

    return bool(open_source(checkpoint, step=step, what="--checkpoint", accept=READS_RUNS).run_settings().get("add_bos"))
