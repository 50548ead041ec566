"""What the package's commands share."""

from __future__ import annotations

import argparse
import math

DRAFT_TOKENS = 1  # speculative decoding's drafts per step by default on a GPU
MAX_DRAFT_TOKENS = 16  # drafts per step at most: each is one more pass of the depth, and more than a few lose time


def bounded(kind: type, low: float, high: float = math.inf, low_included: bool = True):
    """An argparse type: a finite ``kind`` (int or float) from ``low`` (itself only if ``low_included``) to
    ``high``; argparse exits 2 with the message for anything else."""
    def show(v) -> str:  # whole numbers as 1,000,000, not 1e+06
        return f"{int(v):,}" if kind is int else f"{v:g}"

    if high < math.inf:
        wanted = f"from {show(low)} to {show(high)}" if low_included else f"above {show(low)} and at most {show(high)}"
    else:
        wanted = f"at least {show(low)}" if low_included else f"above {show(low)}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'a whole number' if kind is int else 'a number'}, not {text!r}") from None
        if not (math.isfinite(value) and (value >= low if low_included else value > low) and value <= high):
            raise argparse.ArgumentTypeError(f"must be {wanted}, not {text}")
        return value
    return parse


at_least_one = bounded(int, 1)
# the largest sizes an option takes, far above any device or file, so that a size times its unit stays a number
MAX_GB, MAX_MB = 1e6, 1e9


def add_thinking_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--thinking", choices=("on", "off"),
                        help="a Thinking model: reason first (on), or answer at once (off: the answer opens with the "
                             "empty think block); default: the chat template's own")


def thinking_of(args) -> bool | None:
    """``--thinking`` as the chat template's ``enable_thinking``: True, False, or None (not given)."""
    thinking = getattr(args, "thinking", None)
    return None if thinking is None else thinking == "on"


def add_decoding_arguments(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """What every command that answers prompts takes: how to decode, and the config of how to encode."""
    parser.add_argument("--max-new-tokens", type=at_least_one, default=max_new_tokens)
    parser.add_argument("--temperature", type=bounded(float, 0), default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=bounded(float, 0, 1, low_included=False), default=1.0)
    parser.add_argument("--seed", type=bounded(int, 0), default=0)
    parser.add_argument("--config", help="a training config whose data section overrides the folder's settings")
    add_thinking_argument(parser)
    add_speculative_argument(parser)


def add_speculative_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-tokens", type=bounded(int, 0, MAX_DRAFT_TOKENS), default=drafts_by_default(),
                        help="speculative decoding where the model has multi-token prediction layers: tokens they "
                             "draft per step, checked in one forward (the same greedy answers, the same sampling "
                             f"distribution); 0: off (default: {DRAFT_TOKENS} on a GPU, 0 on a CPU)")


def drafts_by_default() -> int:
    """Drafts per step where the command is not told: ``DRAFT_TOKENS`` where the model decodes on a GPU, none on a
    CPU, where float32 matmuls of 2 to 8 rows cost over twice one row's, so checking drafts costs more than they save
    (``benchmarks/bench_generate.py --step-costs``)."""
    import paddle

    return 0 if paddle.device.get_device() == "cpu" else DRAFT_TOKENS
