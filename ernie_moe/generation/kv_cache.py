"""The model's blocks over new tokens, attending to the keys and values cached for the earlier ones."""

from __future__ import annotations

import numpy as np
import paddle

from ..model.blocks import FinalNorm
from ..model.decoder import DecoderLayer
from ..nn.flashmask import RowBounds
from ..parallel.pipeline import TrainedModel
from ..parallel.zero import held


class LayerCache:
    """One decoder layer's keys and values, ``[batch, tokens so far, kv heads, head dim]``."""

    def __init__(self):
        self.keys = self.values = None

    def extend(self, keys: paddle.Tensor, values: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        if self.keys is not None:
            keys, values = paddle.concat([self.keys, keys], axis=1), paddle.concat([self.values, values], axis=1)
        self.keys, self.values = keys, values
        return keys, values

    def truncate(self, tokens: int) -> None:
        """Keep the first ``tokens`` tokens' keys and values (speculative drafts' leave)."""
        if self.keys is not None and self.keys.shape[1] > tokens:
            self.keys, self.values = self.keys[:, :tokens], self.values[:, :tokens]


class KVCache:
    """``padding``: each row's positions of padding before its prompt (several prompts decoded side by side), which
    no row sees; None: none. ``drafts``: caches of the multi-token prediction depths that draft tokens
    (``generation.speculative``), slot for slot with the model's."""

    def __init__(self, num_layers: int, padding: np.ndarray | None = None, drafts: int = 0):
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.drafts = [LayerCache() for _ in range(drafts)]
        self.length = 0  # tokens cached
        self.padding = padding
        self.unseen: np.ndarray | None = None  # [rows, slots]: cached tokens no later token sees (rejected drafts)

    def bounds(self, rows: int, new: int, first: int | None = None) -> RowBounds | None:
        """Which keys the ``new`` tokens of each row see: every cached and new key up to itself, but padding and
        rejected drafts. ``first``: the slot of the first new token (default: after the cache). None where one new
        token per row sees every key (most decoding steps): its attention needs no mask."""
        first = self.length if first is None else first
        total = first + new
        padding = self.padding
        padded = padding is not None and bool(padding.any())
        unseen = None if self.unseen is None else self.unseen[:, :total]
        if new == 1 and not padded and (unseen is None or not unseen.any()):
            return None
        keys = np.arange(total)
        ends = np.full([rows, total], total, dtype=np.int64)
        if padding is not None and padded:
            ends = np.where(keys[None, :] < padding[:, None], keys[None, :], ends)  # seen by no row
        if unseen is not None:
            ends[:, : unseen.shape[1]] = np.where(unseen, keys[: unseen.shape[1]], ends[:, : unseen.shape[1]])
        return RowBounds.causal_on_host(ends, new, first)

    def hide(self, rows: int, row: int, slot: int) -> None:
        """No later token of ``row`` (of ``rows``) sees the token cached at ``slot``."""
        if self.unseen is None or self.unseen.shape[1] <= slot:
            grown = np.zeros([rows, max(2 * slot, 64)], dtype=bool)
            if self.unseen is not None:
                grown[:, : self.unseen.shape[1]] = self.unseen
            self.unseen = grown
        self.unseen[row, slot] = True


@paddle.no_grad()
def forward_cached(model: TrainedModel, inputs: tuple, cache: KVCache, keep: bool = False):
    """Logits ``[batch, new tokens, vocab]`` of ``model`` for ``inputs`` (the first block's tuple,
    ``model.blocks.block_inputs``: one document per row), the new tokens seeing the cached ones; their keys and
    values join the cache. With an empty cache this is the model's own forward. A pipeline stage runs its own
    blocks, and every stage returns the last stage's logits of the last new token (``[batch, 1, vocab]``).
    ``keep``: (logits, the tuple entering the final norm: the last decoder layer's hidden states, and the token
    embeddings it carries for multi-token prediction)."""
    # the new tokens are the last rows: each sees every cached token and the new ones up to itself
    rows, new = inputs[0].shape
    bounds = cache.bounds(rows, new)
    x, kept = model.decoding_input(inputs), None
    for block in model.decoding_blocks():
        if isinstance(block, DecoderLayer):
            hidden, router_loss, token_type_ids, position_ids, key_ends, *carried = x
            angles, _ = block.attention_inputs(position_ids, key_ends)  # made once for the layers that share them
            with held(model, block):  # sharding stage 3: the layer's weights, gathered for its body
                hidden, _ = block.body(hidden, token_type_ids, angles, bounds, cache.layers[block.layer_idx])
            x = (hidden, router_loss, token_type_ids, position_ids, key_ends, *carried)
        else:
            kept = x if isinstance(block, FinalNorm) else kept
            x = block(x)
    cache.length += new
    return (model.decoding_output(x), kept) if keep else model.decoding_output(x)
