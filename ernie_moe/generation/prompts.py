"""What every command that answers prompts shares: the encoder of a model folder's prompts, and the error of a
request that cannot be answered."""

from __future__ import annotations

from collections import Counter

from ..config.schema import DataConfig, ModelConfig
from ..data.encoding.packing import Encoder
from ..data.encoding.tokenizer import Tokenizer


class UsageError(ValueError):
    """A request that cannot be answered; the message says why."""


class ContextTooLong(UsageError):
    """A prompt that leaves the model no position to answer in."""


def check_room(prompt, positions: int) -> None:
    """ContextTooLong when ``prompt`` takes all of the model's ``positions`` (max_position_embeddings)."""
    taken = int(prompt.position_ids.max()) + 1
    if taken >= positions:
        raise ContextTooLong(f"the prompt takes {taken} positions; the model has {positions} "
                             "(max_position_embeddings), leaving none to answer")


def prompt_encoder(tokenizer: Tokenizer, model_cfg: ModelConfig, data: DataConfig) -> Encoder:
    """The training encoder of ``data``, any prompt length the model's positions allow."""
    return Encoder(tokenizer, model_cfg, model_cfg.max_position_embeddings, "skip", data.max_image_side, Counter(),
                   data.pixel_budget, data.video_budget)
