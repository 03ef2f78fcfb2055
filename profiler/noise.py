"""How far to trust a profile's times: each layer's spread over its repeats, and a warning when it is too noisy.

A layer's *spread* is its relative interquartile range, ``(p75 - p25) / median`` of its timed repeats (forward
and backward apart; the profile keeps both). A busy machine shows in it: on a quiet one the repeats of a layer
agree to a few percent. The interquartile range is the median's own margin: one stray repeat in five moves
neither, while a layer whose middle repeats disagree has a median that could have been any of them. The
profile is *too noisy to trust* when, over the layers that matter (at least :data:`SHARE` of the total time;
layers whose time was reused are not counted twice), the median spread exceeds :data:`MEDIAN_LIMIT`, or one
layer's spread exceeds :data:`LAYER_LIMIT`. :func:`noise_warning` then says so in one line naming the worst
layers and the figure.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from .profile import Layer, Profile

__all__ = ["LAYER_LIMIT", "MEDIAN_LIMIT", "SHARE", "noise_summary", "noise_warning", "spread"]

MEDIAN_LIMIT = 0.2
"""Largest median spread (over the layers that matter) of a profile worth trusting."""
LAYER_LIMIT = 1.0
"""Largest spread of any one layer that matters: beyond it, its median may be off by as much as itself."""
SHARE = 0.01
"""A layer matters when its forward and backward time is at least this share of the model's."""


def spread(samples: Sequence[float]) -> float:
    """``(p75 - p25) / median`` of ``samples``, quantiles interpolated linearly (0 for fewer than two
    samples, or a median of 0)."""
    if len(samples) < 2:
        return 0.0
    median = statistics.median(samples)
    if median <= 0:
        return 0.0
    ordered = sorted(samples)

    def quantile(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return (quantile(0.75) - quantile(0.25)) / median


def _layer_spread(layer: Layer) -> float:
    return max(layer.forward_spread or 0.0, layer.backward_spread or 0.0)


def noise_summary(layers: Sequence[Layer]) -> dict[str, Any]:
    """``{"median_spread", "layers", "worst": [[name, spread], ...]}`` over the layers that matter."""
    total = sum(l.forward_ms + l.backward_ms for l in layers)
    counted = [l for l in layers if l.reused_from is None and l.forward_spread is not None
               and total > 0 and l.forward_ms + l.backward_ms >= SHARE * total]
    if not counted:
        return {"median_spread": 0.0, "layers": 0, "worst": []}
    worst = sorted(counted, key=_layer_spread, reverse=True)[:3]
    return {"median_spread": round(statistics.median(_layer_spread(l) for l in counted), 4),
            "layers": len(counted),
            "worst": [[l.name, round(_layer_spread(l), 4)] for l in worst]}


def noise_warning(profile: Profile) -> str | None:
    """One line when ``profile``'s times are too noisy to trust (module docstring), else ``None``."""
    summary = noise_summary(profile.layers)
    if not summary["layers"]:
        return None
    median = summary["median_spread"]
    top = summary["worst"][0][1]
    if median <= MEDIAN_LIMIT and top <= LAYER_LIMIT:
        return None
    worst = ", ".join(f"{name} {s:.2f}" for name, s in summary["worst"])
    return (f"warning: the machine was too noisy to trust these times: median spread (p75-p25)/median "
            f"{median:.2f} over {summary['layers']} layers (limit {MEDIAN_LIMIT}, one layer {LAYER_LIMIT}); "
            f"worst: {worst}; profile again on a quiet machine or with more repeats")
