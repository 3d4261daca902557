"""Tiny HF checkpoints, a BPE tokenizer with a chat template, and preference pairs that both TRL
and shardzoo read (shared by the DPO tests)."""

import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
WORDS = "the cat sat on a mat and dog ran far away quickly what color is sky blue green red yes no".split()

TEXT_PAIRS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green and far away."},
    {"prompt": "What sat on the mat?", "chosen": " The cat.", "rejected": " A dog ran."},
    {"prompt": "Say yes", "chosen": " yes yes", "rejected": " no"},
    {"prompt": "The dog ran", "chosen": " far away quickly.", "rejected": " on a mat."},
]
CHAT_PAIRS = [  # conversational, the last one with an implicit prompt handled by the test
    {"prompt": [{"role": "user", "content": "What color is the sky?"}],
     "chosen": [{"role": "assistant", "content": "It is blue."}],
     "rejected": [{"role": "assistant", "content": "It is green."}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the cat?"}],
     "chosen": [{"role": "assistant", "content": "On the mat."}],
     "rejected": [{"role": "assistant", "content": "The cat ran far away quickly."}]},
    {"prompt": [{"role": "user", "content": "Say yes"}],
     "chosen": [{"role": "assistant", "content": "yes"}],
     "rejected": [{"role": "assistant", "content": "no no no"}]},
    {"prompt": [{"role": "user", "content": "The dog?"}, {"role": "assistant", "content": "ran"},
                {"role": "user", "content": "where?"}],
     "chosen": [{"role": "assistant", "content": "far away"}],
     "rejected": [{"role": "assistant", "content": "on a mat"}]},
]


def save_tokenizer(directory) -> PreTrainedTokenizerFast:
    """A byte-level BPE (vocab < 128) with bos/eos/pad and the chat template, saved to ``directory``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(WORDS)] * 4 + [json.dumps(TEXT_PAIRS), json.dumps(CHAT_PAIRS)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(directory))
    return fast


def save_llama(directory, vocab: int, seed: int, tokenizer=None) -> LlamaForCausalLM:
    """A tiny random Llama (2 layers) saved to ``directory`` in float32."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # larger weights than the default init: log-probs that differ between models
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(str(directory))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return model


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def vocab_of(directory) -> int:
    with open(os.path.join(directory, "tokenizer.json")) as f:
        data = json.load(f)
    return len(data["model"]["vocab"]) + len([t for t in data["added_tokens"] if t["id"] >= len(data["model"]["vocab"])])
