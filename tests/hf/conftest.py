"""What every family's parity test checks the same way against transformers, once: greedy
decoding by the Program equals transformers' ``generate``, and an export loads in transformers
as the same model. Tests take the ``parity`` fixture."""

import functools
import json
import os

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.io.hf_io import load_hf
from shardzoo.train.program import Program

# The tiny models run one op at a time: torch's second thread only spins against the other
# test worker and XLA's compiles (measured: a 16-token generate 2.5 s -> 0.2 s on a loaded machine).
torch.set_num_threads(1)


@functools.lru_cache(maxsize=4)
def _load_one_device(path: str):
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    return (mesh, *load_hf(path, mesh=mesh, rules=get_rules("fsdp")))


class Parity:
    @staticmethod
    def load(path):
        """``(mesh, module, config, params)``: the HF directory ``path`` loaded on one device under
        fsdp, once for a family's proofs in a row (a fixture's directory is written once)."""
        return _load_one_device(str(path))

    @staticmethod
    def greedy_matches(path, model, prompt, new_tokens: int = 16) -> None:
        """The Program's greedy tokens on one device equal transformers' over ``new_tokens``,
        and the continuation varies (not one repeated token)."""
        with torch.no_grad():
            want = model.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0,
                                  min_new_tokens=new_tokens).numpy()
        mesh, _, config, params = Parity.load(path)
        got = Program(config, get_rules("fsdp"), mesh).decoding.generate(params, prompt, max_new_tokens=new_tokens)
        assert len(set(want[0, prompt.shape[1]:].tolist())) > 3  # a varied continuation
        np.testing.assert_array_equal(got, want)

    @staticmethod
    def export_matches(out_dir, model, tokens, ref, tol: float) -> None:
        """The exported directory loads in transformers as the model's class with its state dict
        (copied values: exactly) and its logits (within ``tol``). Returns the loaded model."""
        back = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
        assert type(back) is type(model)
        want, got = model.state_dict(), back.state_dict()
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
        with torch.no_grad():
            logits = back(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        np.testing.assert_allclose(logits, ref, atol=tol, rtol=0)
        return back

    @staticmethod
    def trains_from_hf_dir(tmp_path, model, tokens, lora: bool, tol: float):
        """``shardzoo train --init-from`` the model's HF directory (with a 128-id BPE tokenizer
        trained here) under fsdp on 8 devices, with or without LoRA adapters: the loss falls;
        ``export-hf`` (merging the adapters) loads in transformers as the model's class and
        computes what the run's checkpoint computes (within ``tol``); training changed it.
        Returns the run's config."""
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        from shardzoo import cli
        from shardzoo.train.io.sources import load_model_and_params
        from shardzoo.train.metrics import read_metrics

        hf_dir, run, out = str(tmp_path / "hf"), str(tmp_path / "run"), str(tmp_path / "export")
        model.save_pretrained(hf_dir)
        text = [f"the {w} sat on the mat and the dog ran to the {w}." for w in ("cat", "bird", "fox", "cow")]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator(text * 10, trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "<s>", "</s>"]))
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                eos_token="</s>").save_pretrained(hf_dir)
        data = str(tmp_path / "data.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps({"text": line}) + "\n" for line in text * 20)
        extra = ["--lora-rank", "4"] if lora else []
        assert cli.main(["train", "--init-from", hf_dir, "--data", data, "--out", run, "--steps", "12",
                         "--batch-size", "8", "--seq-len", "16", "--lr", "3e-2" if lora else "3e-3",
                         "--warmup-steps", "0", "--save-every", "12", "--eval-every", "0", "--log-every", "1",
                         "--rules", "fsdp", "--mesh", "fsdp=8", *extra]) == 0
        losses = [r["loss"] for r in read_metrics(os.path.join(run, "metrics.jsonl")) if "loss" in r]
        assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.2, losses
        assert cli.main(["export-hf", run, out, *(["--merge-lora"] if lora else [])]) == 0
        back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        assert type(back) is type(model)
        module, config, params, _ = load_model_and_params(run)
        assert config.lora_rank == (4 if lora else 0)
        got = np.asarray(jax.jit(lambda p, x: module.apply({"params": p}, x))(params, tokens))
        with torch.no_grad():
            want = back(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
            before = model.eval()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        np.testing.assert_allclose(want, got, atol=tol, rtol=0)
        assert np.abs(got - before).max() > 1e-3  # training changed the model
        return config


@pytest.fixture(scope="session")
def parity():
    return Parity
