"""The components a layer is made of, each kind in one table: token mixers (``MIXERS``) and MLP kinds (``MLPS``).

A decoder layer is ``x + mixer(norm(x))``, then ``x + mlp(norm(x))`` (``arch.LayerSpec``: its
``mixer`` and ``mlp``). ``transformer.Block`` builds a layer's two halves, ``models/costs.py``
counts their parameters, FLOPs, activations and decoding caches, and ``arch.TransformerArch``
checks them and reads ``layer_types`` into specs, all by looking the names up here, as MaxText's
``decoders.py`` maps a block type to its class: no ``if kind ==`` chain anywhere else.

A new token mixer is:
  1. one module (``models/<name>.py``) with its flax module and a ``Mixer`` record built from it
     (what ``Mixer``'s fields say; the flax module names each parameter's logical axes at
     creation and creates its decoding cache, a "cache" collection of logically named arrays, on
     its first ``decode`` call, which ``models/decode.py`` sizes);
  2. one line in ``MIXERS`` below (and its ``layer_types`` names, which configs then accept);
  3. its Hugging Face family module in ``models/hf/`` (config mapping and weight map).
A new MLP kind likewise: a module exporting an ``Mlp`` record and one line in ``MLPS``.

Its settings are its own sub-record of the architecture (a ``component.SubRecord`` dataclass in
its module, named in its record's ``records``): ``TransformerArch`` has a field for every
sub-record of ``RECORDS`` (None where no layer uses it), checkpoints store it nested, and its
``FLAT`` names (the fields' names in older checkpoints and ``--override``) read into it.
"""

from __future__ import annotations

from shardzoo.models import (
    attention,
    conv_mixer,
    kimi_delta,
    layers,
    linear_attention,
    mamba1,
    moa,
    moe,
    norms,
    per_layer,
    rglru,
    shared_block,
    sparse_attention,
    ssm,
)
from shardzoo.models.component import Mixer, Mlp

NONE = "none"
# "none" in layer_types: a layer without a token mixer (x + mlp(norm(x)): Nemotron-H's MLP
# layers); in mlp_layer_types: a layer without an MLP (x + mixer(norm(x)): Mamba2's layers)
NO_MIXER = Mixer(NONE, (NONE,), apply=None, params=lambda a: (0, 0))
NO_MLP = Mlp(NONE, apply=None, params=lambda a, active: (0, 0))

MIXERS = {m.name: m for m in (
    attention.MIXER,  # MHA/GQA/MQA and multi-head latent attention, full, sliding or chunked
    conv_mixer.MIXER,  # LFM2's gated short convolution
    linear_attention.MIXER,  # Qwen3-Next's Gated DeltaNet
    ssm.MIXER,  # Mamba2's selective state-space mixer
    ssm.ATTENTION_MAMBA_MIXER,  # attention and a Mamba2 mixer side by side (Falcon-H1)
    mamba1.MIXER,  # Mamba1's selective scan (Mamba, Falcon-Mamba, Jamba)
    kimi_delta.MIXER,  # Kimi-Linear's Kimi delta attention
    rglru.MIXER,  # RecurrentGemma's recurrent block: a convolution and the RG-LRU
    moa.MIXER,  # JetMoE's mixture of attention heads: routed query/output projection experts, shared keys/values
    sparse_attention.MIXER,  # DeepSeek Sparse Attention: latent attention over its lightning indexer's top-k keys
    NO_MIXER,
)}
MLPS = {m.name: m for m in (
    layers.MLP_KIND,  # a dense MLP, gated (SwiGLU, GeGLU) or plain
    moe.MLP_KIND,  # a Mixture of Experts with its router and shared expert
    moe.DENSE_AND_MOE_KIND,  # a dense MLP and a Mixture of Experts side by side (Gemma 4's MoE block)
    NO_MLP,
)}
# each name of arch.layer_types, and its mixer
MIXER_OF_LAYER_TYPE = {t: m.name for m in MIXERS.values() for t in m.layer_types}
# the architecture's sub-records (component.SubRecord), each a field of TransformerArch: the
# components' own, and the block's
RECORDS = {r.NAME: r for r in (
    *(r for m in (*MIXERS.values(), *MLPS.values()) for r in m.records),
    layers.Multipliers,  # Falcon-H1's muP scalars
    shared_block.SharedBlockArch,  # Zamba2's weight-shared attention + MLP blocks
    norms.LayerNorms,  # the layers' norms' own epsilon (JetMoE)
    per_layer.PerLayerArch,  # Gemma 3n's per-layer inputs, KV sharing, AltUp, Laurel, activation sparsity
)}
