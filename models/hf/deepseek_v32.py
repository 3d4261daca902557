"""DeepSeek-V3.2 (and V3.2-Exp): DeepSeek-V3 (``models/hf/deepseek_v3.py``: latent attention with
a query latent, the sigmoid group router, shared experts after a dense prefix) with DeepSeek
Sparse Attention: each layer's lightning indexer (``self_attn.indexer``: ``wq_b`` from the query
latent, ``wk`` and its LayerNorm ``k_norm``, ``weights_proj``) picks the ``index_topk`` keys each
query attends (``models/sparse_attention.py``; its rotary on halves, latent attention's on
interleaved pairs, always: transformers' DeepseekV32 has no ``rope_interleave``).

``mlp_layer_types`` ("dense"/"sparse") when config.json has it, else ``first_k_dense_replace``
dense layers first; ``layer_types`` is "indexed_attention" for every layer. As V3's, no
multi-token-prediction layer is built for the causal LM.
"""

from __future__ import annotations

from shardzoo.models.arch import DENSE, MOE
from shardzoo.models.hf import deepseek_v2, deepseek_v3, llama, mixtral
from shardzoo.models.hf.base import Family, HFConfig, HFError, Weight
from shardzoo.models.moe_arch import NO_MOE
from shardzoo.models.sparse_attention import INDEXED

# DeepseekV32Config's fields and defaults (transformers 5.25)
SCHEMA = {k: v for k, v in deepseek_v3.SCHEMA.items() if k not in ("rope_interleave", "num_nextn_predict_layers")} | dict(
    max_position_embeddings=163840, mlp_layer_types=None, layer_types=None, index_topk=2048, index_head_dim=128,
    index_n_heads=64, mlp_bias=False, head_dim=64)
FEATURES = deepseek_v3.FEATURES | {"sparse_attention", "layer_pattern"}  # its layer_types: indexed_attention
KINDS = {"dense": DENSE, "sparse": MOE}


def indexer_fields(hf: HFConfig) -> dict:
    """The indexer's sizes, the MLP pattern and the layer kinds, as V3.2 and GLM-5 spell them."""
    n = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    if types is not None and (len(types) != n or set(types) != {INDEXED}):
        raise hf.refuse("layer_types", f"every layer of {hf.family.name} is {INDEXED!r}")
    out = dict(index_topk=hf.get("index_topk"), index_n_heads=hf.get("index_n_heads"),
               index_head_dim=hf.get("index_head_dim"), layer_types=(INDEXED,) * n)
    mlps = hf.get("mlp_layer_types")
    if mlps is not None:
        if len(mlps) != n or not set(mlps) <= set(KINDS):
            raise hf.refuse("mlp_layer_types", f"must name {n} layers, each dense or sparse")
        out["mlp_layer_types"] = tuple(KINDS[m] for m in mlps)
    if hf.get("mlp_bias"):
        raise hf.refuse("mlp_bias", "DeepSeek's MLPs have no biases in shardzoo")
    return out


def indexer_to_hf(a) -> dict:
    kinds = {v: k for k, v in KINDS.items()}
    i = a.indexer
    if i is None:  # not this family's model (family_of_config tries each family's export)
        raise HFError("DeepSeek Sparse Attention's config.json describes an indexer; this model has none")
    return dict(index_topk=i.topk, index_n_heads=i.n_heads, index_head_dim=i.head_dim,
                mlp_layer_types=[kinds[s.mlp] for s in a.layer_specs()], layer_types=list(a.layer_types))


def from_hf(hf: HFConfig) -> dict:
    return deepseek_v2.latent_fields(hf) | deepseek_v2.moe_fields(hf) | indexer_fields(hf) | dict(
        rope_interleaved=True, router_kind="sigmoid_groups", norm_topk_prob=hf.get("norm_topk_prob"),
        router_aux_loss_coef=0.0)


def to_hf(a) -> dict:
    m = a.moe or NO_MOE
    return deepseek_v2.latent_to_hf(a) | deepseek_v2.moe_to_hf(a) | indexer_to_hf(a) | dict(
        norm_topk_prob=m.norm_topk_prob)


def layer_weights(a, spec) -> list[Weight]:
    """DeepSeek-V3's, and the indexer's (``self_attn.indexer.*``)."""
    h = llama.LAYER + "self_attn.indexer."
    return deepseek_v2.layer_weights(a, spec) + [
        Weight(("attn", "indexer", "wq_b", "kernel"), h + "wq_b.weight", "linear"),
        Weight(("attn", "indexer", "wk", "kernel"), h + "wk.weight", "linear"),
        Weight(("attn", "indexer", "k_norm", "scale"), h + "k_norm.weight"),
        Weight(("attn", "indexer", "k_norm", "bias"), h + "k_norm.bias"),
        Weight(("attn", "indexer", "weights_proj", "kernel"), h + "weights_proj.weight", "linear")]


# deepseek-ai/DeepSeek-V3.2/config.json: DeepSeek-V3's sizes (61 layers, the first 3 dense, 256
# experts top-8 in 8 groups), an indexer of 64 heads of 128 keeping 2048 keys.
V32 = deepseek_v3.V3 | dict(index_topk=2048, index_n_heads=64, index_head_dim=128, layer_types=(INDEXED,) * 61)
# a dense layer, then two MoE layers (scanned); a query latent; an indexer of 4 heads keeping 6 keys
TINY = deepseek_v3.TINY | dict(q_lora_rank=24, index_topk=6, index_n_heads=4, index_head_dim=16,
                              layer_types=(INDEXED,) * 3)
DEEPSEEK_V32 = Family(
    "deepseek_v32", ("deepseek_v32",), "DeepseekV32ForCausalLM", SCHEMA, FEATURES, from_hf, to_hf,
    llama.global_weights, layer_weights, execution=mixtral.HF_MOE,
    presets={"deepseek-v3.2": V32, "deepseek-v3.2-tiny": TINY})
