"""Defaults decided once, for every command: the rule table and mesh when none is given, the
sequence length when none is given, the share of the embedded corpus held out, and whether a
tokenizer starts every text with bos.

- Rules: ``fsdp`` on more than one device, ``dp`` on one. Mesh: every device on the first of
  ``fsdp``, ``tensor`` that the rules use, else on ``data`` (so ``--rules tp`` alone is tensor
  parallel over every device, and ``--rules dp`` or ``pp`` data parallel).
- Sequence length (``plan``, ``advise``, ``eval``): what the run recorded, else
  ``DEFAULT_SEQ_LEN``, at most the model's positions. ``train``'s own default is its setting's
  (``TrainConfig.seq_len``, the demo's 128): a run says what it trains on.
"""

from __future__ import annotations

from shardzoo.train import model_info

DEFAULT_SEQ_LEN = 2048
STDLIB_EVAL_FRACTION = 0.05  # held out of the embedded corpus when no eval data is named


def default_rules(num_devices: int) -> str:
    """The rule table when none is given: ``fsdp`` on more than one device, else ``dp``."""
    return "fsdp" if num_devices > 1 else "dp"


def default_mesh(rules) -> str:
    """The mesh spec when none is given: every device on the first of fsdp, tensor that
    ``rules`` use, else on data."""
    used = rules.mesh_axes_used()
    axis = next((a for a in ("fsdp", "tensor") if a in used), "data")
    return f"{axis}=-1"


def mesh_and_rules(mesh=None, rules=None):
    """``(mesh, rules)`` from what the user gave (specs, objects, or None for the defaults)."""
    import jax

    from shardzoo.sharding.mesh import make_mesh
    from shardzoo.sharding.rules import get_rules

    rules = get_rules(rules if rules not in (None, "") else default_rules(jax.device_count()))
    if mesh is None or isinstance(mesh, str):
        mesh = make_mesh(mesh or default_mesh(rules))
    return mesh, rules


def default_seq_len(config, recorded: int | None = None) -> int:
    """The sequence length when none is given: ``recorded`` (a run's), else DEFAULT_SEQ_LEN, at
    most the model's positions."""
    limit = model_info.max_positions(config)
    want = recorded if recorded else DEFAULT_SEQ_LEN
    return min(want, limit) if limit else want


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer`` (a loaded one, or a spec for ``data.load_tokenizer``) starts every
    text with its bos token by itself, as a Llama-style post-processor does; then training,
    eval and generation add bos too, as the model saw it. A tokenizer without a post-processor,
    or one that only appends (eos), does not."""
    if isinstance(tokenizer, str):
        from shardzoo.data import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
    inner = getattr(tokenizer, "tokenizer", None)  # an HFTokenizer's tokenizers.Tokenizer
    bos = getattr(tokenizer, "bos_id", None)
    if inner is None or bos is None:
        return False
    plain, full = inner.encode("a", add_special_tokens=False).ids, inner.encode("a").ids
    return full[:1] == [bos] and plain[:1] != [bos]


VOCAB_PAD = 128  # the multiple a padded vocabulary rounds up to (MaxText's default)


def pad_vocab(config, rules, mesh):
    """``(config, note)``: a Transformer whose vocab the mesh axes ``rules`` split it over do not
    divide gets its embedding and head padded (``vocab_pad_multiple``: 128 and that product's
    least common multiple), as Megatron and MaxText pad; ``note`` says so (None: unchanged)."""
    import math

    from shardzoo.sharding import axes as ax
    from shardzoo.sharding.partition import mesh_axes_of
    from shardzoo.sharding.validate import mesh_sizes

    if not hasattr(config, "padded_vocab"):
        return config, None
    axes = mesh_axes_of(ax.VOCAB, rules, mesh)
    split = math.prod(mesh_sizes(mesh)[a] for a in axes)
    if config.padded_vocab % split == 0:
        return config, None
    multiple = math.lcm(VOCAB_PAD, split, config.vocab_pad_multiple)
    padded = config.replace(vocab_pad_multiple=multiple)
    return padded, (f"vocab_size {config.vocab_size} is not divisible by mesh axes {','.join(axes)} ({split}): "
                    f"embedding and head padded to {padded.padded_vocab} rows (vocab_pad_multiple={multiple}); "
                    "their logits are masked, and no export writes them")
