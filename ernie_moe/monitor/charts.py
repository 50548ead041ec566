"""Expert-load pictures for VisualDL's image page, drawn with Pillow: a layers x experts heat map with labelled axes
and a colour legend, and a bar per expert for every layer. Both colour an expert by its load / mean load (blue
below 1, white at 1, red at 2 and above), so the two pictures read the same way."""

from __future__ import annotations

import functools

import numpy as np

INK = (20, 20, 20)
MISSING = (128, 128, 128)  # a layer with fewer experts than the widest one
TITLE_H, LEGEND_W, LABEL_W = 30, 90, 72


def load_colours(ratio: np.ndarray) -> np.ndarray:
    """uint8 RGB of load / mean load: blue at 0, white at 1, red at 2 and above."""
    t = np.clip(np.asarray(ratio, np.float64) - 1.0, -1.0, 1.0)
    rgb = np.stack([np.where(t < 0, 1 + t, 1.0), 1 - np.abs(t), np.where(t > 0, 1 - t, 1.0)], axis=-1)
    return np.round(rgb * 255).astype(np.uint8)


@functools.cache
def _font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _canvas(width: int, height: int, title: str):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    draw.text((8, 7), title, fill=INK, font=_font(15))
    return image, draw


def _legend(image, draw, left: int, top: int, height: int) -> None:
    """A vertical colour bar from 0 (bottom) to 2 (top) with its ticks and name."""
    from PIL import Image

    font = _font(12)
    draw.text((left, top - 24), "load / mean", fill=INK, font=font)
    bar_top = top + 4
    column = load_colours(np.linspace(2.0, 0.0, height))[:, None, :]
    image.paste(Image.fromarray(np.ascontiguousarray(np.repeat(column, 17, axis=1))), (left, bar_top))
    draw.rectangle([left, bar_top, left + 16, bar_top + height - 1], outline=INK)
    for value, label in ((2.0, ">=2"), (1.0, "1"), (0.0, "0")):
        y = bar_top + round((1 - value / 2) * (height - 1))
        draw.line([(left + 16, y), (left + 21, y)], fill=INK)
        draw.text((left + 24, y - 7), label, fill=INK, font=font)


def heat_map(rows: list[np.ndarray], layers: list[int], title: str, cell: int | None = None) -> np.ndarray:
    """Layers (rows) x experts (columns) of load / mean load, each cell also written as a number.

    ``rows``: tokens per expert of each layer, in the order of ``layers``.
    """
    experts = max(len(r) for r in rows)
    cell = cell or int(np.clip(640 // experts, 28, 56))
    grid_w, grid_h = experts * cell, len(rows) * cell
    width = LABEL_W + grid_w + LEGEND_W
    height = TITLE_H + 22 + max(grid_h, 120) + 40
    image, draw = _canvas(width, height, title)
    top, font = TITLE_H + 22, _font(min(13, cell // 3 + 3))
    for i, (layer, routed) in enumerate(zip(layers, rows)):
        ratio = routed / max(float(routed.mean()), 1e-9)
        y = top + i * cell
        draw.text((8, y + cell // 2 - 7), f"layer {layer}", fill=INK, font=_font(13))
        for e in range(experts):
            x = LABEL_W + e * cell
            colour = tuple(int(c) for c in load_colours(ratio[e])) if e < len(routed) else MISSING
            draw.rectangle([x, y, x + cell - 1, y + cell - 1], fill=colour, outline=(255, 255, 255))
            if e < len(routed) and cell >= 28:
                draw.text((x + cell // 2, y + cell // 2), f"{ratio[e]:.2f}", fill=INK, font=font, anchor="mm")
    axis = _font(12)
    for e in range(experts):
        draw.text((LABEL_W + e * cell + cell // 2, top + grid_h + 10), str(e), fill=INK, font=axis, anchor="mm")
    draw.text((LABEL_W + grid_w // 2, top + grid_h + 28), "expert", fill=INK, font=axis, anchor="mm")
    _legend(image, draw, LABEL_W + grid_w + 20, top, max(grid_h, 120) - 8)
    return np.asarray(image)


def bar_chart(rows: list[np.ndarray], layers: list[int], title: str, bar: int | None = None) -> np.ndarray:
    """Tokens per expert, one panel of bars per layer (its own scale), the mean as a dashed line."""
    experts = max(len(r) for r in rows)
    bar = bar or int(np.clip(640 // experts, 20, 48))
    panel_h, plot_h = 96, 64
    width = LABEL_W + experts * bar + 24
    height = TITLE_H + len(rows) * panel_h + 26
    image, draw = _canvas(width, height, title)
    small = _font(12)
    for i, (layer, routed) in enumerate(zip(layers, rows)):
        base = TITLE_H + i * panel_h + 14 + plot_h  # the panel's zero line
        top_value = max(float(routed.max()), 1.0)
        mean = float(routed.mean())
        draw.text((8, base - plot_h - 4), f"layer {layer}", fill=INK, font=_font(13))
        draw.text((8, base - plot_h + 14), f"max {int(top_value)}", fill=INK, font=small)
        colours = load_colours(routed / max(mean, 1e-9))
        for e, count in enumerate(routed):
            x = LABEL_W + e * bar
            h = round(plot_h * float(count) / top_value)
            draw.rectangle([x + 2, base - h, x + bar - 3, base], fill=tuple(int(c) for c in colours[e]), outline=INK)
        y = base - round(plot_h * mean / top_value)
        for x in range(LABEL_W, LABEL_W + experts * bar, 8):
            draw.line([(x, y), (x + 4, y)], fill=INK)
        draw.line([(LABEL_W, base), (LABEL_W + experts * bar, base)], fill=INK)
    bottom = TITLE_H + len(rows) * panel_h + 14
    for e in range(experts):
        draw.text((LABEL_W + e * bar + bar // 2, bottom - 4), str(e), fill=INK, font=small, anchor="mm")
    draw.text((8, bottom - 10), "expert", fill=INK, font=small)
    return np.asarray(image)


BEFORE, AFTER_UP, AFTER_DOWN, AFTER_SAME = (160, 160, 160), (60, 120, 200), (200, 60, 60), (150, 185, 220)
MAX_LABEL_W = 520  # pixels a row's label may take before it is cut
MAX_LABEL_CHARS = 90  # characters that fit in it, roughly (a category name can be any length)


def comparison_chart(rows: list[tuple[str, float, float, float, float]], title: str) -> np.ndarray:
    """Two scores (0 to 1) per labelled row, before (grey) above after (blue where the change's 95% interval lies
    above zero, pale blue where it holds zero, red where it lies below), with the change and its interval written
    beside them, and a legend saying so.

    ``rows``: (label, before, after, interval low, interval high)."""
    font, small = _font(13), _font(12)
    _, measure = _canvas(1, 1, "")
    longest = max((measure.textlength(label, font=font) for label, *_ in rows), default=0)
    label_w = int(min(max(longest + 16, 160), MAX_LABEL_W))
    plot_w, note_w, row_h = 360, 230, 34
    width, height = max(label_w + plot_w + note_w, 760), TITLE_H + 20 + len(rows) * row_h + 50
    image, draw = _canvas(width, height, title)
    top = TITLE_H + 16
    for i, (label, before, after, low, high) in enumerate(rows):
        y = top + i * row_h
        label = label if len(label) <= MAX_LABEL_CHARS else label[: MAX_LABEL_CHARS - 1] + "…"
        while measure.textlength(label, font=font) > label_w - 16:  # a few characters at most, once cut
            label = label[:-2] + "…"
        draw.text((8, y + 8), label, fill=INK, font=font)
        after_colour = AFTER_DOWN if high < 0 else AFTER_UP if low > 0 else AFTER_SAME
        for offset, value, colour in ((2, before, BEFORE), (15, after, after_colour)):
            draw.rectangle([label_w, y + offset, label_w + round(plot_w * min(max(value, 0.0), 1.0)),
                            y + offset + 11], fill=colour)
        draw.text((label_w + plot_w + 10, y + 8), f"{after - before:+.3f} ({low:+.3f} to {high:+.3f})", fill=INK,
                  font=small)
    axis = top + len(rows) * row_h + 2
    draw.line([(label_w, axis), (label_w + plot_w, axis)], fill=INK)
    for tick in (0.0, 0.5, 1.0):
        x = label_w + round(plot_w * tick)
        draw.line([(x, axis), (x, axis + 4)], fill=INK)
        draw.text((x, axis + 14), f"{tick:g}", fill=INK, font=small, anchor="mm")
    x = 8
    for colour, name in ((BEFORE, "before"), (AFTER_UP, "after: better (interval above 0)"),
                         (AFTER_SAME, "after: within noise"), (AFTER_DOWN, "after: regression (interval below 0)")):
        draw.rectangle([x, axis + 26, x + 10, axis + 36], fill=colour)
        draw.text((x + 14, axis + 24), name, fill=INK, font=small)
        x += 24 + int(draw.textlength(name, font=small))
    return np.asarray(image)
