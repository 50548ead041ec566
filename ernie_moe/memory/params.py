"""Parameter counts of the model, per pipeline stage and per rank, from the config alone (no model is built)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import ModelConfig
from ..nn.quant import quantized_bytes
from ..parallel.layout import Layout


@dataclass
class StageParams:
    """Parameters one rank of a pipeline stage holds, in elements."""

    shared: int = 0  # replicated or tensor-parallel slices: averaged over data ranks, sharded by the optimizer
    experts: int = 0  # routed experts held by this rank
    float32: int = 0  # kept in float32 under O2 (routers, norms, correction bias)
    router: int = 0  # of shared and float32: routers and their correction bias
    # of the above, frozen (training.freeze, or every base weight under LoRA): no gradient, no optimizer state
    frozen_shared: int = 0
    frozen_experts: int = 0
    frozen_float32: int = 0

    @property
    def total(self) -> int:
        return self.shared + self.experts

    @property
    def trainable_shared(self) -> int:
        return self.shared - self.frozen_shared

    @property
    def trainable_experts(self) -> int:
        return self.experts - self.frozen_experts

    def add(self, other: StageParams, frozen: bool = False, router_frozen: bool = False) -> None:
        """Count ``other`` in, frozen as a whole (``frozen``) or only its router part (``router_frozen``), or as it
        says (its correction bias, part of its router, has no gradient)."""
        for name in ("shared", "experts", "float32", "router"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        router = other.router if router_frozen or frozen else 0
        self.frozen_shared += other.shared if frozen else max(router, other.frozen_shared)
        self.frozen_experts += other.experts if frozen else other.frozen_experts
        self.frozen_float32 += other.float32 if frozen else max(router, other.frozen_float32)


def frozen_parts(training) -> set[str]:
    """The model's parts a run does not train: vision, adapter, embedding, head, layers (decoder layers and the
    final norm), router, mtp. LoRA freezes them all (its pairs are counted apart)."""
    if training is None:
        return set()
    if training.fine_tuning == "lora":
        return {"vision", "adapter", "embedding", "head", "layers", "router", "mtp"}
    parts = {"lm": {"embedding", "head", "layers", "router"}}
    return set().union(*(parts.get(p, {p}) for p in training.freeze))


def vision_params(cfg: ModelConfig) -> tuple[int, int]:
    """(ViT, adapter): on the first pipeline stage, replicated over tensor-parallel ranks."""
    v = cfg.vision_config
    d, hidden = v.embed_dim, int(v.embed_dim * v.mlp_ratio)
    patch = v.in_channels * v.patch_size ** 2 * d
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * hidden + hidden) + (hidden * d + d)
    vit = patch + v.depth * block + 2 * d
    merged = d * cfg.spatial_conv_size ** 2
    spatial = 2 * (merged * merged + merged) + 2 * merged
    temporal = (merged * cfg.temporal_conv_size * merged + merged) + (merged * merged + merged) + 2 * merged
    adapter = spatial + temporal + (merged * cfg.hidden_size + cfg.hidden_size) + cfg.hidden_size
    return vit, adapter


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
    out.router = router + bias
    out.frozen_shared = out.frozen_float32 = bias  # set by the trainer's rule, not by gradients
    out.experts = sum(n * 3 * h * w for n, w in groups) // expert_split
    return out


def mtp_params(cfg: ModelConfig, tp: int, expert_split: int) -> StageParams:
    """The multi-token prediction depths (last stage): each a dense decoder layer, two norms and the projection
    from twice the width (replicated over tensor-parallel ranks)."""
    h, out = cfg.hidden_size, StageParams()
    for depth in range(cfg.num_nextn_predict_layers):
        out.add(decoder_layer_params(cfg, depth, tp, expert_split))
        out.add(StageParams(shared=2 * h + 2 * h * h, float32=2 * h))
    return out


@dataclass
class BlockSizes:
    """Elements that train in each block one rank runs, without pipeline stages (sharding stage 2 and 3 run without
    them): what stage 3 gathers for a block and stage 2 reduces at once."""

    head: int  # the block whose backward runs first: the head, or the tied embedding's matrix
    layers: list[int]  # each decoder layer's
    mtp: int  # the multi-token prediction depths'


def block_sizes(cfg: ModelConfig, parallel, training=None) -> BlockSizes:
    tp, expert_split = parallel.tensor_parallel_degree, Layout.of(parallel).expert_split
    frozen = frozen_parts(training)
    vocab = cfg.vocab_size * cfg.hidden_size // tp
    layers = []
    for layer in range(cfg.num_hidden_layers):
        block = StageParams()
        block.add(decoder_layer_params(cfg, layer, tp, expert_split), "layers" in frozen, "router" in frozen)
        layers.append(block.trainable_shared + block.trainable_experts)
    mtp = StageParams()
    mtp.add(mtp_params(cfg, tp, expert_split), "mtp" in frozen)
    head = "embedding" if cfg.tie_word_embeddings else "head"
    return BlockSizes(0 if head in frozen else vocab, layers, mtp.trainable_shared + mtp.trainable_experts)


def stage_layers(cfg: ModelConfig, pp: int, vpp: int) -> list[list[int]]:
    """Decoder layers of each pipeline stage (interleaved: chunk c of pp x vpp goes to stage c % pp)."""
    chunks = pp * vpp
    per_chunk = cfg.num_hidden_layers // chunks
    stages: list[list[int]] = [[] for _ in range(pp)]
    for c in range(chunks):
        stages[c % pp].extend(range(c * per_chunk, (c + 1) * per_chunk))
    return stages


def stage_params(cfg: ModelConfig, parallel, training=None) -> list[StageParams]:
    """What one rank of each pipeline stage holds (``training``: what of it is frozen; LoRA pairs are
    counted by :func:`stage_lora_params`)."""
    tp, pp = parallel.tensor_parallel_degree, parallel.pipeline_parallel_degree
    expert_split = Layout.of(parallel).expert_split
    h, vocab = cfg.hidden_size, cfg.vocab_size * cfg.hidden_size // tp
    frozen = frozen_parts(training)
    stages = []
    for index, layers in enumerate(stage_layers(cfg, pp, max(parallel.virtual_pp_degree, 1))):
        stage = StageParams()
        for layer in layers:
            stage.add(decoder_layer_params(cfg, layer, tp, expert_split), "layers" in frozen, "router" in frozen)
        if index == 0:
            vit, adapter = vision_params(cfg)
            for count, part in ((vocab, "embedding"), (vit, "vision"), (adapter, "adapter")):
                stage.add(StageParams(shared=count), part in frozen)
        if index == pp - 1:
            stage.add(mtp_params(cfg, tp, expert_split), "mtp" in frozen)
            stage.add(StageParams(shared=h, float32=h), "layers" in frozen)  # the final norm
            if not cfg.tie_word_embeddings or pp > 1:  # the head (a tied head's copy on the last stage)
                stage.add(StageParams(shared=vocab), ("embedding" if cfg.tie_word_embeddings else "head") in frozen)
        stages.append(stage)
    return stages


def stage_lora_params(cfg, parallel, training) -> list[StageParams]:
    """The LoRA pairs one rank of each pipeline stage holds (r x (in + out) per adapted linear, split like
    its weight). Targets given as regular expressions are not counted."""
    if training is None or training.fine_tuning != "lora":
        return [StageParams() for _ in range(parallel.pipeline_parallel_degree)]
    tp, pp, r = parallel.tensor_parallel_degree, parallel.pipeline_parallel_degree, training.lora_rank
    expert_split = Layout.of(parallel).expert_split
    targets, h = set(training.lora_targets), cfg.hidden_size
    column = lambda n_in, n_out: r * (n_in + n_out // tp)  # noqa: E731 - A whole, B's columns split
    row = lambda n_in, n_out: r * (n_in // tp + n_out)  # noqa: E731 - A's rows split, B whole
    swiglu = lambda width: column(h, 2 * width) + row(width, h)  # noqa: E731
    stages = []
    for index, layers in enumerate(stage_layers(cfg, pp, max(parallel.virtual_pp_degree, 1))):
        stage = StageParams()
        for layer in layers:
            heads, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            if "attention" in targets:
                stage.shared += column(h, heads + 2 * kv) + row(heads, h)
            modalities = cfg.moe_modalities_at(layer)
            if not modalities:
                stage.shared += swiglu(cfg.intermediate_size) if "mlp" in targets else 0
                continue
            counts, widths = cfg.moe_num_experts, cfg.moe_intermediate_size
            if "shared_experts" in targets and cfg.moe_num_shared_experts:
                stage.shared += swiglu(widths[0] * cfg.moe_num_shared_experts)
            for group, (n, width) in zip(("text_experts", "vision_experts"), zip(counts, widths)):
                if group in targets:  # each expert's pair is local: r x (in + out) in full
                    stage.experts += n * r * (2 * h + 3 * width) // expert_split
        if index == 0:
            stage.shared += _vision_lora(cfg, targets, r)
        if index == pp - 1 and "mtp" in targets:  # each depth's attention, dense MLP and projection
            heads, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            depth = column(h, heads + 2 * kv) + row(heads, h) + swiglu(cfg.intermediate_size) + r * 3 * h
            stage.shared += cfg.num_nextn_predict_layers * depth
        stages.append(stage)
    return stages


def _vision_lora(cfg: ModelConfig, targets: set[str], r: int) -> int:
    v = cfg.vision_config
    d, hidden, merged = v.embed_dim, int(v.embed_dim * v.mlp_ratio), v.embed_dim * cfg.spatial_conv_size ** 2
    count = 0
    if "vit" in targets:
        patch = r * (v.in_channels * v.patch_size ** 2 + d)
        count += patch + v.depth * r * ((d + 3 * d) + 2 * d + 2 * (d + hidden))
    if "adapter" in targets:
        count += r * (4 * merged + (merged * cfg.temporal_conv_size + merged) + 2 * merged + merged + cfg.hidden_size)
    return count


def stage_quantized(cfg, parallel, training) -> list[tuple[int, int]]:
    """(weight elements, bytes held) of the base linears one rank of each pipeline stage holds quantised
    (``training.quantize_base``): each linear's integers and scales (``nn.quant.quantized_bytes``), split as its
    weight is (column-parallel: its output columns; row-parallel: its input rows)."""
    pp = parallel.pipeline_parallel_degree
    if training is None or not training.quantize_base:
        return [(0, 0)] * pp
    mode, group = training.quantize_base, training.quantize_group_size
    tp, h = parallel.tensor_parallel_degree, cfg.hidden_size
    expert_split = Layout.of(parallel).expert_split
    heads, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def linears(layer: int) -> list[tuple[int, int, int]]:
        """(rows, columns, how many) of one rank's base linears in a decoder layer."""
        out = [(h, (heads + 2 * kv) // tp, 1), (heads // tp, h, 1)]
        modalities = cfg.moe_modalities_at(layer)
        if not modalities:
            return out + [(h, 2 * cfg.intermediate_size // tp, 1), (cfg.intermediate_size // tp, h, 1)]
        counts, widths = cfg.moe_num_experts, cfg.moe_intermediate_size
        if cfg.moe_num_shared_experts:
            shared = widths[0] * cfg.moe_num_shared_experts
            out += [(h, 2 * shared // tp, 1), (shared // tp, h, 1)]
        hard_gate = cfg.moe_use_hard_gate and len(counts) == 2
        groups = [(counts[m], widths[m]) for m in modalities] if hard_gate else list(zip(counts, widths))
        for n, width in groups:  # routed experts are whole on the ranks that hold them
            out += [(h, 2 * width, n // expert_split), (width, h, n // expert_split)]
        return out

    stages = []
    for layers in stage_layers(cfg, pp, max(parallel.virtual_pp_degree, 1)):
        pieces = [piece for layer in layers for piece in linears(layer)]
        stages.append((sum(r * c * n for r, c, n in pieces),
                       sum(quantized_bytes(r, c, mode, group) * n for r, c, n in pieces)))
    return stages
