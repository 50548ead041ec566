"""Parameter counts of the model, per pipeline stage and per rank, from the config alone (no model is built)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StageParams:
    """Parameters one rank of a pipeline stage holds, in elements."""

    shared: int = 0  # replicated or tensor-parallel slices: averaged over data ranks, sharded by the optimizer
    experts: int = 0  # routed experts held by this rank
    float32: int = 0  # kept in float32 under O2 (routers, norms, correction bias)

    @property
    def total(self) -> int:
        return self.shared + self.experts


def vision_params(cfg) -> int:
    """ViT + adapter (on the first pipeline stage, replicated over tensor-parallel ranks)."""
    v = cfg.vision_config
    d, hidden = v.embed_dim, int(v.embed_dim * v.mlp_ratio)
    patch = v.in_channels * v.patch_size ** 2 * d
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * hidden + hidden) + (hidden * d + d)
    vit = patch + v.depth * block + 2 * d
    merged = d * cfg.spatial_conv_size ** 2
    spatial = 2 * (merged * merged + merged) + 2 * merged
    temporal = (merged * cfg.temporal_conv_size * merged + merged) + (merged * merged + merged) + 2 * merged
    adapter = spatial + temporal + (merged * cfg.hidden_size + cfg.hidden_size) + cfg.hidden_size
    return vit + adapter


def decoder_layer_params(cfg, layer: int, tp: int, expert_split: int) -> StageParams:
    h = cfg.hidden_size
    attention = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim \
        + cfg.num_attention_heads * cfg.head_dim * h
    out = StageParams(shared=2 * h + attention // tp, float32=2 * h)
    modalities = cfg.moe_modalities_at(layer)
    if not modalities:
        out.shared += 3 * h * cfg.intermediate_size // tp
        return out
    counts, widths = cfg.moe_num_experts, cfg.moe_intermediate_size
    hard_gate = cfg.moe_use_hard_gate and len(counts) == 2
    groups = [(counts[m], widths[m]) for m in modalities] if hard_gate else list(zip(counts, widths))
    router = h * sum(n for n, _ in groups) if hard_gate else h * sum(counts)
    bias = (len(groups) if hard_gate else 1) * max(n for n, _ in groups) if cfg.moe_use_aux_free else 0
    shared = 3 * h * widths[0] * cfg.moe_num_shared_experts
    out.shared += router + bias + shared // tp
    out.float32 += router + bias
    out.experts = sum(n * 3 * h * w for n, w in groups) // expert_split
    return out


def stage_layers(cfg, pp: int, vpp: int) -> list[list[int]]:
    """Decoder layers of each pipeline stage (interleaved: chunk c of pp x vpp goes to stage c % pp)."""
    chunks = pp * vpp
    per_chunk = cfg.num_hidden_layers // chunks
    stages: list[list[int]] = [[] for _ in range(pp)]
    for c in range(chunks):
        stages[c % pp].extend(range(c * per_chunk, (c + 1) * per_chunk))
    return stages


def stage_params(cfg, parallel) -> list[StageParams]:
    """What one rank of each pipeline stage holds."""
    tp, pp = parallel.tensor_parallel_degree, parallel.pipeline_parallel_degree
    expert_split = tp if parallel.moe_group == "mp" and tp > 1 else parallel.expert_parallel_degree
    h, vocab = cfg.hidden_size, cfg.vocab_size * cfg.hidden_size // tp
    stages = []
    for index, layers in enumerate(stage_layers(cfg, pp, max(parallel.virtual_pp_degree, 1))):
        stage = StageParams()
        for layer in layers:
            part = decoder_layer_params(cfg, layer, tp, expert_split)
            stage.shared += part.shared
            stage.experts += part.experts
            stage.float32 += part.float32
        if index == 0:
            stage.shared += vocab + vision_params(cfg)
        if index == pp - 1:
            stage.shared += h + (vocab if not cfg.tie_word_embeddings or pp > 1 else 0)  # a tied head's copy
            stage.float32 += h
        stages.append(stage)
    return stages
