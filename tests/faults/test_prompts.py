"""``generate --prompt-file`` continues a file's exact text (a trailing newline kept) and
``generate --messages`` a JSON conversation rendered with the model's chat template, by the
renderer chat fine-tuning uses; a bad file is one line naming it, exit 2, nothing changed."""

import json
import shutil

import pytest

from shardzoo.cli import main
from shardzoo.data import load_tokenizer
from shardzoo.data.chat import ChatRenderer, encode_chat

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHAT = [{"role": "user", "content": "the quick"}, {"role": "assistant", "content": "brown fox"},
        {"role": "user", "content": "jumps over"}]
FLAGS = ["--max-new-tokens", "8"]


def generate(capsys, *args):
    capsys.readouterr()
    rc = main(["generate", *map(str, args), *FLAGS])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def chat_run(reference, tmp_path_factory):
    """The reference run with a chat template beside its saved (byte) tokenizer."""
    run = tmp_path_factory.mktemp("chat") / "run"
    shutil.copytree(reference, run)
    (run / "tokenizer" / "chat_template.jinja").write_text(TEMPLATE)
    return run


def test_prompt_file_keeps_its_trailing_newline(reference, tmp_path, capsys):
    text = "the quick brown fox\n"
    (tmp_path / "p.txt").write_bytes(text.encode())
    rc, out, err = generate(capsys, "--checkpoint", reference, "--prompt-file", tmp_path / "p.txt")
    assert rc == 0, err
    assert out.startswith(text) and len(out) > len(text) + 1
    # the same as --prompt with that exact string (what `$(cat p.txt)` would have cut short)
    assert generate(capsys, "--checkpoint", reference, "--prompt", text)[1] == out
    assert generate(capsys, "--checkpoint", reference, "--prompt", text.rstrip("\n"))[1] != out


def test_messages_are_rendered_as_chat_training_renders_them(chat_run, tmp_path, capsys):
    (tmp_path / "chat.json").write_text(json.dumps(CHAT))
    rc, out, err = generate(capsys, "--checkpoint", chat_run, "--messages", tmp_path / "chat.json")
    assert rc == 0, err
    tokenizer = load_tokenizer(str(chat_run / "tokenizer"))
    renderer = ChatRenderer(TEMPLATE, tokenizer.special_tokens, "t", "messages")
    prompt = renderer.render(CHAT, add_generation_prompt=True)
    assert prompt.endswith("<user>jumps over</s>\n<assistant>")
    assert out.startswith(prompt) and len(out) > len(prompt) + 1
    # chat SFT's text of the conversation with a reply starts with exactly this prompt
    trained, spans = renderer.spans(CHAT + [{"role": "assistant", "content": "x"}], 0)
    assert trained.startswith(prompt) and spans[-1][0] == len(prompt)
    # the same continuation as the rendered text given as a prompt file
    (tmp_path / "rendered.txt").write_text(prompt)
    assert generate(capsys, "--checkpoint", chat_run, "--prompt-file", tmp_path / "rendered.txt")[1] == out
    # {"messages": [...]} (the OpenAI form) reads the same
    (tmp_path / "wrapped.json").write_text(json.dumps({"messages": CHAT}))
    assert generate(capsys, "--checkpoint", chat_run, "--messages", tmp_path / "wrapped.json")[1] == out


BAD_FILES = [
    ("--prompt-file", None, "no such file"),
    ("--prompt-file", "dir", "is a directory, not a file"),
    ("--prompt-file", b"the \xf6x", "is not UTF-8 text (byte 0xf6 at byte offset 4)"),
    ("--prompt-file", b"", "is empty: nothing to continue"),
    ("--messages", b"[{\"role\": \"user\",", "not valid JSON (Expecting"),
    ("--messages", b"{\"role\": \"user\"}", "holds a JSON dict, not a list of"),
    ("--messages", b"[]", "holds an empty list"),
    ("--messages", b"[{\"role\": \"user\", \"content\": \"hi\"}, \"hello\"]", "message 1 is not a"),
    ("--messages", b"\xff[]", "is not UTF-8 text (byte 0xff at byte offset 0)"),
]


@pytest.mark.parametrize("flag, content, expected", BAD_FILES)
def test_a_bad_prompt_file_is_one_line_naming_it(cli, chat_run, tmp_path, flag, content, expected, capsys):
    path = tmp_path / "input"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    before = cli.snapshot(chat_run), cli.snapshot(tmp_path)
    rc, out, err = generate(capsys, "--checkpoint", chat_run, flag, path)
    line = cli.one_line(err, "generate")
    assert rc == 2 and f"{flag} {path}" in line and expected in line, line
    assert out == ""
    assert (cli.snapshot(chat_run), cli.snapshot(tmp_path)) == before


def test_messages_need_a_chat_template(cli, reference, tmp_path, capsys):
    (tmp_path / "chat.json").write_text(json.dumps(CHAT))
    before = cli.snapshot(reference), cli.snapshot(tmp_path)
    rc, out, err = generate(capsys, "--checkpoint", reference, "--messages", tmp_path / "chat.json")
    line = cli.one_line(err, "generate")
    assert rc == 2 and f"--messages {tmp_path / 'chat.json'}" in line and "has no chat template" in line, line
    assert (cli.snapshot(reference), cli.snapshot(tmp_path)) == before


def test_prompt_flags_exclude_each_other(cli, reference, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("the")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--checkpoint", str(reference), "--prompt", "a", "--prompt-file", str(tmp_path / "p.txt")])
    assert e.value.code == 2
    line = cli.one_line(capsys.readouterr().err, "generate")
    assert "not allowed with argument" in line, line


def test_messages_start_with_bos_when_the_run_trained_with_add_bos(chat_run, tmp_path, capsys):
    """Chat SFT with --add-bos starts every conversation with bos; so does generate --messages."""
    from shardzoo.train import prompts
    from shardzoo.train.defaults import mesh_and_rules
    from shardzoo.train.io import hf_io

    run = tmp_path / "bos_run"
    shutil.copytree(chat_run, run)
    settings = json.loads((run / "run.json").read_text())
    settings["settings"]["data"]["add_bos"] = True
    (run / "run.json").write_text(json.dumps(settings))
    (tmp_path / "chat.json").write_text(json.dumps(CHAT))
    rc, out, err = generate(capsys, "--checkpoint", run, "--messages", tmp_path / "chat.json")
    assert rc == 0, err
    mesh, rules = mesh_and_rules(None, None)  # generate's defaults
    _, config, params, tokenizer = hf_io.load_for_generate(str(run), None, mesh, rules)
    prompt = ChatRenderer(TEMPLATE, {}, "t", "messages").render(CHAT, add_generation_prompt=True)
    ids = hf_io.prompt_ids(tokenizer, prompt, special_tokens=False, add_bos=True)
    trained, _ = encode_chat(ChatRenderer(TEMPLATE, {}, "t", "messages"), tokenizer,
                             CHAT + [{"role": "assistant", "content": "x"}], 0, add_bos=True)
    assert ids[0] == tokenizer.bos_id and trained[:len(ids)].tolist() == ids  # SFT's ids start so
    assert prompts.run_adds_bos(str(run)) and not prompts.run_adds_bos(str(chat_run))  # what the CLI asks
    assert out == hf_io.generate_text(config, params, tokenizer, prompt, mesh, rules, 8,
                                      special_tokens=False, add_bos=True) + "\n"
