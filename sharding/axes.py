"""The closed vocabulary of logical axis names.

Models name every dimension of every parameter and of every constrained activation with
one of these constants; rule tables (``rules.py``) alone map them to mesh axes. A name that
is not in ``ALL`` is a bug in the model and is reported by validation.
"""

BATCH = "batch"  # examples in a global batch (activations, data, KV cache)
LENGTH = "length"  # token positions of activations; ``sp`` and ``cp`` shard it
EMBED = "embed"  # model width (hidden_size); FSDP shards parameters along it
HEADS = "heads"  # query attention heads
KV_HEADS = "kv_heads"  # key/value heads (GQA, MQA)
HEAD_DIM = "head_dim"  # features within one attention head
MLP = "mlp"  # feed-forward hidden width (intermediate_size)
VOCAB = "vocab"  # vocabulary entries, or output classes of a classifier head
EXPERT = "expert"  # experts of a Mixture-of-Experts layer
LAYERS = "layers"  # the stacked-layer axis that nn.scan adds to parameters
POSITION = "position"  # rows of a learned position table (max_position_embeddings)
CAPACITY = "capacity"  # token slots per expert in MoE dispatch (activations only)
CACHE_LENGTH = "cache_length"  # positions of a decoding KV cache
LORA_RANK = "lora_rank"  # the low-rank axis of LoRA adapters (replicated in every preset)
Q_LORA = "q_lora"  # latent attention: the query's compressed latent (q_lora_rank; replicated)
KV_LORA = "kv_lora"  # latent attention: the keys' and values' compressed latent (kv_lora_rank; replicated)
CONV_CHANNELS = "conv_channels"  # channels of a short convolution (LFM2's conv layers); tensor-parallel shards them
CONV_WIDTH = "conv_width"  # a short convolution's taps, and the previous inputs a decoding cache keeps (replicated)
SSM_HEADS = "ssm_heads"  # heads of a state-space (mamba) layer; tensor-parallel shards them
SSM_HEAD_DIM = "ssm_head_dim"  # features within one state-space head (replicated)
SSM_GROUPS = "ssm_groups"  # groups of heads sharing a mamba layer's B and C (n_groups; replicated)
SSM_STATE = "ssm_state"  # a state-space layer's state size (ssm_state_size; replicated)
SSM_RANK = "ssm_rank"  # the low rank of a Mamba1 layer's dt projection (dt_rank; replicated)
LINEAR_HEADS = "linear_heads"  # value heads of a linear-attention layer, each with its recurrent state (tensor)
LINEAR_KEY_HEADS = "linear_key_heads"  # query/key heads of a linear-attention layer (tensor)
LINEAR_KEY_DIM = "linear_key_dim"  # features of a linear-attention key head: the state's rows (replicated)
LINEAR_VALUE_DIM = "linear_value_dim"  # features of a linear-attention value head: the state's columns (replicated)
SCORE = "score"  # a reward model's one score output (its ``score`` head's columns; replicated)
PER_LAYER = "per_layer"  # features of a layer's per-layer input (hidden_size_per_layer_input; replicated)
STREAMS = "streams"  # AltUp's parallel residual streams (altup_num_inputs): the router's outputs (replicated)
STREAM_COEFS = "stream_coefs"  # AltUp's coefficients, routed from the streams' weights (replicated)

ALL = (
    BATCH,
    LENGTH,
    EMBED,
    HEADS,
    KV_HEADS,
    HEAD_DIM,
    MLP,
    VOCAB,
    EXPERT,
    LAYERS,
    POSITION,
    CAPACITY,
    CACHE_LENGTH,
    LORA_RANK,
    Q_LORA,
    KV_LORA,
    CONV_CHANNELS,
    CONV_WIDTH,
    SSM_HEADS,
    SSM_HEAD_DIM,
    SSM_GROUPS,
    SSM_STATE,
    SSM_RANK,
    LINEAR_HEADS,
    LINEAR_KEY_HEADS,
    LINEAR_KEY_DIM,
    LINEAR_VALUE_DIM,
    SCORE,
    PER_LAYER,
    STREAMS,
    STREAM_COEFS,
)

MEANINGS = {
    BATCH: "examples in a global batch",
    LENGTH: "token positions of activations (sequence and context parallelism shard it)",
    EMBED: "model width; FSDP shards parameters along it",
    HEADS: "query attention heads",
    KV_HEADS: "key/value attention heads",
    HEAD_DIM: "features within one attention head",
    MLP: "feed-forward hidden width",
    VOCAB: "vocabulary entries or output classes",
    EXPERT: "experts of a Mixture-of-Experts layer",
    LAYERS: "stacked layers (nn.scan)",
    POSITION: "rows of a learned position-embedding table",
    CAPACITY: "token slots per expert in MoE dispatch",
    CACHE_LENGTH: "positions of a decoding KV cache",
    LORA_RANK: "the low-rank axis of LoRA adapters (A: [inputs..., rank], B: [rank, outputs...])",
    Q_LORA: "latent attention's query latent (q_lora_rank)",
    KV_LORA: "latent attention's key/value latent (kv_lora_rank)",
    CONV_CHANNELS: "channels of a short convolution (LFM2's gated conv layers)",
    CONV_WIDTH: "a short convolution's taps (conv_kernel) and the inputs a decoding cache keeps for them",
    SSM_HEADS: "heads of a state-space (mamba) layer (mamba_num_heads)",
    SSM_HEAD_DIM: "features within one state-space head (mamba_head_dim)",
    SSM_GROUPS: "groups of state-space heads sharing B and C (mamba_n_groups)",
    SSM_STATE: "a state-space layer's state size (ssm_state_size)",
    SSM_RANK: "the low rank of a Mamba1 layer's dt projection (time_step_rank)",
    LINEAR_HEADS: "value heads of a linear-attention layer (Gated DeltaNet), one recurrent state each",
    LINEAR_KEY_HEADS: "query/key heads of a linear-attention layer (Gated DeltaNet)",
    LINEAR_KEY_DIM: "features of a linear-attention key head (the recurrent state's rows)",
    LINEAR_VALUE_DIM: "features of a linear-attention value head (the recurrent state's columns)",
    SCORE: "a reward model's score output (the score head's one column)",
    PER_LAYER: "features of a layer's per-layer input embedding (Gemma 3n's hidden_size_per_layer_input)",
    STREAMS: "AltUp's parallel residual streams (Gemma 3n's altup_num_inputs): the weights its router gives them",
    STREAM_COEFS: "AltUp's coefficients mixing the streams (prediction: streams x streams; correction: streams)",
}
