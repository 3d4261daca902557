"""``shardzoo eval --task multiple-choice`` follows lm-evaluation-harness's convention: on a tiny
random HF Llama and a local harness task, every choice's log-likelihood equals the harness's
logged one (fp32, 1e-4) and ``acc`` / ``acc_norm`` are the harness's; the same items written three
ways (the space before an answer at the end of the context, at the start of each choice, or not
at all) give the same requests, so the same log-likelihoods (1e-5), ``acc`` and ``acc_norm``.
The items are chosen so that the old conventions (dividing by the choice's length with its
space; no delimiter) give other numbers, so the test can fail."""

import json

import numpy as np
import pytest

from shardzoo import cli

# (context, choices, label): answers of different lengths, so that acc and acc_norm can differ;
# two contexts end with a newline, which the harness moves into the continuation as whitespace.
# The model is random: the labels are chosen (once, from its scores) so that acc, acc_norm and
# acc_norm divided by the length with the space (the old convention) are all different.
ITEMS = [
    ("Q: What color is the sky? A:", ["blue", "a deep shade of green", "red"], 1),
    ("Q: What do cows drink? A:", ["milk", "water from the river", "tea"], 1),
    ("Q: Where do fish live? A:", ["in the sea", "sky", "on a tall tree"], 2),
    ("Q: What is frozen water?\n", ["ice", "steam", "a warm cup of tea"], 0),
    ("Q: What do bees make? A:", ["honey", "milk and bread", "ice"], 1),
    ("Q: What shines at night? A:", ["the moon", "sun", "a bright red fish"], 2),
    ("Q: What do dogs say?\n", ["woof", "the cat says meow", "moo"], 1),
    ("Q: What falls from clouds? A:", ["rain", "snow and ice", "sand"], 2),
    ("Q: Where do birds sit? A:", ["on a branch", "sea", "under the deep blue water"], 2),
    ("Q: What do we read? A:", ["a book", "the moon", "red"], 1),
]
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: "{delimiter}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def rows(writing: str) -> list[dict]:
    """The items written with the space before each answer in the context, in the choices, or
    nowhere (the harness's default delimiter adds it)."""
    out = []
    for context, choices, label in ITEMS:
        if writing == "context":
            context = context + " "
        elif writing == "choices":
            choices = [" " + c for c in choices]
        out.append({"context": context, "choices": choices, "label": label})
    return out


def write_jsonl(path, items) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in items)
    return str(path)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random HF Llama dir with a byte-level BPE tokenizer (trained here) that starts
    every text with <s>."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("hf_llama")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [f"{context} {choice}" for context, choices, _ in ITEMS for choice in choices]
    tok.train_from_iterator(texts * 10, trainers.BpeTrainer(
        vocab_size=160, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=-(-len(fast) // 8) * 8, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=1, eos_token_id=2, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def harness(hf_llama, tmp_path_factory):
    """lm-evaluation-harness (its Python API, offline, on the CPU) on two local tasks: the items
    written without spaces at the seam with the default ``target_delimiter: " "``, and written
    with the space in the context with ``target_delimiter: ""`` (the harness's way for that
    writing). Per task: acc, acc_norm and each row's choice log-likelihoods."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    d = tmp_path_factory.mktemp("harness")
    for name, writing, delimiter in (("mc_plain", "plain", " "), ("mc_context", "context", "")):
        data = write_jsonl(d / f"{name}.jsonl", rows(writing))
        (d / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data, cache=d / "cache",
                                                         delimiter=delimiter))
    out = simple_evaluate(model="hf", model_args=f"pretrained={hf_llama},dtype=float32",
                          tasks=["mc_plain", "mc_context"], task_manager=TaskManager(include_path=str(d)),
                          device="cpu", batch_size=1, log_samples=True)
    found = {}
    for name in ("mc_plain", "mc_context"):
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        found[name] = {"acc": out["results"][name]["acc,none"],
                       "acc_norm": out["results"][name]["acc_norm,none"],
                       "logprobs": [[float(r[0][0]) for r in s["resps"]] for s in samples]}
    return found


def shardzoo_mc(hf_dir, data, out, *flags) -> dict:
    assert cli.main(["eval", "--hf", hf_dir, "--task", "multiple-choice", "--data", data, "--out", str(out),
                     *flags]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def shardzoo(hf_llama, tmp_path_factory):
    """shardzoo's metrics on the items written each of three ways (default delimiter)."""
    d = tmp_path_factory.mktemp("shardzoo")
    return {w: shardzoo_mc(hf_llama, write_jsonl(d / f"{w}.jsonl", rows(w)), d / f"{w}.json")
            for w in ("plain", "context", "choices")}


def test_loglikelihoods_and_accuracies_equal_the_harness(harness, shardzoo):
    got = shardzoo["plain"]
    assert got["target_delimiter"] == " "
    for name in ("mc_plain", "mc_context"):
        want = harness[name]
        diff = np.abs(np.asarray(got["logprobs"]) - np.asarray(want["logprobs"])).max()
        assert diff < 1e-4, (name, diff)
        assert (got["acc"], got["acc_norm"]) == (want["acc"], want["acc_norm"]), name
    assert got["acc"] != got["acc_norm"]  # the items tell the two apart


def test_the_space_written_either_way_gives_the_same_numbers(shardzoo):
    plain = shardzoo["plain"]
    for writing in ("context", "choices"):
        got = shardzoo[writing]
        assert np.abs(np.asarray(got["logprobs"]) - np.asarray(plain["logprobs"])).max() < 1e-5, writing
        assert (got["acc"], got["acc_norm"]) == (plain["acc"], plain["acc_norm"]), writing


def test_the_old_conventions_give_other_numbers(harness, shardzoo, hf_llama, tmp_path):
    """What the items would score under the old conventions: dividing by the choice's length
    with its space (as for the space written in the choices), and no delimiter at all."""
    lls = [np.asarray(lp) for lp in shardzoo["choices"]["logprobs"]]
    with_space = [np.asarray([len(c) + 1.0 for c in choices]) for _, choices, _ in ITEMS]
    old_norm = np.mean([int(np.argmax(lp / n)) == label
                        for lp, n, (_, _, label) in zip(lls, with_space, ITEMS, strict=True)])
    assert old_norm != harness["mc_plain"]["acc_norm"]  # 0.3 against 0.8
    joined = shardzoo_mc(hf_llama, write_jsonl(tmp_path / "plain.jsonl", rows("plain")), tmp_path / "m.json",
                         "--target-delimiter", "")  # "A:blue": other tokens, other numbers
    assert joined["target_delimiter"] == ""
    assert np.abs(np.asarray(joined["logprobs"]) - np.asarray(shardzoo["plain"]["logprobs"])).max() > 0.1
    assert (joined["acc"], joined["acc_norm"]) != (shardzoo["plain"]["acc"], shardzoo["plain"]["acc_norm"])


def test_target_delimiter_only_with_multiple_choice(hf_llama, tmp_path, capsys):
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    assert cli.main(["eval", "--hf", hf_llama, "--data", data, "--target-delimiter", " "]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--target-delimiter goes with --task multiple-choice" in err
