"""Preference pairs from the embedded corpus (the standard library's source), for a DPO run of the
zoo's tiny model on this CPU, offline:

    python examples/dpo_stdlib.py --out OUT            # writes OUT/pairs.jsonl
    shardzoo train --out OUT/sft --steps 100           # llama-tiny on the embedded corpus
    shardzoo train --task dpo --init-from OUT/sft --data OUT/pairs.jsonl --out OUT/dpo \\
        --steps 60 --batch-size 16 --seq-len 128 --max-prompt-length 96 --max-completion-length 32 \\
        --lr 1e-3 --warmup-steps 5 --eval-fraction 0.1

Each pair: the prompt is a few lines of a standard-library file ending with a ``def`` line, the
chosen completion the line that really follows it, the rejected one a line from elsewhere in the
corpus. ``rewards/accuracies`` (the share of pairs where the policy's log-ratio favours the real
line) rises as the policy learns to prefer it.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from shardzoo.data.corpus import stdlib_files


def make_pairs(count: int, seed: int = 0, context: int = 3) -> list[dict]:
    """``count`` pairs {prompt, chosen, rejected} from the standard library's ``def`` lines."""
    lines = []
    for path in stdlib_files():
        lines += [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
    rng = random.Random(seed)
    starts = [i for i, line in enumerate(lines[:-1]) if line.lstrip().startswith("def ") and i >= context
              and lines[i + 1].strip()]
    rng.shuffle(starts)
    pairs = []
    for i in starts[:count]:
        chosen = lines[i + 1]
        rejected = chosen
        while rejected == chosen or not rejected.strip():
            rejected = lines[rng.randrange(len(lines))]
        pairs.append({"prompt": "\n".join(lines[i - context: i + 1]) + "\n", "chosen": chosen + "\n",
                      "rejected": rejected + "\n"})
    return pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--pairs", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pairs.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(pair) + "\n" for pair in make_pairs(args.pairs, args.seed))
    print(f"wrote {args.pairs} preference pairs to {path}")


if __name__ == "__main__":
    main()
