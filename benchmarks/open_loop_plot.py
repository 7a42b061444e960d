"""The open-loop benchmark's plot (benchmarks/open_loop.py ``--plot``): hand-written SVG, no plotting library."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

if TYPE_CHECKING:
    from benchmarks.open_loop_load import RateResult


@dataclass(frozen=True)
class Axis:
    """A value range mapped onto pixels ``start`` to ``end`` (log10 when ``log``)."""

    low: float
    high: float
    start: float
    end: float
    log: bool = False

    def at(self, value: float) -> float:
        f = math.log10 if self.log else float
        span = f(self.high) - f(self.low)
        fraction = (f(value) - f(self.low)) / span if span else 0.5
        return self.start + fraction * (self.end - self.start)


PANEL_W, PANEL_H, MARGIN = 420, 300, 60
SERIES_STYLE = {"ttft-p50": "#1f77b4", "ttft-p99": "#d62728", "slo": "#7f7f7f", "throughput": "#2ca02c",
                "offered": "#7f7f7f"}


def _label(value: float, unit: str = "") -> str:
    if unit == "s":
        return f"{value * 1000:g} ms" if value < 1 else f"{value:g} s"
    return f"{value:g}"


def _polyline(name: str, points: list[tuple[float, float]], x: Axis, y: Axis, dashed: bool = False) -> list[str]:
    """A named polyline through ``points`` (values), with a dot at each point of a measured series."""
    if not points:
        return []
    xy = [(x.at(a), y.at(b)) for a, b in points]
    dash = ' stroke-dasharray="5,4"' if dashed else ""
    out = [f'<polyline class="{name}" fill="none" stroke="{SERIES_STYLE[name]}" stroke-width="2"{dash} '
           f'points="{" ".join(f"{px:.1f},{py:.1f}" for px, py in xy)}"/>']
    if not dashed:
        out += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{SERIES_STYLE[name]}"/>' for px, py in xy]
    return out


def _frame(x: Axis, y: Axis, x_ticks: Sequence[float], y_ticks: Sequence[float], title: str, y_unit: str
           ) -> list[str]:
    """Axes, ticks, grid lines and the title of one panel."""
    out = [f'<rect x="{x.start}" y="{y.end}" width="{x.end - x.start}" height="{y.start - y.end}" fill="none" '
           f'stroke="#333"/>',
           f'<text x="{(x.start + x.end) / 2}" y="{y.end - 10}" text-anchor="middle" font-weight="bold">'
           f'{escape(title)}</text>',
           f'<text x="{(x.start + x.end) / 2}" y="{y.start + 36}" text-anchor="middle">offered rate (req/s)</text>']
    for tick in x_ticks:
        px = x.at(tick)
        out.append(f'<line x1="{px:.1f}" y1="{y.start}" x2="{px:.1f}" y2="{y.start + 4}" stroke="#333"/>')
        out.append(f'<text x="{px:.1f}" y="{y.start + 18}" text-anchor="middle">{_label(tick)}</text>')
    for tick in y_ticks:
        py = y.at(tick)
        out.append(f'<line x1="{x.start}" y1="{py:.1f}" x2="{x.end}" y2="{py:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{x.start - 6}" y="{py + 4:.1f}" text-anchor="end">{_label(tick, y_unit)}</text>')
    return out


def _legend(x0: float, y0: float, entries: Sequence[tuple[str, str]]) -> list[str]:
    out = []
    for i, (name, text) in enumerate(entries):
        y = y0 + 16 * i
        out.append(f'<line x1="{x0}" y1="{y}" x2="{x0 + 20}" y2="{y}" stroke="{SERIES_STYLE[name]}" stroke-width="2"/>')
        out.append(f'<text x="{x0 + 26}" y="{y + 4}">{escape(text)}</text>')
    return out


def _decades(low: float, high: float) -> list[float]:
    """Powers of ten from the one at or below ``low`` to the one at or above ``high`` (two at least)."""
    first = math.floor(math.log10(low))
    return [10.0 ** k for k in range(first, max(math.ceil(math.log10(high)), first + 1) + 1)]


def _linear_ticks(high: float) -> list[float]:
    """0, step, 2 step, ... up to the first tick at or above ``high`` (> 0), at most 7 ticks."""
    base = 10.0 ** math.floor(math.log10(high / 5))
    step = base * next(m for m in (1, 2, 5, 10) if math.ceil(high / (base * m)) <= 6)
    return [step * i for i in range(math.ceil(high / step) + 1)]


def plot_svg(results: Sequence[RateResult], title: str, slo_s: float) -> str:
    """Two panels against the offered rate (log axis): p50/p99 TTFT (log axis, the SLO dashed), and request
    throughput with the offered rate dashed; ``title``'s lines below them. A rate with no completed request
    has no point."""
    rates = sorted(r.rate for r in results)
    measured = [r for r in sorted(results, key=lambda r: r.rate) if r.completed]
    ttfts = [v for r in measured for v in (r.ttft(50), r.ttft(99))] + [slo_s]
    y_decades = _decades(min(ttfts), max(ttfts))
    left = Axis(rates[0], rates[-1], MARGIN, MARGIN + PANEL_W, log=rates[0] > 0)
    ttft_y = Axis(y_decades[0], y_decades[-1], MARGIN + PANEL_H, MARGIN, log=True)
    right = Axis(rates[0], rates[-1], 2 * MARGIN + PANEL_W + 30, 2 * MARGIN + 2 * PANEL_W + 30, log=left.log)
    tput_ticks = _linear_ticks(max([rates[-1]] + [r.request_throughput for r in measured]))
    tput_y = Axis(0.0, tput_ticks[-1], MARGIN + PANEL_H, MARGIN)
    captions = title.splitlines()
    width, height = right.end + 20, MARGIN + PANEL_H + 44 + 16 * len(captions)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
             f'viewBox="0 0 {width:.0f} {height}" font-family="sans-serif" font-size="12">',
             f'<title>{escape(captions[0] if captions else "")}</title>',
             f'<rect width="{width:.0f}" height="{height}" fill="white"/>',
             *_frame(left, ttft_y, rates, y_decades, "Time to first token", "s"),
             *_polyline("slo", [(rates[0], slo_s), (rates[-1], slo_s)], left, ttft_y, dashed=True),
             *_polyline("ttft-p50", [(r.rate, r.ttft(50)) for r in measured], left, ttft_y),
             *_polyline("ttft-p99", [(r.rate, r.ttft(99)) for r in measured], left, ttft_y),
             *_legend(left.start + 10, ttft_y.end + 16, [("ttft-p50", "p50"), ("ttft-p99", "p99"),
                                                         ("slo", f"{_label(slo_s, 's')} (saturation)")]),
             *_frame(right, tput_y, rates, tput_ticks, "Throughput (completed req/s)", ""),
             *_polyline("offered", [(rate, rate) for rate in rates], right, tput_y, dashed=True),
             *_polyline("throughput", [(r.rate, r.request_throughput) for r in measured], right, tput_y),
             *_legend(right.start + 10, tput_y.end + 16, [("throughput", "measured"), ("offered", "= offered")]),
             *(f'<text x="{MARGIN}" y="{MARGIN + PANEL_H + 56 + 16 * i}" fill="#555">{escape(line)}</text>'
               for i, line in enumerate(captions)),
             "</svg>"]
    return "\n".join(parts) + "\n"
