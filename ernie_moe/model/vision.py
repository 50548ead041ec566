"""Vision side: a ViT over flattened patches with 2D rotary positions, and the adapter to the LM width.

Patches of one image arrive in merge-block order: for each frame, for each (merge x merge) block in
row-major order, the block's patches in row-major order. So every run of ``merge**2`` consecutive
patches is one spatial neighbourhood and the adapter's spatial merge is a reshape.
"""

from __future__ import annotations

import functools

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from ..config.schema import ModelConfig, VisionConfig
from ..nn import contiguous, kernels
from ..nn.layers import RMSNorm
from ..nn.recompute import Recomputable
from ..nn.rope import Rotation, vision_rope_angles
from .attention import core_attention


def patch_positions(grid_thw: np.ndarray, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(t, h, w) position ``[patches, 3]`` and image index ``[patches]`` of every patch, in merge-block order."""
    positions, owners = [], []
    for image, (t, h, w) in enumerate(np.asarray(grid_thw, dtype=np.int64)):
        rows_cols = _frame_rows_cols(int(h), int(w), merge)
        frames = np.repeat(np.arange(t), len(rows_cols))[:, None]
        positions.append(np.concatenate([frames, np.tile(rows_cols, (t, 1))], axis=1))
        owners.append(np.full(len(frames), image))
    if not positions:
        return np.zeros([0, 3], np.int64), np.zeros([0], np.int64)
    return np.concatenate(positions), np.concatenate(owners)


@functools.lru_cache(maxsize=256)
def _frame_rows_cols(h: int, w: int, merge: int) -> np.ndarray:
    """(row, col) ``[h * w, 2]`` of one frame's patches in merge-block order (made once per frame size)."""
    bh, bw, dh, dw = np.meshgrid(np.arange(h // merge), np.arange(w // merge), np.arange(merge), np.arange(merge),
                                 indexing="ij")
    rows_cols = np.stack([(bh * merge + dh).reshape(-1), (bw * merge + dw).reshape(-1)], axis=-1)
    rows_cols.flags.writeable = False  # shared by every call
    return rows_cols


def same_size_groups(grid_thw: np.ndarray) -> list[tuple[np.ndarray, int, int]]:
    """(patch indices, frames, patches per frame) for each frame size. Attention runs within each frame (a
    still image is one, a video's frames are attended one by one, as in ERNIE's ViT), batched over the frames
    of one size, so its cost grows with patches per frame, not with all the patches of the batch."""
    grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    sizes = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    groups: dict[int, list[np.ndarray]] = {}
    for start, size in zip(starts, sizes):
        groups.setdefault(int(size), []).append(np.arange(start, start + size))
    return [(np.concatenate(rows), len(rows), size) for size, rows in groups.items()]


def frame_shares(grid_thw: np.ndarray, parts: int) -> list[tuple[int, int, np.ndarray]]:
    """Whole frames cut into ``parts`` contiguous shares of about equal patches: (first patch, end patch, grid of
    the share's frames) each. A video's frames may go to several shares (the ViT attends within one frame); a
    share may be empty when there are fewer frames than parts."""
    grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    images = np.repeat(np.arange(len(grids)), grids[:, 0])
    sizes = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    # share r ends with the first frame that reaches r / parts of the patches
    cuts = [0] + [int(np.searchsorted(ends, total * r / parts)) + 1 if total else 0 for r in range(1, parts)]
    cuts = [min(cut, len(sizes)) for cut in cuts] + [len(sizes)]
    shares = []
    for first, end in zip(cuts[:-1], cuts[1:]):
        frames: list[list[int]] = []
        for frame in range(first, end):  # consecutive frames of one image stay one grid row
            if frames and frames[-1][0] == images[frame]:
                frames[-1][1] += 1
            else:
                frames.append([images[frame], 1])
        grid = np.array([[count, *grids[image, 1:]] for image, count in frames], dtype=np.int64).reshape(-1, 3)
        start = int(ends[first - 1]) if first else 0
        shares.append((start, int(ends[end - 1]) if end else 0, grid))
    return shares


def blank_merge_block(cfg: VisionConfig, dtype) -> tuple[paddle.Tensor, np.ndarray]:
    """One merge block of zero patches and its grid: what a rank without images runs, times 0, so that
    gradient synchronisation finds a gradient for every vision parameter on every rank."""
    grid = np.array([[1, cfg.spatial_merge_size, cfg.spatial_merge_size]])
    return paddle.zeros([cfg.spatial_merge_size ** 2, cfg.in_channels * cfg.patch_size ** 2], dtype=dtype), grid


def quick_gelu(x):
    return x * F.sigmoid(1.702 * x)


class VisionAttention(nn.Layer):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, angles, groups):
        """``groups``: (patch indices, images, patches per image) tensors of each image size, and the order
        that puts the groups' outputs back."""
        n = x.shape[0]
        q, k, v = contiguous.split(self.qkv(x).reshape([n, 3 * self.num_heads, -1]), 3, axis=1)
        q, k = kernels.vision_rotary(q, angles), kernels.vision_rotary(k, angles)
        sizes, restore = groups
        outs = []
        for index, images, size in sizes:
            # (no index: the group is every patch, in order)
            qg, kg, vg = (t.reshape([images, size, self.num_heads, -1]) if index is None else
                          paddle.gather(t, index).reshape([images, size, self.num_heads, -1]) for t in (q, k, v))
            # within one image every patch sees every other: no mask
            outs.append(core_attention(qg, kg, vg, None).reshape([images * size, -1]))
        out = outs[0] if restore is None else paddle.gather(paddle.concat(outs), restore)
        return self.proj(out)


class VisionMLP(nn.Layer):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        hidden = int(cfg.embed_dim * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, cfg.embed_dim)
        self.act = quick_gelu if cfg.hidden_act == "quick_gelu" else F.gelu

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(Recomputable, nn.Layer):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, epsilon=1e-6)
        self.attn = VisionAttention(cfg.embed_dim, cfg.num_heads)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, epsilon=1e-6)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, angles, groups):
        return self.piece("body", x, angles, groups=groups)  # the image groups by keyword: recompute binds them

    def body(self, x, angles, groups):
        x = x + self.attn(self.norm1(x), angles, groups)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Layer):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.in_channels * cfg.patch_size ** 2, cfg.embed_dim, bias_attr=False)

    def forward(self, patches):
        return self.proj(patches)


class VisionTransformer(nn.Layer):
    """Bidirectional attention inside each image; no attention across images."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.LayerList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.ln = nn.LayerNorm(cfg.embed_dim, epsilon=1e-6)

    def forward(self, patches: paddle.Tensor, grid_thw: np.ndarray) -> paddle.Tensor:
        positions, _ = patch_positions(grid_thw, self.cfg.spatial_merge_size)
        head_dim = self.cfg.embed_dim // self.cfg.num_heads
        # frames share 2D positions; the LM's 3D RoPE orders them in time
        angles = Rotation(vision_rope_angles(positions[:, 1:], head_dim, self.cfg.rope_theta),
                          interleaved=False)
        sizes = same_size_groups(grid_thw)
        groups: tuple[list, paddle.Tensor | None]
        if len(sizes) == 1:  # frames of one size: every patch, in order
            groups = ([(None, *sizes[0][1:])], None)
        else:
            order = np.concatenate([index for index, _, _ in sizes])
            groups = ([(paddle.to_tensor(index), images, size) for index, images, size in sizes],
                      paddle.to_tensor(np.argsort(order)))
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, angles, groups=groups)
        return self.ln(x)


def image_token_count(grid_thw, merge: int, temporal: int) -> int:
    """LM placeholder tokens one image (t, h, w patches) becomes after the adapter's merges."""
    t, h, w = (int(v) for v in grid_thw)
    return -(-t // temporal) * (h // merge) * (w // merge)


class Adapter(nn.Layer):
    """ERNIE's resampler: spatial merge -> MLP, temporal merge -> MLP, then to the LM width."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.merge = cfg.spatial_conv_size
        self.temporal = cfg.temporal_conv_size
        width = cfg.pixel_hidden_size * self.merge ** 2
        # ERNIE's epsilon (1e-6), not Paddle's default: it matters where the merged features are small
        self.spatial_linear = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width),
                                            nn.LayerNorm(width, epsilon=1e-6))
        if self.temporal > 1:
            self.temporal_linear = nn.Sequential(nn.Linear(width * self.temporal, width), nn.GELU(),
                                                 nn.Linear(width, width), nn.LayerNorm(width, epsilon=1e-6))
        self.mlp = nn.Linear(width, cfg.hidden_size)
        self.after_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, features: paddle.Tensor, grid_thw: np.ndarray) -> paddle.Tensor:
        x = self.spatial_linear(features.reshape([-1, features.shape[-1] * self.merge ** 2]))
        if self.temporal > 1:
            x = self.temporal_linear(self._merge_frames(x, grid_thw))
        return self.after_norm(self.mlp(x))

    def _merge_frames(self, x, grid_thw):
        """Concatenate each group of ``temporal`` consecutive frames; a short last group repeats its frame. One
        gather, its rows planned on the host from the grid."""
        return paddle.gather(x, paddle.to_tensor(self._frame_rows(grid_thw))).reshape([-1, self.temporal * x.shape[-1]])

    def _frame_rows(self, grid_thw) -> np.ndarray:
        """The rows of ``x`` in merged order: for each image, group and position, its frames of the group."""
        pieces, start = [], 0
        for t, h, w in np.asarray(grid_thw, dtype=np.int64):
            per_frame = (h // self.merge) * (w // self.merge)
            groups = -(-t // self.temporal)
            frame = np.minimum(np.arange(groups * self.temporal), t - 1).reshape(groups, 1, self.temporal)
            pieces.append((start + frame * per_frame + np.arange(per_frame)[None, :, None]).reshape(-1))
            start += t * per_frame
        return np.concatenate(pieces) if pieces else np.zeros([0], np.int64)
