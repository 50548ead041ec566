"""What the model will see: one training sample (or preference pair) as encoded, and the data's figures over the
first samples.

The run prints both at start and writes them to ``data_report.json`` in its output folder. The samples are the
first ``data.report_samples`` of the first epoch's order, encoded by the run's own encoder.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..encoding.packing import Row
from ..encoding.tokenizer import Tokenizer, unknown_tokens, unknown_warning
from ..formats.sample import BadSample
from .plan import sample_order

TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"  # marks the tokens a sample trains on in the rendered text


def render(encoded, tokenizer: Tokenizer) -> str:
    """The sample's text as its tokens decode, the trained tokens between [[ and ]], each image or video as
    ``<image t x h x w: N tokens>``."""
    out: list[str] = []
    run: list[int] = []
    run_trained = False
    grids = iter(encoded.grids)

    def flush():
        if run:
            text = tokenizer.decode(run)
            out.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if run_trained else text)
            run.clear()

    ids, types, target = encoded.input_ids, encoded.token_type_ids, encoded.target
    i = 0
    while i < len(ids):
        if types[i] > 0 and ids[i] == tokenizer.image_token_id:
            flush()
            end = i
            while end < len(ids) and types[end] == types[i] and ids[end] == tokenizer.image_token_id:
                end += 1
            grid = next(grids, None)
            kind = "video" if types[i] == 2 else "image"
            shape = " x ".join(str(int(g)) for g in grid) if grid is not None else "?"
            out.append(f"<{kind} {shape}: {end - i} tokens>")
            i = end
            continue
        if bool(target[i]) != run_trained:
            flush()
            run_trained = bool(target[i])
        run.append(int(ids[i]))
        i += 1
    flush()
    return "".join(out)


def data_report(dataset, encoder, tokenizer: Tokenizer, count: int, seed: int) -> dict:
    """Figures over the first ``count`` samples of epoch 0: records per source, skipped by reason, tokens per
    sample, the share of image tokens, of trained tokens and of truncated samples; and the first usable sample
    rendered. ``encoder`` counts what it truncates in its own ``stats``: give it one the run does not read."""
    order = sample_order(seed, 0, len(dataset))[:count]
    sources: Counter = Counter()
    skipped: Counter = Counter()
    lengths: list[int] = []
    image_tokens = trained = unknown = text_tokens = 0
    first = None
    truncated_before = encoder.stats["overlong_truncated"]
    for index in (int(i) for i in order):
        sources[_source_name(dataset, index)] += 1
        try:
            encoded = encoder(dataset[index])
        except BadSample as bad:
            skipped[bad.reason] += 1
            continue
        if isinstance(encoded, Row):  # a preference pair's row
            encoded = encoded.unpadded()
        lengths.append(len(encoded))
        image_tokens += int((encoded.token_type_ids > 0).sum())
        trained += int(encoded.target.sum())
        unk, text = unknown_tokens(encoded.input_ids, encoded.token_type_ids, tokenizer.unk_id)
        unknown, text_tokens = unknown + unk, text_tokens + text
        if first is None:
            first = encoded
    truncated = encoder.stats["overlong_truncated"] - truncated_before
    tokens = int(np.sum(lengths)) if lengths else 0
    report = {
        "samples_read": len(order),
        "records_per_source": dict(sources),
        "skipped": dict(skipped),
        "tokens_per_sample": {"min": int(min(lengths)), "mean": round(float(np.mean(lengths)), 1),
                              "max": int(max(lengths))} if lengths else {},
        "image_token_share": round(image_tokens / tokens, 4) if tokens else 0.0,
        "trained_token_share": round(trained / tokens, 4) if tokens else 0.0,
        "truncated_share": round(truncated / len(lengths), 4) if lengths else 0.0,
        "unknown_token_share": round(unknown / text_tokens, 4) if text_tokens else 0.0,
    }
    if first is not None:
        report["first_sample"] = {"text": render(first, tokenizer), "tokens": len(first),
                                  "grids": [[int(g) for g in grid] for grid in first.grids]}
    return report


def describe(report: dict) -> str:
    """The report as the run prints it."""
    lines = [f"data report (first {report['samples_read']} samples, data_report.json):",
             "  records per source: " + ", ".join(f"{k} {v}" for k, v in report["records_per_source"].items())]
    lines.append("  skipped: " + (", ".join(f"{k} {v}" for k, v in sorted(report["skipped"].items())) or "none"))
    if report["tokens_per_sample"]:
        t = report["tokens_per_sample"]
        lines.append(f"  tokens per sample: {t['min']} to {t['max']}, mean {t['mean']}; image tokens "
                     f"{report['image_token_share']:.1%}, trained {report['trained_token_share']:.1%}, "
                     f"truncated samples {report['truncated_share']:.1%}")
    warning = unknown_warning(report.get("unknown_token_share", 0.0), "the training data")
    if warning:
        lines.append(f"  WARNING {warning}")
    if "first_sample" in report:
        first = report["first_sample"]
        lines.append(f"  first sample ({first['tokens']} tokens, trained tokens between {TRAINED_OPEN} and "
                     f"{TRAINED_CLOSE}):")
        lines += ["    " + line for line in first["text"].splitlines() or [""]]
    return "\n".join(lines)


def _source_name(dataset, index: int) -> str:
    if hasattr(dataset, "source_of"):
        source, _ = dataset.source_of(index)
        return str(dataset.sources[source].path)
    return str(getattr(dataset, "path", type(dataset).__name__))
