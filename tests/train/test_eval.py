"""``shardzoo eval``: loss over a whole split (a last partial batch included) equals the mean of
per-token losses computed directly, on one device and under fsdp on 8; multiple-choice
log-likelihoods equal transformers' for a tiny random HF Llama; a model trained on the answers
picks every one; bad input is one line and exit 2. Tolerances (fp32): 1e-5 on losses, 1e-4 on
log-likelihoods against torch."""

import json

import jax
import numpy as np
import pytest

from shardzoo import cli
from shardzoo.data import DataConfig, load_source, load_tokenizer, make_eval_dataset
from shardzoo.data.packing import batch_arrays, pack_documents, tokenize_documents
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.evaluate import evaluate_lm
from shardzoo.train.program import Program

QA = [("What color is the sky?", "blue"), ("What do cows drink?", "milk"), ("Where do fish live?", "water"),
      ("What is frozen water?", "ice"), ("What do bees make?", "honey"), ("What shines at night?", "moon")]
TINY_FLAGS = ["--model", "llama-tiny"] + [a for kv in ("hidden_size=32", "intermediate_size=64",
                                                      "num_hidden_layers=1", "num_attention_heads=4",
                                                      "num_key_value_heads=4") for a in ("--override", kv)]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def mc_rows():
    """Each question with its answer and two other questions' answers, the right one at i % 3."""
    answers = [a for _, a in QA]
    rows = []
    for i, (q, _) in enumerate(QA):
        choices = [" " + answers[(i + k) % len(QA)] for k in (0, 2, 4)]
        r = i % 3
        rows.append({"context": f"Q: {q} A:", "choices": choices[-r:] + choices[:-r] if r else choices,
                     "label": r})
    return rows


def documents(data):
    return tokenize_documents(load_source(data), load_tokenizer("byte"), "text")


def direct_lm_metrics(module, params, docs, seq_len):
    """Loss and token accuracy of every packed row of ``docs`` at once, from the logits (numpy)."""
    pad = load_tokenizer("byte").pad_id
    rows = pack_documents(docs, seq_len, pad)
    batch = batch_arrays(rows, np.arange(len(rows)), pad)
    logits = np.asarray(jax.jit(module.apply)({"params": jax.device_get(params)}, batch["inputs"],
                                              positions=batch["positions"], segment_ids=batch["segment_ids"]),
                        np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    token_loss = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    w = batch["weights"]
    correct = logits.argmax(-1) == batch["targets"]
    return len(rows), {"loss": (token_loss * w).sum() / w.sum(), "token_accuracy": (correct * w).sum() / w.sum(),
                       "tokens": int(w.sum())}


def test_whole_split_equals_direct_mean_on_one_device_and_fsdp(tiny_lm, tmp_path):
    module, config = tiny_lm
    texts = [f"document {i}: " + "abcdefghij"[: 3 + i % 7] * (1 + i % 3) for i in range(23)]
    data = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    seq_len, batch_size = 16, 8
    one = Program(config, get_rules("dp"), make_mesh("", devices=jax.devices()[:1]),
                  batch_size=batch_size, seq_len=seq_len)
    params = one.init(jax.random.key(0)).params
    num_rows, want = direct_lm_metrics(module, params, documents(data), seq_len)
    assert num_rows % batch_size  # the last batch is partial
    for rules, mesh in (("dp", one.mesh), ("fsdp", make_mesh("fsdp=8"))):
        program = one if rules == "dp" else Program(config, get_rules(rules), mesh,
                                                    batch_size=batch_size, seq_len=seq_len)
        batches = make_eval_dataset(DataConfig(data=data), load_tokenizer("byte"), seq_len, batch_size,
                                    mesh=mesh, rules=program.rules)
        got = evaluate_lm(program, jax.device_put(params, program.shardings.params), batches)
        assert got["batches"] == -(-num_rows // batch_size)
        assert got["tokens"] == want["tokens"]
        assert abs(got["loss"] - want["loss"]) < 1e-5, rules
        assert abs(got["token_accuracy"] - want["token_accuracy"]) < 1e-5, rules
        assert abs(got["perplexity"] - np.exp(want["loss"])) < 1e-5 * np.exp(want["loss"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-layer llama-tiny trained 100 steps on "Q: ... A: answer" texts (each 4 times), a
    quarter of them held out: (run dir, data dir)."""
    d = tmp_path_factory.mktemp("qa")
    write_jsonl(d / "train.jsonl", [{"text": f"Q: {q} A: {a}"} for q, a in QA] * 4)
    write_jsonl(d / "mc.jsonl", mc_rows())
    run = str(d / "run")
    assert cli.main(["train", *TINY_FLAGS, "--data", str(d / "train.jsonl"), "--eval-fraction", "0.25",
                     "--seed", "3", "--batch-size", "8", "--seq-len", "32", "--steps", "100", "--lr", "1e-2",
                     "--warmup-steps", "5", "--log-every", "100", "--eval-every", "0", "--out", run]) == 0
    return run, d


def test_a_model_trained_on_the_answers_picks_every_one(trained, capsys):
    run, d = trained
    out = d / "mc_metrics.json"
    assert cli.main(["eval", "--checkpoint", run, "--task", "multiple-choice", "--data", str(d / "mc.jsonl"),
                     "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert (metrics["acc"], metrics["acc_norm"], metrics["rows"]) == (1.0, 1.0, len(QA))
    assert "acc 1.0000" in capsys.readouterr().out


def test_eval_split_of_a_run_is_its_held_out_documents(trained, tmp_path):
    """``--split eval`` with the run's data, seed, fraction and seq_len (all defaulted from the
    run) equals the direct mean over the held-out documents, and the trainer's own final eval."""
    from shardzoo.data.packing import split_documents
    from shardzoo.train.io.sources import load_model_and_params

    run, d = trained
    out = tmp_path / "m.json"
    assert cli.main(["eval", "--checkpoint", run, "--split", "eval", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert (got["seq_len"], got["seed"], got["eval_fraction"], got["mesh"]) == (32, 3, 0.25, "data=1,stage=1,fsdp=8,expert=1,sequence=1,context=1,tensor=1")
    module, _, params, _ = load_model_and_params(run)
    held_out = split_documents(documents(str(d / "train.jsonl")), 0.25, 3)[1]
    _, want = direct_lm_metrics(module, params, held_out, 32)
    assert got["tokens"] == want["tokens"]
    assert abs(got["loss"] - want["loss"]) < 1e-5
    assert abs(got["token_accuracy"] - want["token_accuracy"]) < 1e-5
    with open(f"{run}/metrics.jsonl") as f:
        trainer_eval = [r for r in map(json.loads, f) if "eval_loss" in r][-1]
    assert abs(got["loss"] - trainer_eval["eval_loss"]) < 1e-5


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random HF Llama dir whose tokenizer (byte-level BPE) starts every text with <s>."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("hf_llama")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [f"Q: {q} A: {a}" for q, a in QA]
    tok.train_from_iterator(texts * 10, trainers.BpeTrainer(
        vocab_size=128, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    # the vocabulary rounded up to a multiple of 8, so that tensor=2 divides it
    config = LlamaConfig(vocab_size=-(-len(fast) // 8) * 8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    model.save_pretrained(path)
    return str(path), model, fast


def test_choice_loglikelihoods_equal_transformers(hf_llama, tmp_path):
    import torch

    path, model, tokenizer = hf_llama
    rows = mc_rows()
    rows[0]["context"] = "Q: What color is the sky? A: "  # with the choices' spaces: one delimiter
    data = write_jsonl(tmp_path / "mc.jsonl", rows)
    out = tmp_path / "m.json"
    assert cli.main(["eval", "--hf", path, "--task", "multiple-choice", "--data", data, "--batch-size", "8",
                     "--rules", "fsdp_tp", "--mesh", "fsdp=4,tensor=2",  # logits split over the vocabulary
                     "--out", str(out)]) == 0  # 18 sequences in 3 batches, the last one partial
    got = json.loads(out.read_text())["logprobs"]
    for row, scores in zip(rows, got, strict=True):
        context = row["context"].rstrip(" ")
        head = tokenizer(context)["input_ids"]
        for choice, score in zip(row["choices"], scores, strict=True):
            whole = tokenizer(context + " " + choice.lstrip(" "))["input_ids"]
            assert whole[0] == 1 and whole[: len(head)] == head
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
            want = sum(float(logp[t - 1, whole[t]]) for t in range(len(head), len(whole)))
            assert abs(score - want) < 1e-4, (row["context"], choice)


def test_bad_input_is_one_line_and_exit_2(hf_llama, tmp_path, capsys):
    path = hf_llama[0]
    no_label = write_jsonl(tmp_path / "no_label.jsonl", [{"context": "a", "choices": ["b", "c"]}])
    bad_label = write_jsonl(tmp_path / "bad_label.jsonl", [{"context": "a", "choices": ["b", "c"], "label": 2}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    mc = ["--task", "multiple-choice", "--hf", path, "--data"]
    for argv, needle in ((mc + [no_label], "no column 'label'"), (mc + [bad_label], "row 1: label 2"),
                         (mc + [str(empty)], "empty"),
                         (["--hf", path, "--data", no_label], "no column 'text'")):
        assert cli.main(["eval", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    for argv, needle in ((["--data", no_label], "one of the arguments --checkpoint --hf is required"),
                         (["--hf", path, "--checkpoint", path, "--data", no_label], "not allowed with")):
        with pytest.raises(SystemExit) as e:
            cli.main(["eval", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


def test_the_trainers_final_eval_loss_is_the_whole_split_that_eval_scores(tmp_path):
    """The README's promise on a split of several batches and --eval-steps 1: the periodic
    evaluation samples one batch (and is named so), the final one scores every held-out row,
    equal to ``shardzoo eval --split eval`` within 1e-5."""
    write_jsonl(tmp_path / "train.jsonl", [{"text": f"Q: {q} A: {a}"} for q, a in QA] * 4)
    run, out = str(tmp_path / "run"), tmp_path / "m.json"
    assert cli.main(["train", *TINY_FLAGS, "--data", str(tmp_path / "train.jsonl"), "--eval-fraction", "0.5",
                     "--batch-size", "8", "--seq-len", "8", "--steps", "4", "--eval-every", "2",
                     "--eval-steps", "1", "--save-every", "0", "--out", run]) == 0
    assert cli.main(["eval", "--checkpoint", run, "--split", "eval", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["batches"] > 1  # more than --eval-steps
    with open(f"{run}/metrics.jsonl") as f:
        records = list(map(json.loads, f))
    assert [r["step"] for r in records if "eval_loss_sampled" in r] == [2]
    final = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in final] == [4]
    assert abs(got["loss"] - final[0]["eval_loss"]) < 1e-5
    assert abs(got["token_accuracy"] - final[0]["eval_accuracy"]) < 1e-5
