"""Reading back the PNG pictures the timeline tool draws: their size and the colours they use."""

from __future__ import annotations

from pathlib import Path

import PIL.Image as PIL

__all__ = ["hex_rgb", "png_colours", "png_size"]


def png_colours(path: Path) -> set[tuple[int, int, int]]:
    """Every RGB colour of the picture at ``path`` (which must be a PNG)."""
    with PIL.open(path) as im:
        assert im.format == "PNG"
        return {c[:3] for _, c in im.convert("RGBA").getcolors(maxcolors=1 << 20)}


def png_size(path: Path) -> tuple[int, int]:
    with PIL.open(path) as im:
        return im.size


def hex_rgb(colour: str) -> tuple[int, int, int]:
    """``"#rrggbb"`` as an RGB triple."""
    return tuple(int(colour[i: i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]
