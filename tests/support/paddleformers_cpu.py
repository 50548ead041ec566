"""CPU code for the GPU-only kernels PaddleFormers' ERNIE-4.5-VL forward calls, so that its model runs here as the
reference for this package's logits. Each computes what the kernel computes for the inputs the reference gives it
in one process; ``install()`` puts them where PaddleFormers looks them up.

- ``flashmask_attention`` (the ViT's attention): softmax attention in float32 under the same block mask. The
  ViT casts q, k and v to bfloat16 only to feed that kernel; the replaced forward leaves the casts out with it.
- ``expand_modality_expert_id``: a modality's expert index to its index among all experts.
- ``moe_gate_dispatch_partial_nosoftmaxtopk``: the unpadded layout of the published dispatch; an expert keeps
  choices up to its capacity, every token's first choice before any second choice, and a dropped choice gets
  weight 0 (PaddleFormers renormalises the kept weights after it).
- ``build_src_rank_and_local_expert_id``: each dispatched row's rank and expert there.
- ``moe_combine``: the weighted sum of each token's expert outputs.
- ``async_offload`` / ``create_async_load``: device-to-host copies, already done on a CPU.
"""

import numpy as np
import paddle
import paddle.nn.functional as F


def flashmask_attention(q, k, v, startend_row_indices, causal=False):
    """q, k, v ``[1, seq, heads, head_dim]``; key j is seen by rows ``UTE[j] <= i < LTS[j]``."""
    assert not causal
    q, k, v = (t.astype("float32").transpose([0, 2, 1, 3]) for t in (q, k, v))
    lts, ute = startend_row_indices[0, 0, :, 0], startend_row_indices[0, 0, :, 1]
    rows = paddle.arange(q.shape[2], dtype=lts.dtype).unsqueeze(1)
    seen = (rows >= ute.unsqueeze(0)) & (rows < lts.unsqueeze(0))
    scores = q @ k.transpose([0, 1, 3, 2]) / q.shape[-1] ** 0.5
    scores = paddle.where(seen, scores, paddle.full_like(scores, float("-inf")))
    return (F.softmax(scores, -1) @ v).transpose([0, 2, 1, 3])


def vision_attention_forward(self, hidden_states, startend_row_indices, rotary_pos_emb=None, attn_sep=False):
    """PaddleFormers' ``VisionFlashAttention2.forward`` on one process, the attention kernel in float32."""
    from paddleformers.transformers.ernie4_5_moe_vl.model.dfnrope.modeling import apply_rotary_pos_emb_vision

    assert not attn_sep
    n = hidden_states.shape[0]
    qkv = self.qkv(hidden_states).reshape([n, 3, self.num_heads, -1]).transpose(perm=[1, 0, 2, 3])
    q, k, v = qkv.unbind(axis=0)
    q = apply_rotary_pos_emb_vision(q.unsqueeze(axis=0), rotary_pos_emb).squeeze(axis=0)
    k = apply_rotary_pos_emb_vision(k.unsqueeze(axis=0), rotary_pos_emb).squeeze(axis=0)
    out = flashmask_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), startend_row_indices)
    return self.proj(out.reshape([n, -1]))


def expand_modality_expert_id(expert_id, num_expert_per_modality, group_size, modality_offset, is_group_expert):
    """Each rank holds its text experts, then its multimodal ones: expert e of a modality is expert
    ``rank * 2 * per_modality + e % per_modality + offset * per_modality`` of all."""
    e = expert_id
    if is_group_expert:
        e = e + paddle.arange(e.shape[-1], dtype=e.dtype) * group_size
    if num_expert_per_modality > 0:
        rank, within = e // num_expert_per_modality, e % num_expert_per_modality
        e = rank * (num_expert_per_modality * 2) + within + modality_offset * num_expert_per_modality
    return e


def moe_gate_dispatch_partial_nosoftmaxtopk(x, combine_weights, expert_id, k, capacity, num_experts, use_pad,
                                            expert_start_index, expert_end_index, reverse_token_drop=False):
    """The unpadded layout: the local experts' kept tokens, expert after expert, each expert's in sequence order.
    Returns the rows, the weights (zero for dropped choices and other ranks' experts), token -> row ``[k, seq]``,
    row -> token, the tokens per expert over all experts before capacity, and the kept ones of the local experts."""
    assert not use_pad, "the published dispatch (v2-alltoall-unpad) is unpadded"
    assert not reverse_token_drop
    ids = expert_id.numpy().astype(np.int64)
    counts = np.bincount(ids.reshape(-1), minlength=num_experts)
    kept, taken = np.zeros(ids.shape, bool), np.zeros([num_experts], np.int64)
    for slot in range(ids.shape[1]):  # first choices claim an expert's slots before second choices
        for s in range(ids.shape[0]):
            if taken[ids[s, slot]] < capacity:
                taken[ids[s, slot]] += 1
                kept[s, slot] = True
    experts = np.arange(num_experts)
    is_local = (experts >= expert_start_index) & (experts < expert_end_index)
    local_counts = np.where(is_local, taken, 0)
    next_row = np.concatenate([[0], np.cumsum(local_counts)[:-1]])
    to_row = np.zeros(ids.shape, np.int32)
    from_row = np.zeros([local_counts.sum()], np.int64)
    for s, slot in np.ndindex(*ids.shape):
        e = ids[s, slot]
        if is_local[e] and kept[s, slot]:
            to_row[s, slot], from_row[next_row[e]] = next_row[e], s
            next_row[e] += 1
    rows = paddle.gather(x, paddle.to_tensor(from_row))
    weights = combine_weights * paddle.to_tensor((is_local[ids] & kept).astype(np.float32))
    return (rows, weights, paddle.to_tensor(to_row.T.copy()), paddle.to_tensor(from_row.astype(np.int32)),
            paddle.to_tensor(counts), paddle.to_tensor(local_counts))


def build_src_rank_and_local_expert_id(expert_num_global, expert_num_global_list, num_local_experts):
    """For each dispatched row, expert by expert: the rank holding its expert and the expert's index there (the
    NumPy this kernel replaced, kept in a comment in PaddleFormers' MOEAllGatherLayerV2)."""
    counts = list(expert_num_global_list)
    send_rank = np.concatenate([np.full([n], e // num_local_experts, np.int32) for e, n in enumerate(counts)])
    local_expert = np.concatenate([np.full([n], e % num_local_experts, np.int32) for e, n in enumerate(counts)])
    return paddle.to_tensor(send_rank), paddle.to_tensor(local_expert)


def moe_combine(x, combine_weights, scatter_index):
    """``out[s] = sum over slots of weight[s, slot] * x[scatter_index[s, slot]]``."""
    picked = paddle.gather(x, scatter_index.reshape([-1]).astype("int64"))
    picked = picked.reshape(list(scatter_index.shape) + [x.shape[-1]])
    return (picked * combine_weights.astype(x.dtype).unsqueeze(-1)).sum(1)


class _Copied:
    """A device-to-host copy that is already done."""

    def cpu_wait(self):
        pass

    cuda_wait = wait = cpu_wait


def async_offload(tensor, loader=None):
    return tensor, _Copied()


def install():
    from paddleformers.transformers.ernie4_5_moe_vl.model import modeling_moe
    from paddleformers.transformers.ernie4_5_moe_vl.model.dfnrope import modeling as vit
    from paddleformers.transformers.ernie4_5_moe_vl.model.distributed import common_dist_utils
    from paddleformers.transformers.ernie4_5_moe_vl.model.moe import moe_all_gather_layer, moe_layer
    from paddleformers.transformers.ernie4_5_moe_vl.model.utils import misc

    vit.VisionFlashAttention2.forward = vision_attention_forward
    common_dist_utils.create_async_load = lambda: None
    replacements = {"async_offload": async_offload, "expand_modality_expert_id": expand_modality_expert_id,
                    "moe_gate_dispatch_partial_nosoftmaxtopk": moe_gate_dispatch_partial_nosoftmaxtopk,
                    "build_src_rank_and_local_expert_id": build_src_rank_and_local_expert_id,
                    "moe_combine": moe_combine}
    for module in (modeling_moe, moe_all_gather_layer, moe_layer, misc, common_dist_utils):
        for name, function in replacements.items():
            if hasattr(module, name):
                setattr(module, name, function)
