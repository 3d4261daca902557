"""GRPO with a verifiable reward on this CPU, offline: the zoo's tiny model, trained first on the
embedded corpus (the standard library's source), learns to write more of a given list of words.

    python examples/grpo_words.py prompts --out OUT           # writes OUT/prompts.jsonl
    shardzoo train --out OUT/sft --steps 150                  # llama-tiny on the embedded corpus
    shardzoo train --task grpo --init-from OUT/sft --data OUT/prompts.jsonl --out OUT/grpo \\
        --reward-funcs examples/grpo_words.py:word_share --num-generations 8 --batch-size 32 \\
        --seq-len 64 --max-completion-length 24 --steps 60 --lr 2e-3 --warmup-steps 0 \\
        --schedule constant --log-every 1
    python examples/grpo_words.py plot --out OUT              # OUT/grpo/reward.png

Each prompt is a few lines of a standard-library file; the reward of a completion
(``word_share``) is the share of its words that are in ``WORDS`` (Python's keywords and ``self``),
counted out of at least 4 words (0 for a completion without a word). The reward mean rises as
the policy learns to write them (and, as any verifiable reward invites, to write little else).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re

WORDS = frozenset(("self", "return", "if", "else", "not", "None", "in", "for", "and", "or", "is", "def", "True",
                   "False", "import", "from", "raise", "with", "as", "while", "try", "except", "pass", "elif"))
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MIN_WORDS = 4  # a completion of fewer words scores as if it had this many


def word_share(prompts, completions, **columns) -> list[float]:
    """Per completion: the share of its words that are in ``WORDS``, out of at least ``MIN_WORDS``
    (a GRPO reward function, TRL's signature)."""
    rewards = []
    for text in completions:
        words = WORD.findall(text)
        rewards.append(sum(w in WORDS for w in words) / max(len(words), MIN_WORDS))
    return rewards


def make_prompts(count: int, seed: int = 0, lines: int = 2) -> list[dict]:
    """``count`` prompts of ``lines`` consecutive non-empty lines of the standard library."""
    from shardzoo.data.corpus import stdlib_files

    source = []
    for path in stdlib_files():
        source += [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    rng = random.Random(seed)
    starts = rng.sample(range(len(source) - lines), count)
    return [{"prompt": "\n".join(source[i: i + lines])[-120:] + "\n"} for i in starts]


def plot(run: str, path: str) -> str:
    """The reward mean (and the completions' length) of a GRPO run's metrics, as a png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "reward" in r]
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["reward"] for r in records], label="reward mean")
    ax.fill_between(steps, [r["reward"] - r["reward_std"] for r in records],
                    [r["reward"] + r["reward_std"] for r in records], alpha=0.2, label="± reward std")
    ax.set_xlabel("step")
    ax.set_ylabel("word_share")
    ax.set_title("GRPO on this CPU: llama-tiny, reward word_share")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("prompts", "plot"))
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default=None, help="where the plot goes (default: OUT/grpo/reward.png)")
    args = p.parse_args()
    if args.what == "plot":
        print(f"wrote {plot(os.path.join(args.out, 'grpo'), args.png or os.path.join(args.out, 'grpo', 'reward.png'))}")
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "prompts.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in make_prompts(args.prompts, args.seed))
    print(f"wrote {args.prompts} prompts to {path}")


if __name__ == "__main__":
    main()
