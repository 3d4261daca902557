"""Fine-tune a Hugging Face model on prompt/completion pairs with shardzoo, then export it back.

    python examples/finetune_hf.py --hf-dir HF_DIR --data train.jsonl --out OUT --steps 200
    python examples/finetune_hf.py --make-tiny-demo --out OUT --steps 30   # builds its own inputs

HF_DIR holds config.json, safetensors and tokenizer.json (e.g. a Hub model saved locally);
train.jsonl has one {"prompt": ..., "completion": ...} object per line. The loss is taken on the
completion tokens only. Everything runs offline on local files:

1. ``shardzoo train --init-from HF_DIR``, which takes the HF model's config, weights and
   tokenizer from HF_DIR, writing OUT/run;
2. ``shardzoo export-hf OUT/run OUT/hf``: config.json, safetensors and the tokenizer files,
   loadable with ``AutoModelForCausalLM.from_pretrained("OUT/hf")``.

``--make-tiny-demo`` first writes OUT/demo/: a tiny random Llama (transformers), a byte-level
BPE tokenizer trained on the demo text (tokenizers) and a jsonl of arithmetic questions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def make_tiny_demo(out: str, seed: int = 0) -> tuple[str, str]:
    """Write OUT/demo/{hf/, train.jsonl}; return (hf_dir, data_path)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    demo = os.path.join(out, "demo")
    hf_dir, data = os.path.join(demo, "hf"), os.path.join(demo, "train.jsonl")
    rng = random.Random(seed)
    rows = []
    for _ in range(256):
        a, b = rng.randrange(7), rng.randrange(6)
        rows.append({"prompt": f"What is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]}?",
                     "completion": f" {NUMBER_WORDS[a + b]}."})
    os.makedirs(demo, exist_ok=True)
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([r["prompt"] + r["completion"] for r in rows], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(hf_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=-(-len(fast) // 64) * 64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, bos_token_id=fast.bos_token_id,
                         eos_token_id=fast.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(hf_dir)
    return hf_dir, data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-dir", help="an HF model dir (config.json, safetensors, tokenizer.json)")
    p.add_argument("--data", help="jsonl with prompt and completion columns")
    p.add_argument("--out", required=True, help="output dir: run/ (shardzoo) and hf/ (exported)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rules", default=None, help="rule table (default: the trainer's)")
    p.add_argument("--mesh", default=None, help="mesh spec (default: the trainer's)")
    p.add_argument("--make-tiny-demo", action="store_true",
                   help="build a tiny random Llama, its tokenizer and a data set in OUT/demo")
    args = p.parse_args(argv)
    if args.make_tiny_demo:
        args.hf_dir, args.data = make_tiny_demo(args.out)
    elif not (args.hf_dir and args.data):
        p.error("give --hf-dir and --data, or --make-tiny-demo")

    from shardzoo import cli

    run, exported = os.path.join(args.out, "run"), os.path.join(args.out, "hf")
    sharding = [x for flag, v in (("--rules", args.rules), ("--mesh", args.mesh)) if v
                for x in (flag, v)]
    train = [
        "train", "--init-from", args.hf_dir,
        "--data", args.data, "--prompt-column", "prompt", "--completion-column", "completion",
        "--out", run, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--seq-len", str(args.seq_len), "--lr", str(args.lr),
        "--warmup-steps", str(max(1, args.steps // 10)),
        "--log-every", "1", "--save-every", "0", *sharding,
    ]
    status = cli.main(train)
    if status:
        return status
    status = cli.main(["export-hf", run, exported])
    if status:
        return status
    with open(os.path.join(run, "metrics.jsonl")) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; "
          f'load with AutoModelForCausalLM.from_pretrained("{exported}")')
    return 0


if __name__ == "__main__":
    sys.exit(main())
