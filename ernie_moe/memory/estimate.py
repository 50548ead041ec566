"""Predicted peak memory of one rank of each pipeline stage during a training step.

Persistent: parameters, gradients (kept allocated between steps; with ``parallel.overlap_grad_sync`` over
several data ranks, fleet's reducer keeps its buckets, a fused copy of the gradients it averages), AdamW moments
and master weights. Optimizer sharding splits the states over the sharding ranks (the routed experts' over their
replicas), stage 2 the gradients too (the largest block's whole while it is reduced), stage 3 the weights too (the
largest block's gathered, two at once where one block's backward meets the next block's gather). Per step: the
step's input batches, the activations the forward pass keeps for the backward pass of the micro-batches in
flight, and the backward pass's transient (a recomputed block run again while the later layers' activations are
already freed).

Activation terms count what this package's layers keep (float32 elements unless noted). The coefficients were
read off the allocator, block by block, while varying one dimension at a time (batch, sequence, widths,
heads, key/value heads, experts, k, image sizes); ``tests/memory/test_memory.py`` checks whole-step peaks against
the allocator for several layouts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..config.schema import OFFLOAD_BUCKET_BYTES, Config, ModelConfig
from ..model.recompute import selected_layers
from ..moe.replay import moe_layer_ids
from ..nn.flashmask import BLOCK_ROWS
from ..objectives import build_objective
from ..parallel.layout import Layout
from ..parallel.zero import stage_number
from .params import block_sizes, frozen_parts, stage_layers, stage_lora_params, stage_params, stage_quantized

PIXEL_CHANNELS_BYTES = 4  # flattened patches arrive as float32
INT_FIELDS = 7  # int64 per token: input ids, labels, token types, doc ids, 3 position axes
BLOCK_TRANSIENT = 5.56  # [block, seq] float32 arrays the block attention holds at once, less two [block, block] (fit)


@dataclass
class Workload:
    """One micro-batch on one data rank: its token and image make-up."""

    rows: int
    seq: int
    image_tokens: int
    # patches of one frame (a still image is one frame) -> how many frames have that many: the ViT attends
    # within each frame, the frames of one size at once (counts, not a list: an assumed micro-batch of a huge
    # config would list billions)
    image_sizes: dict[int, int] = field(default_factory=dict)
    padding: int = 0  # positions that hold no token: no router sends them to an expert (a pair row's tail)

    @property
    def tokens(self) -> int:
        return self.rows * self.seq

    @property
    def patches(self) -> int:
        return sum(size * count for size, count in self.image_sizes.items())

    @property
    def squared_patches(self) -> int:
        """Sum over frames of patches squared (the ViT's attention scores)."""
        return sum(size * size * count for size, count in self.image_sizes.items())

    @property
    def largest_attention(self) -> int:
        """The attention scores of the frames of one size, the most of any size (one ViT attention call)."""
        return max((size * size * count for size, count in self.image_sizes.items()), default=0)

    @classmethod
    def from_batch(cls, batch) -> Workload:
        types = batch.token_type_ids.numpy()
        sizes: Counter = Counter()
        for frames, rows, cols in np.asarray(batch.grid_thw).reshape(-1, 3).tolist():
            sizes[int(rows * cols)] += int(frames)
        return cls(rows=types.shape[0], seq=types.shape[1], image_tokens=int((types > 0).sum()),
                   image_sizes=dict(sizes), padding=int((types < 0).sum()))

    @classmethod
    def assumed(cls, cfg: Config, image_fraction: float = 0.5) -> Workload:
        """Without data: images of ``data.max_image_side`` (or ``data.image_max_pixels``) fill ``image_fraction``
        of the tokens."""
        v = cfg.model.vision_config
        budget = cfg.data.pixel_budget  # a square image at ERNIE's pixel budget, or at max_image_side
        longest = int(budget[1] ** 0.5) if budget else cfg.data.max_image_side
        side = longest // (v.patch_size * v.spatial_merge_size) * v.spatial_merge_size
        patches = side * side
        per_image = patches // (v.spatial_merge_size ** 2)
        rows, seq = cfg.training.per_device_train_batch_size, cfg.data.max_seq_len
        images = int(rows * seq * image_fraction) // max(per_image, 1)
        return cls(rows=rows, seq=seq, image_tokens=images * per_image, image_sizes={patches: images} if images else {})


def sample_workloads(cfg: Config, data_world: int, count: int) -> list[Workload]:
    """The first ``count`` micro-batches data rank 0 trains on, built by the data pipeline itself."""
    from ..data import RowStream, build_datasets, build_tokenizer, collate, rank_batches

    train, _ = build_datasets(cfg)
    rows = RowStream(train, build_tokenizer(cfg), cfg, Counter(), shuffle=True)
    batches = rank_batches(rows, cfg.training.per_device_train_batch_size * data_world, 0, data_world)
    return [Workload.from_batch(collate(next(batches))) for _ in range(count)]


def sample_workload(cfg, data_world: int) -> Workload:
    """The first micro-batch data rank 0 trains on."""
    return sample_workloads(cfg, data_world, 1)[0]


@dataclass
class StageMemory:
    """Bytes on one rank of one pipeline stage."""

    stage: int
    parameters: float
    gradients: float
    optimizer: float
    inputs: float
    activations: float
    transient: float
    offloaded: bool = False  # the optimizer states visit the device for the update only, after the backward pass
    reference: float = 0.0  # a preference (or KL-tied RL) run's reference copy of the weights that train
    rollout: float = 0.0  # a GRPO rollout's key/value cache: held while sampling, outside the forward and backward
    # host memory, not the device's: what an async save (training.async_save) copies before its files are written,
    # at most the stage's weights and optimizer states whole (a writing rank gathers the tensor-parallel slices)
    save_copy: float = 0.0
    # before the first step: the rank's part of the model built whole in float32 (then loaded, cast, quantised and,
    # at sharding stage 3, shared out)
    startup: float = 0.0

    @property
    def total(self) -> float:
        steady = self.parameters + self.reference + self.gradients + self.inputs
        passes = max(self.activations + self.transient, self.rollout)  # sampling and training take turns
        if self.offloaded:
            return steady + max(self.optimizer, passes)
        return steady + self.optimizer + passes


def rollout_rows(training) -> int:
    """A GRPO rollout's rows on one data rank: every optimizer step it serves takes its share."""
    t = training
    return t.per_device_train_batch_size * t.gradient_accumulation_steps * t.rl.updates_per_rollout


def uses_flash_attention(training) -> bool:
    """Paddle's attention runs flash attention for bf16 / fp16 on GPUs, its plain computation for float32."""
    return training.bf16 or training.fp16


def attention_core(training, w: Workload, heads: int, head_dim: int) -> tuple[float, float]:
    """(bytes kept, bytes held while it runs) of one layer's FlashMask attention over this rank's ``heads``.
    Neither grows as seq^2: Paddle's kernel (bf16 / fp16 on GPUs) keeps only its output, counted with the layer's
    projections; the block path (``nn.flashmask``) keeps its float32 output and the q, k, v it reads, and holds one
    block of rows' scores, probabilities and their gradients at a time (measured: ``tests/memory/test_memory.py``); a
    sequence of one block runs as dense attention."""
    if uses_flash_attention(training):
        return 0.0, 0.0
    if w.seq <= BLOCK_ROWS:  # one block: dense attention keeps its probabilities (the mask is the stage's, once)
        return 4 * w.rows * heads * w.seq ** 2, 0.0
    linear = 3 * 4 * w.tokens * heads * head_dim
    return linear, 4 * w.rows * heads * BLOCK_ROWS * (BLOCK_TRANSIENT * w.seq - 2 * BLOCK_ROWS)


def sequence_pieces(parallel) -> int:
    """The pieces sequence parallelism cuts a rank's activations into (and the ViT's frames): 1 without it."""
    return parallel.tensor_parallel_degree if parallel.sequence_parallel else 1


def uses_grouped_matmul(training) -> bool:
    """Whether the experts run as batched matmuls; 'auto' means on a GPU, which this planner takes low precision
    to mean (as for flash attention). Experts with LoRA pairs run one by one."""
    lora_experts = {"text_experts", "vision_experts"} & set(training.lora_targets)
    if (training.fine_tuning == "lora" and lora_experts) or training.moe_expert_matmul == "per_expert":
        return False
    return training.moe_expert_matmul == "grouped" or uses_flash_attention(training)


def kept_copies(m, routed: list[tuple[int, int, int]], capacity: float | None, total_tokens: int) -> list[float]:
    """Routed copies each expert group keeps (``routed``: its tokens, experts and width). Dropless, every token's
    k choices; under a capacity factor (``moe.layer``'s rule), each expert keeps at most ``int(factor x tokens /
    experts)``: a batch with image tokens counts every token over every expert, otherwise each group its own."""
    if not capacity:
        return [float(n * m.moe_k) for n, _, _ in routed]
    mixed = len(routed) == 2 and routed[1][0] > 0
    experts = sum(e for _, e, _ in routed)
    per_expert = [int(capacity * total_tokens // experts) if mixed else int(capacity * n // e) if e else 0
                  for n, e, _ in routed]
    return [float(min(n * m.moe_k, e * cap)) for (n, e, _), cap in zip(routed, per_expert)]


def _layer_activations(m, parallel, training, layer: int, w: Workload,
                       capacity: float | None = None) -> tuple[float, float]:
    """(bytes kept, bytes of the recomputed block) of one decoder layer for one micro-batch; ``capacity``: the
    experts' training capacity factor (None: dropless)."""
    tp = parallel.tensor_parallel_degree
    sp = sequence_pieces(parallel)
    t, h, hd = w.tokens, m.hidden_size, m.head_dim
    heads, kv = m.num_attention_heads // tp, m.num_key_value_heads // tp
    norm_residual = (3 * t * h) / sp + t
    # the plain path's dense attention copies no key/value heads for grouped queries; the GPU figures count copies
    grouped = m.num_attention_heads > m.num_key_value_heads and uses_flash_attention(training)
    repeat = 2 * heads * t * hd if grouped else 0
    attention_linear = t * hd * (3 * heads + 3 * kv + 2) + repeat
    core_kept, core_transient = attention_core(training, w, heads, hd)
    attention = 4 * (norm_residual + attention_linear) + core_kept

    modalities = m.moe_modalities_at(layer)
    stacking = 0.0
    if not modalities:
        mlp = 4 * (norm_residual + 3 * t * m.intermediate_size / tp)  # F.swiglu keeps its input and output
    else:
        counts, widths = m.moe_num_experts, m.moe_intermediate_size
        hard = m.moe_use_hard_gate and len(counts) == 2
        text = t - w.image_tokens - w.padding
        routed = [(text, counts[0], widths[0]), (w.image_tokens, counts[1], widths[1])] if hard else \
            [(t - w.padding, sum(counts), widths[0])]
        routed = [r for i, r in enumerate(routed) if not hard or i in modalities]
        layout = Layout.of(parallel)
        # over the tensor-parallel ranks each holds the same tokens and a share of the experts: a share of the copies
        kept_by_group = kept_copies(m, routed, capacity, t - w.padding)
        copies = sum(kept_by_group) / (layout.expert_split if layout.experts_over_tp else 1)
        width = sum(c * wd for c, (_, _, wd) in zip(kept_by_group, routed)) / max(sum(kept_by_group), 1)
        router = 3.4 * sum(n * e for n, e, _ in routed)
        exchange = 2 * copies * h if layout.experts_all_to_all else 0
        shared = 3 * t * widths[0] * m.moe_num_shared_experts / tp
        mlp = 4 * (norm_residual + router + t * h + copies * (1.8 * h + 3.2 * width) + exchange + shared)
        # batched matmuls stack one projection's weights of this rank's experts of one width while it runs, in
        # forward and again in backward (then their stacked gradient): the largest up/gate projection's at most
        if uses_grouped_matmul(training):
            stacking = 4 * max(2 * h * n * wd for _, n, wd in routed) / layout.expert_split

    # (kept for backward, re-run in backward minus what the layer's backward has freed before it); ``attending``:
    # what the attention's backward holds over the kept bytes, after the MLP's backward has freed its part
    recomputes = training.recompute and layer in selected_layers(training.recompute_layers, m.num_hidden_layers)
    granularity = training.recompute_granularity if recomputes else None
    if granularity == "full":
        kept, rerun = 4 * t * h / sp, attention + mlp
        attending = attention + core_transient
    elif granularity == "full_attn":
        kept, rerun = 4 * t * h / sp + mlp, max(attention - mlp, 0.0)
        attending = attention - mlp + core_transient
    elif granularity == "core_attn":
        core = core_kept + 4 * repeat
        kept, rerun = attention - core + mlp, max(core - mlp, 0.0)
        attending = core - mlp + core_transient
    elif granularity == "moe" and modalities:
        kept, rerun = attention + 4 * (norm_residual + t * h), mlp
        attending = core_transient
    else:
        kept, rerun = attention + mlp, 0.0
        attending = core_transient - mlp
    # the stacked weights come on top of whatever the MLP's backward holds then
    return kept, max(rerun + stacking, attending)


def attention_inputs(m, parallel, training, w: Workload) -> float:
    """Bytes a stage with decoder layers holds for all of them through a micro-batch (``model.blocks.AttentionInputs``):
    the rotary angles, the document bounds (int64, and a copy) and, on the plain path (float32), the cosine and sine
    tables written out for the query and key heads and for one-block attention the mask as a float bias over every
    head (the fused kernels take the angles and the bounds)."""
    tp = parallel.tensor_parallel_degree
    heads, kv = m.num_attention_heads // tp, m.num_key_value_heads // tp
    positions = w.rows * w.seq
    plain = not uses_flash_attention(training)
    rotary = 4 * positions * m.head_dim * (0.5 + (2 * (heads + kv) if plain else 0))
    bias = 4 * w.rows * heads * w.seq ** 2 if w.seq <= BLOCK_ROWS and plain else 0.0
    return rotary + 2 * 8 * positions + bias


def _first_stage_activations(cfg: ModelConfig, parallel, training, w: Workload) -> list[tuple[float, float]]:
    """(kept, re-run in backward) of the first stage's pieces in forward order: embedding, the ViT's embedding and
    final norm, then each ViT block, then the adapter. A part that trains nothing, with nothing before it that does,
    keeps nothing (a frozen ViT, and its adapter if frozen too). Under sequence parallelism each tensor-parallel rank
    runs the ViT over its share of the frames."""
    m, v = cfg, cfg.vision_config
    t, h, d = w.tokens, m.hidden_size, v.embed_dim
    text_side = 4 * 2 * t * h
    if not w.image_sizes:
        return [(text_side, 0.0)]
    lora = set(training.lora_targets) if training.fine_tuning == "lora" else set()
    vit_trains = _vit_trains(training)
    adapter_trains = vit_trains or "adapter" not in frozen_parts(training) or "adapter" in lora
    shares = sequence_pieces(parallel)
    p = w.patches / shares
    probabilities = 0 if uses_flash_attention(training) else 4 * v.num_heads * w.squared_patches / shares
    block = 4 * (16.3 * p * d + 30 * p) + probabilities  # per-image attention: every patch, no mask
    recomputed = training.recompute and training.recompute_granularity in ("full", "full_attn")
    blocks = [(4 * p * d, block) if recomputed else (block, 0.0)] * v.depth
    adapter = 4 * (9 * w.patches * d + 0.75 * w.patches * h)  # over every frame's features, gathered
    if not vit_trains:
        return [(text_side, 0.0), (adapter if adapter_trains else 0.0, 0.0)]
    return [(text_side + 4 * 2.2 * p * d, 0.0), *blocks, (adapter, 0.0)]


def _vit_trains(training) -> bool:
    """Whether the ViT has weights that train (not frozen, or LoRA pairs in it)."""
    lora = set(training.lora_targets) if training.fine_tuning == "lora" else set()
    return "vision" not in frozen_parts(training) or "vit" in lora


def _frozen_vit_forward(cfg: ModelConfig, parallel, training, w: Workload) -> float:
    """What a ViT that keeps nothing (frozen, no LoRA in it) holds at once in its forward pass: a block's
    projections of every patch of this rank's share and, in the plain attention, one call's scores and
    probabilities."""
    v = cfg.vision_config
    if not w.image_sizes or _vit_trains(training):
        return 0.0
    shares = sequence_pieces(parallel)
    scores = 0 if uses_flash_attention(training) else 2 * 4 * v.num_heads * w.largest_attention / shares
    return 4 * 10 * w.patches * v.embed_dim / shares + scores


def _last_stage_activations(cfg: ModelConfig, parallel, training, w: Workload) -> tuple[float, float]:
    """(kept, re-run in backward) of the final norm, head and loss. The float32 logits are kept for the
    backward pass, whose gradient of them is as large again; over sequence chunks
    (``training.loss_subbatch_seqlen``) nothing of them is kept and one chunk's come back, twice over."""
    t, vocab = w.tokens, cfg.vocab_size / parallel.tensor_parallel_degree
    hidden = 4 * (3 * t * cfg.hidden_size + t)
    chunk = training.loss_subbatch_seqlen
    if chunk:
        return hidden, 2 * 4 * w.rows * min(chunk, w.seq) * vocab
    return hidden + 4 * t * vocab, 4 * t * vocab


def _mtp_activations(m, parallel, training, depth: int, w: Workload) -> float:
    """Bytes one multi-token prediction depth keeps: its two norms and the projection of their concatenation
    (over whole sequences), and its decoder layer (recomputed as decoder layer ``depth`` is)."""
    kept, _ = _layer_activations(m, parallel, training, depth, w)
    return kept + 4 * (5 * w.tokens * m.hidden_size + 2 * w.tokens)


def in_flight(parallel, training, stage: int) -> float:
    """Micro-batches whose activations a stage holds at once (1F1B warm-up; interleaved in model chunks)."""
    pp, vpp, gas = parallel.pipeline_parallel_degree, max(parallel.virtual_pp_degree, 1), \
        training.gradient_accumulation_steps
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - stage, gas))
    chunks = min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, gas * vpp)
    return chunks / vpp


def estimate(cfg: Config, workload: Workload, data_world: int | None = None,
             capacity: float | None = None) -> list[StageMemory]:
    """Bytes on one rank of each pipeline stage for ``cfg``'s layout, model and training settings;
    ``data_world``: the data-parallel x sharding ranks (default: the sharding ranks alone); ``capacity``: the
    experts' training capacity factor (default: the configured one, ``model.moe_capacity``)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    objective = build_objective(t)  # what trains beside it, what it keeps and where its data comes from
    capacity = capacity or (m.moe_capacity[0] if m.moe_capacity else None)
    low = t.bf16 or t.fp16
    o2 = low and t.fp16_opt_level == "O2"
    param_bytes = 2 if o2 else 4
    grad_bytes = 4 if (not o2 or t.amp_master_grad) else 2
    act_scale = 0.5 if low else 1.0  # activations in bf16 / fp16 under autocast (GPU)
    sharding = p.sharding_parallel_degree if p.sharding else 1
    # optimizer sharding splits the experts' states over the ranks holding the same experts
    data_world = data_world or p.sharding_parallel_degree
    layout = Layout.of(p, data_world * p.tensor_parallel_degree * p.pipeline_parallel_degree)
    expert_replicas = layout.expert_copies if p.sharding else 1
    stage_n = stage_number(p.sharding)
    # bytes per element a block adds while its backward runs: at stage 2 its gradients whole until they are reduced
    # (an owner's too: the new gradient is made before it is added), at stage 3 the gradients and the gathered
    # weights of what this rank does not own (read off the allocator)
    per_block = {2: grad_bytes, 3: (grad_bytes + param_bytes) * (1 - 1 / sharding)}.get(stage_n, 0)
    # parallel.grad_sync: fleet's reducer (below stage 2)
    reducer = p.overlap_grad_sync and p.pipeline_parallel_degree == 1 and data_world > 1 and stage_n < 2
    data_inputs = workload.tokens * 8 * INT_FIELDS + workload.patches * (
        m.vision_config.in_channels * m.vision_config.patch_size ** 2 * PIXEL_CHANNELS_BYTES)
    out = []
    layers_of = stage_layers(m, p.pipeline_parallel_degree, max(p.virtual_pp_degree, 1))
    quantized_stages = stage_quantized(m, p, t)
    for stage, (params, lora, layers) in enumerate(zip(stage_params(m, p, t), stage_lora_params(m, p, t),
                                                       layers_of)):
        # frozen weights: no gradient, no moments, no master copy (under O2 they stay in low precision only)
        parameters: float = param_bytes * (params.total + lora.total - params.float32) + 4 * params.float32
        quantized_elements, quantized = quantized_stages[stage]  # base linears held as integers and scales
        parameters += quantized - param_bytes * quantized_elements
        trainable = params.trainable_shared + lora.shared, params.trainable_experts + lora.experts
        if stage_n >= 2:  # the owner's share (a block's whole gradients while they are reduced: transient)
            gradients: float = grad_bytes * (trainable[0] / sharding + trainable[1] / max(expert_replicas, 1))
        else:
            gradients = grad_bytes * sum(trainable)
        if stage_n == 3:  # the weights that train: the owner's share (the blocks gathered: transient)
            parameters -= param_bytes * (trainable[0] * (1 - 1 / sharding)
                                         + trainable[1] * (1 - 1 / max(expert_replicas, 1)))
        if reducer:  # its buckets: a fused copy of the gradients it averages (experts' where they have replicas)
            gradients += grad_bytes * (trainable[0] + (trainable[1] if layout.expert_copies > 1 else 0))
        states_per_param = 8 + (4 if o2 else 0)  # two AdamW moments, a float32 master copy under O2
        optimizer = states_per_param * (trainable[0] / sharding + trainable[1] / max(expert_replicas, 1))
        trainable_float32 = params.float32 - params.frozen_float32
        optimizer -= 4 * (trainable_float32 / sharding) if o2 else 0  # float32 weights need no master copy
        # the EMA's float32 averages, split over the replicas of each weight (host when offloaded)
        ema = 4 * (trainable[0] / data_world + trainable[1] / max(layout.expert_copies, 1)) if t.ema_decay else 0.0
        save_copy = p.tensor_parallel_degree * (parameters + optimizer + ema) if t.async_save else 0.0
        if t.offload_optim:  # what visits at once: a bucket, or fleet's sharded share of the shared states whole
            shared_share = states_per_param * trainable[0] / sharding if p.sharding else 0.0
            optimizer = max(shared_share, min(optimizer - shared_share, OFFLOAD_BUCKET_BYTES))
        else:
            optimizer += ema
        per_layer = [_layer_activations(m, p, t, layer, workload, capacity) for layer in layers]
        if layers:
            per_layer = [(attention_inputs(m, p, t, workload), 0.0)] + per_layer
        if stage == 0:
            per_layer = _first_stage_activations(m, p, t, workload) + per_layer
        kept = sum(k for k, _ in per_layer)
        # a frozen ViT runs when only the text side is kept (the first piece): its forward may be the peak
        transient = max(_frozen_vit_forward(m, p, t, workload) + per_layer[0][0] - kept, 0.0) if stage == 0 else 0.0
        # backward runs the layers last to first: when layer j re-runs its block, the later layers are freed
        later = 0.0
        for layer_kept, rerun in reversed(per_layer):
            transient = max(transient, rerun - later)
            later += layer_kept
        depths = objective.mtp_depths(m)  # multi-token prediction trains
        if depths and stage > 0:  # the token embeddings, carried to the last stage
            kept += 4 * workload.tokens * m.hidden_size
        if stage == p.pipeline_parallel_degree - 1:  # the head's backward runs first: nothing is freed yet
            head_kept, head_rerun = _last_stage_activations(m, p, t, workload)
            head_total = head_kept * (1 + depths) + sum(_mtp_activations(m, p, t, k, workload) for k in range(depths))
            kept += head_total
            transient = max(transient, head_rerun)
            if per_block:  # the head's block from the start of the backward (a tied matrix's gradient is complete
                # at its end), then each layer's as the later activations are freed
                blocks = block_sizes(m, p, t)
                head = per_block * blocks.head
                transient = max(transient, head + per_block * blocks.mtp)
                later = head_total
                for (layer_kept, _), elements in zip(reversed(per_layer[len(per_layer) - len(layers):]),
                                                     reversed(blocks.layers)):
                    transient = max(transient, head * m.tie_word_embeddings + per_block * elements - later)
                    later += layer_kept
        activations = act_scale * kept * in_flight(p, t, stage)
        transient = act_scale * transient
        inputs: float = data_inputs * t.gradient_accumulation_steps
        rollout = 0.0
        if objective.trains_on == "rollouts":  # a rollout's rows, kept for its updates, its decoding's keys and values
            rows, length = rollout_rows(t), cfg.data.max_seq_len
            replayed = len(moe_layer_ids(m)) * m.moe_k if t.router_replay != "off" else 0  # int32 routes
            # float32 log-probabilities: the old policy's and the sampler's
            inputs = rows * (data_inputs / t.per_device_train_batch_size + length * 4 * (2 + replayed))
            heads = max(m.num_key_value_heads // p.tensor_parallel_degree, 1)
            rollout = 2 * (2 if low else 4) * rows * length * len(layers) * heads * m.head_dim  # keys and values
        # a full fine-tune's reference: the trained weights as they started (LoRA's is its base)
        holds = t.fine_tuning != "lora" and objective.reference_source == "model"
        reference = param_bytes * sum(trainable) if holds else 0.0
        if holds and stage_n == 3:  # kept by the weights' owners
            reference = param_bytes * (trainable[0] / sharding + trainable[1] / max(expert_replicas, 1))
        startup = 4.0 * (params.total + lora.total)
        out.append(StageMemory(stage, parameters, gradients, optimizer, inputs, activations, transient,
                               t.offload_optim, reference, rollout, save_copy, startup))
    return out
