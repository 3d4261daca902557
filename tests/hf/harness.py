"""What the tests of tests/hf build the same way, once: the tokens and the tolerance, a tiny HF
model with random weights (each family passes how to draw them: the draw decides which mechanisms
its tests can see), its saved directory with the reference logits, shardzoo's logits of it on a
mesh, the parity on one device and under fsdp_tp, decoding from the cache, config.json rewrites,
and the command line's tiny Llama and BPE tokenizer. The checks ``test_hf_families`` shares too
(greedy decoding, export) are conftest's ``parity`` fixture. A test module imports it with
``sys.path.insert(0, os.path.dirname(__file__))`` then ``from harness import ...``.
"""

import contextlib
import functools
import json
import os
import tempfile

import jax
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from shardzoo.models.decode import decode_step
from shardzoo.models.hf import export_hf, load_hf_config
from shardzoo.sharding import get_rules, make_mesh
from shardzoo.sharding.partition import activate
from shardzoo.train.io.hf_io import load_hf

TOKENS = np.random.default_rng(0).integers(0, 128, size=(4, 16)).astype(np.int32)
TOL = 1e-4  # float32 logits against transformers'
Q_SPEC = jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)  # a stacked q kernel under fsdp_tp
LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2)  # the command line's tiny Llama


def hf_logits(model, tokens=TOKENS, **kwargs) -> np.ndarray:
    """transformers' logits of ``tokens``."""
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long), **kwargs).logits.numpy()


def is_norm(name, p) -> bool:
    """The weights ``near_one`` draws near 1 unless a family says otherwise: a name with "norm"."""
    return "norm" in name


def near_one(is_scale=is_norm, std: float = 0.15, scale_std: float = 0.1):
    """A draw for ``randomize``: the weights ``is_scale(name, p)`` picks 1 + ``scale_std`` x normal,
    every other one (biases too, so a misplaced bias shows) ``std`` x normal."""
    return lambda name, p: 1 + scale_std * torch.randn_like(p) if is_scale(name, p) else std * torch.randn_like(p)


def randomize(model, draw=near_one(), buffers=None, seed: int | None = None):
    """``model`` with every parameter redrawn in place, in order, as ``draw(name, p)``, then each
    buffer for which ``buffers(name, b)`` is not None; after ``torch.manual_seed(seed)`` if given."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(draw(name, p))
        for name, b in model.named_buffers() if buffers else ():
            value = buffers(name, b)
            if value is not None:
                b.copy_(value)
    return model


def correction_bias(name, b):
    """A draw for ``randomize``'s buffers: DeepSeek-V3 routing's correction bias, large enough to
    move the experts chosen."""
    return 0.3 * torch.randn_like(b) if "e_score_correction_bias" in name else None


def mamba_draw(name, p):
    """A draw for ``randomize`` of Mamba2 layers: A = -exp(A_log) in [-2.5, -0.5], dt_bias around
    0, norm scales near 1, the rest 0.2 x normal."""
    if "A_log" in name:
        return torch.log(torch.rand_like(p) * 2 + 0.5)
    if "dt_bias" in name:
        return 0.5 * torch.randn_like(p)
    if "norm" in name:
        return 1 + 0.1 * torch.randn_like(p)
    return 0.2 * torch.randn_like(p)


def randomized(hf_config, seed: int, draw=near_one(), buffers=None):
    """transformers' model of ``hf_config`` (eager attention, eval mode) built after
    ``torch.manual_seed(seed)``, then randomized by ``draw`` and ``buffers``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    return randomize(model, draw, buffers)


def tiny_llama():
    """The tiny Llama of LLAMA (eager attention, eval mode), every weight 0.15 x normal (seed 0)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    return model


def bpe_tokenizer(path, text) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most 128 ids trained on ``text`` ten times over, <unk>=0, <s>=1,
    </s>=2 (the tiny configs' bos and eos), saved at ``path`` as transformers' fast tokenizer."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(text) * 10, trainers.BpeTrainer(vocab_size=128, special_tokens=["<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def saved(model, path, tokens=TOKENS, reference=None, **forward):
    """(``path`` as a string, ``model``, the reference logits of ``tokens``, ``forward`` the call's
    keywords) once ``model`` is saved at ``path``; the reference from ``reference(path)``'s model
    where given, else ``model``'s."""
    model.save_pretrained(path)
    return str(path), model, hf_logits(reference(path) if reference else model, tokens, **forward)


def config_of(hf_config):
    """shardzoo's reading of an HF config (a transformers config, or config.json's dict)."""
    with tempfile.TemporaryDirectory() as d:
        if isinstance(hf_config, dict):
            with open(f"{d}/config.json", "w") as f:
                json.dump(hf_config, f)
        else:
            hf_config.save_pretrained(d)
        return load_hf_config(d)


def rewritten(src, dst, drop=(), **changes) -> str:
    """``dst`` holding the HF directory ``src`` (its safetensors linked), or a transformers config
    ``src`` saved alone, with config.json given ``changes`` and rid of the keys ``drop``."""
    os.makedirs(dst, exist_ok=True)
    if isinstance(src, (str, os.PathLike)):
        for f in os.listdir(src):
            if f.endswith(".safetensors"):
                os.symlink(os.path.join(src, f), os.path.join(dst, f))
    else:
        src.save_pretrained(dst)
        src = dst
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({k: v for k, v in hf.items() if k not in drop} | changes, f)
    return str(dst)


def one_device():
    """A mesh of the first device alone."""
    return make_mesh("data=1", devices=jax.devices()[:1])


def forward(module, collections: tuple | None = None):
    """``module``'s forward (returning (logits, the ``collections`` it writes) where given), jitted
    once per module: equal modules (the same config and placement, loaded again) share it, so a
    file's tests that run a model on edited weights or one test after another compile it once."""
    try:
        return _forward(module, collections)
    except TypeError:  # a field that cannot be hashed: a program of its own
        return _forward.__wrapped__(module, collections)


@functools.lru_cache(maxsize=32)
def _forward(module, collections):
    if collections is not None:
        return jax.jit(lambda p, t: module.apply({"params": p}, t, mutable=list(collections)))
    return jax.jit(lambda p, t: module.apply({"params": p}, t))


def apply(module, params, mesh, tokens=TOKENS) -> np.ndarray:
    """shardzoo's logits of ``tokens``, jitted with ``mesh`` current."""
    with activate(mesh):
        return np.asarray(forward(module)(params, tokens))


def apply_mutable(module, params, mesh=None, collections=(), tokens=TOKENS):
    """(logits, the ``collections`` the call writes: metrics, losses), jitted with ``mesh``
    current (None: jax's default device)."""
    fn = forward(module, tuple(collections))
    with activate(mesh) if mesh is not None else contextlib.nullcontext():
        out, state = fn(params, tokens)
    return np.asarray(out), state


def edit(params, suffix, fn):
    """``params`` with ``fn`` applied to each leaf whose path (``jax.tree_util.keystr``) ends in ``suffix``."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: fn(x) if jax.tree_util.keystr(p).endswith(suffix) else x, params)


def stacked_q(config, params):
    """The q kernel of the first scanned position (``layers`` or ``layers/sub_0``)."""
    for prefix, _, stacked in config.param_layout():
        if stacked:
            tree = params
            for key in prefix:
                tree = tree[key]
            return tree["attn"]["q"]["kernel"]
    raise AssertionError("nothing scanned")


def load_ep(path, scan_layers: bool = True, **overrides):
    """The HF directory ``path`` under ep on 8 devices (expert=4, data=2), with ``overrides`` of
    its config (the dispatch and its capacity factor): (module, config, params, mesh)."""
    mesh = make_mesh("expert=4,data=2")
    module, config, params = load_hf(path, mesh=mesh, rules=get_rules("ep"), scan_layers=scan_layers,
                                     overrides=overrides or None)
    return module, config, params, mesh


def fsdp_tp_parity(path, ref, q=stacked_q, mesh: str = "data=2,fsdp=2,tensor=2", rules: str = "fsdp_tp"):
    """shardzoo's logits of the HF directory ``path`` on one device (fsdp rules), then on 8
    (``rules`` over ``mesh``) with the q kernel ``q(config, params)`` split over fsdp and tensor,
    each equal to ``ref`` within TOL. Returns (one device's logits, the 8 devices')."""
    one = one_device()
    module, _, params = load_hf(path, mesh=one, rules=get_rules("fsdp"))
    got = apply(module, params, one)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    mesh = make_mesh(mesh)
    module, config, params = load_hf(path, mesh=mesh, rules=get_rules(rules))
    assert q(config, params).sharding.spec == Q_SPEC
    sharded = apply(module, params, mesh)
    np.testing.assert_allclose(sharded, ref, atol=TOL, rtol=0)
    return got, sharded


def decoded(module, params, cache, tokens, prefill: int) -> np.ndarray:
    """shardzoo's logits of ``tokens`` decoded from ``cache`` (a fresh one): a prefill of the
    first ``prefill`` tokens, then one step a token."""
    step = jax.jit(lambda p, c, t, pos: decode_step(module, p, c, t, pos))
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    logits, cache = step(params, cache, tokens[:, :prefill], positions[:, :prefill])
    got = [np.asarray(logits)]
    for i in range(prefill, tokens.shape[1]):
        logits, cache = step(params, cache, tokens[:, i:i + 1], positions[:, i:i + 1])
        got.append(np.asarray(logits))
    return np.concatenate(got, axis=1)


def left_padded_generates_alone(program, params, tokens=TOKENS) -> None:
    """A batch of a short and a long prompt (the short one left-padded, its padding segment 0)
    continues each row as that row continues alone."""
    prompt = tokens[:2, :8].copy()
    prompt[0, :5] = 0  # row 0: a prompt of 3 tokens, left-padded
    both = program.decoding.generate(params, prompt, np.array([3, 8]), max_new_tokens=8)
    alone = program.decoding.generate(params, tokens[:1, 5:8], max_new_tokens=8)
    np.testing.assert_array_equal(both[0, 8:], alone[0, 3:])
    np.testing.assert_array_equal(both[1], program.decoding.generate(params, prompt[1:], max_new_tokens=8)[0])


# ---------------------------------------------------- the three proofs of a family that only combines
# A test module that builds its families in a module-scoped ``built`` fixture ((HF dir, HF model,
# reference logits), one per config) imports these three: pytest collects them there, on its ``built``.
def test_logits_match_on_one_device(built, parity):
    """shardzoo's logits of the HF directory on one device equal transformers' (``TOL``)."""
    path, model, ref = built
    mesh, module, _, params = parity.load(path)
    got = apply(module, params, mesh)
    print(f"{model.config.model_type}: max |logit diff| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_greedy_generate_matches_transformers(built, parity):
    """Greedy decoding equals transformers' ``generate`` (conftest's ``parity``)."""
    path, model, _ = built
    parity.greedy_matches(path, model, TOKENS[:1, :8])


def test_export_round_trip_loads_the_same_model(built, tmp_path, parity):
    """An export under the family's own model_type loads in transformers with the same logits."""
    path, model, ref = built
    _, _, config, params = parity.load(path)
    kind = model.config.model_type
    assert export_hf(config, params, str(tmp_path), family=kind)["model_type"] == kind
    parity.export_matches(tmp_path, model, TOKENS, ref, TOL)
