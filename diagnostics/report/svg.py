"""Two chart kinds as inline SVG strings: stacked bars and lines. No JavaScript, no external resources.

Hand-written rather than matplotlib so the report renders the same everywhere, costs no import time at the end
of a run, and stays a few kilobytes; every text is HTML-escaped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 720, 300
LEFT, RIGHT, TOP, BOTTOM = 70, 170, 36, 44  # margins: y labels left, legend right, title top, x labels bottom
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f", "#bab0ac")


@dataclass(frozen=True)
class Series:
    name: str
    values: list[float]  # bars: one per category; lines: y values
    xs: list[float] | None = None  # lines only


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top`` (steps of 1, 2 or 5 times a power of ten)."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:.3g}"


def _frame(plot_id: str, title: str, y_label: str, ticks: list[float], body: list[str], legend: list[str]) -> str:
    plot_h = HEIGHT - TOP - BOTTOM
    top = ticks[-1] or 1.0
    parts = [
        f'<svg class="plot" data-plot="{escape(plot_id)}" role="img" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}">',
        f"<title>{escape(title)}</title>",
        f'<text x="{LEFT}" y="20" class="plot-title">{escape(title)}</text>',
        f'<text x="14" y="{TOP + plot_h / 2}" transform="rotate(-90 14 {TOP + plot_h / 2})" '
        f'text-anchor="middle" class="axis">{escape(y_label)}</text>',
    ]
    for tick in ticks:
        y = TOP + plot_h * (1 - tick / top)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" class="axis">{_label(tick)}</text>')
    parts += body
    for i, name in enumerate(legend):
        y = TOP + 4 + 18 * i
        color = PALETTE[i % len(PALETTE)]
        parts.append(f'<rect x="{WIDTH - RIGHT + 12}" y="{y}" width="12" height="12" fill="{color}"/>')
        parts.append(f'<text x="{WIDTH - RIGHT + 30}" y="{y + 10}" class="legend">{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def stacked_bars(plot_id: str, title: str, y_label: str, categories: list[str], series: list[Series]) -> str:
    """One bar per category, ``series`` stacked bottom-up in legend order."""
    totals = [sum(s.values[i] for s in series if i < len(s.values)) for i in range(len(categories))]
    ticks = nice_ticks(max(totals, default=0.0))
    top, plot_h = ticks[-1] or 1.0, HEIGHT - TOP - BOTTOM
    slot = (WIDTH - LEFT - RIGHT) / max(1, len(categories))
    bar_w = min(60.0, slot * 0.6)
    body = []
    for i, category in enumerate(categories):
        x = LEFT + slot * i + (slot - bar_w) / 2
        base = 0.0
        for k, s in enumerate(series):
            value = s.values[i] if i < len(s.values) else 0.0
            if value <= 0:
                continue
            y0, y1 = TOP + plot_h * (1 - base / top), TOP + plot_h * (1 - (base + value) / top)
            tip = f"{category} {s.name}: {_label(value)} {y_label}"
            body.append(
                f'<rect class="bar" x="{x:.1f}" y="{y1:.1f}" width="{bar_w:.1f}" height="{y0 - y1:.1f}" '
                f'fill="{PALETTE[k % len(PALETTE)]}"><title>{escape(tip)}</title></rect>'
            )
            base += value
        body.append(
            f'<text x="{x + bar_w / 2:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle" class="axis">'
            f"{escape(category)}</text>"
        )
    return _frame(plot_id, title, y_label, ticks, body, [s.name for s in series])


def lines(
    plot_id: str, title: str, x_label: str, y_label: str, series: list[Series], y_max: float | None = None
) -> str:
    """One polyline per series over shared x and y axes."""
    xs = [x for s in series for x in (s.xs or [])]
    x0, x1 = (min(0.0, *xs), max(xs)) if xs else (0.0, 1.0)  # time and steps read best from zero
    span = (x1 - x0) or 1.0
    ticks = nice_ticks(y_max if y_max is not None else max((v for s in series for v in s.values), default=0.0))
    top, plot_w, plot_h = ticks[-1] or 1.0, WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    body = []
    for k, s in enumerate(series):
        points = " ".join(
            f"{LEFT + plot_w * (x - x0) / span:.1f},{TOP + plot_h * (1 - min(y, top) / top):.1f}"
            for x, y in zip(s.xs or [], s.values, strict=False)
        )
        color = PALETTE[k % len(PALETTE)]
        body.append(
            f'<polyline class="line" points="{points}" fill="none" stroke="{color}" stroke-width="1.8">'
            f"<title>{escape(s.name)}</title></polyline>"
        )
    for frac in (0.0, 0.5, 1.0):
        x = LEFT + plot_w * frac
        body.append(
            f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle" class="axis">'
            f"{_label(x0 + span * frac)}</text>"
        )
    body.append(
        f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 8}" text-anchor="middle" class="axis">{escape(x_label)}</text>'
    )
    return _frame(plot_id, title, y_label, ticks, body, [s.name for s in series])


def scatter(
    plot_id: str, title: str, x_label: str, y_label: str, points: list[tuple[str, float, float]], front: list[str]
) -> str:
    """Labelled points (name, x, y) from zero; the names in ``front`` are joined by a line, in that order."""
    ticks = nice_ticks(max((y for _, _, y in points), default=0.0))
    x_ticks = nice_ticks(max((x for _, x, _ in points), default=0.0))
    top, right = ticks[-1] or 1.0, x_ticks[-1] or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(x: float, y: float) -> tuple[float, float]:
        return LEFT + plot_w * x / right, TOP + plot_h * (1 - y / top)

    where = {name: at(x, y) for name, x, y in points}
    body = []
    if len(front) > 1:
        path = " ".join(f"{where[n][0]:.1f},{where[n][1]:.1f}" for n in front if n in where)
        body.append(f'<polyline class="front" points="{path}" fill="none" stroke="{PALETTE[1]}" stroke-width="1.5"/>')
    for name, x, y in points:
        px, py = where[name]
        color = PALETTE[1] if name in front else PALETTE[0]
        tip = f"{name}: {_label(x)} {x_label}, {_label(y)} {y_label}"
        body.append(
            f'<circle class="point" cx="{px:.1f}" cy="{py:.1f}" r="5" fill="{color}">'
            f"<title>{escape(tip)}</title></circle>"
        )
        body.append(f'<text x="{px + 7:.1f}" y="{py - 6:.1f}" class="axis">{escape(name)}</text>')
    for tick in x_ticks:
        x = at(tick, 0)[0]
        body.append(
            f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle" class="axis">{_label(tick)}</text>'
        )
    body.append(
        f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 8}" text-anchor="middle" class="axis">{escape(x_label)}</text>'
    )
    legend = ["run", "Pareto front"] if front else ["run"]
    return _frame(plot_id, title, y_label, ticks, body, legend)
