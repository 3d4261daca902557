"""What every family's parity test checks the same way against transformers, once: greedy
decoding by the Program equals transformers' ``generate``, and an export loads in transformers
as the same model. Tests take the ``parity`` fixture."""

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from shardzoo.sharding import get_rules, make_mesh
from shardzoo.train.hf_io import load_hf
from shardzoo.train.program import Program


class Parity:
    @staticmethod
    def greedy_matches(path, model, prompt, new_tokens: int = 16) -> None:
        """The Program's greedy tokens on one device equal transformers' over ``new_tokens``,
        and the continuation varies (not one repeated token)."""
        with torch.no_grad():
            want = model.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0,
                                  min_new_tokens=new_tokens).numpy()
        mesh, rules = make_mesh("data=1", devices=jax.devices()[:1]), get_rules("fsdp")
        _, config, params = load_hf(path, mesh=mesh, rules=rules)
        got = Program(config, rules, mesh).generate(params, prompt, max_new_tokens=new_tokens)
        assert len(set(want[0, prompt.shape[1]:].tolist())) > 3  # a varied continuation
        np.testing.assert_array_equal(got, want)

    @staticmethod
    def export_matches(out_dir, model, tokens, ref, tol: float) -> None:
        """The exported directory loads in transformers as the model's class with its state dict
        (copied values: exactly) and its logits (within ``tol``)."""
        back = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
        assert type(back) is type(model)
        want, got = model.state_dict(), back.state_dict()
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
        with torch.no_grad():
            logits = back(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        np.testing.assert_allclose(logits, ref, atol=tol, rtol=0)


@pytest.fixture(scope="session")
def parity():
    return Parity
