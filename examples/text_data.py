"""Byte-level text from Python itself: ``pydoc_data.topics`` (the ``help()`` topics, ~465 KB of English).

Nothing is downloaded: the text ships with CPython. The topics are joined in sorted order and encoded as UTF-8,
so a token is a byte (vocabulary 256). The text is cut into chunks of ``chunk`` bytes and a seeded permutation
of the chunks holds ``held_out`` of them out; the rest, joined, is the training stream.

Minibatch ``b`` is a deterministic set of ``batch_size`` random windows of ``block_size + 1`` bytes of the
training stream (the generator is seeded from ``(seed, b)``): inputs are the first ``block_size`` bytes of each
window, targets the last ``block_size``. Every rank computes the same minibatch ``b`` on its own, in any order,
so ``TextData`` is a valid ``data(b)`` callable for :meth:`pipedream_ft.PipelineTrainer.fit`.
"""

from __future__ import annotations

import torch

__all__ = ["corpus_bytes", "TextData", "decode"]


def corpus_bytes() -> bytes:
    """The whole corpus: every ``pydoc_data.topics`` entry, in sorted key order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics)).encode("utf-8")


def decode(ids: torch.Tensor | list[int]) -> str:
    """Token ids (bytes) back to text; invalid UTF-8 (a sample cut mid-character) is replaced."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")


class TextData:
    """The corpus split into a training stream and a held-out set, served as minibatches of random windows."""

    def __init__(self, block_size: int = 64, batch_size: int = 16, seed: int = 0, held_out: float = 0.1,
                 chunk: int = 2048) -> None:
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"block_size and batch_size must be >= 1, got {block_size} and {batch_size}")
        if not 0.0 < held_out < 1.0:
            raise ValueError(f"held_out must be in (0, 1), got {held_out}")
        raw = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).to(torch.long)
        chunks = list(torch.split(raw, chunk))
        order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed)).tolist()
        n_held = max(1, round(held_out * len(chunks)))
        self.train = torch.cat([chunks[i] for i in sorted(order[n_held:])])
        """The training stream (token ids)."""
        self.held = torch.cat([chunks[i] for i in sorted(order[:n_held])])
        """The held-out text (token ids)."""
        if len(self.held) <= block_size + 1:
            raise ValueError(f"block_size {block_size} is too long for the held-out text ({len(self.held)} bytes)")
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.tokens_per_minibatch = block_size * batch_size

    def _windows(self, text: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts.unsqueeze(1) + torch.arange(self.block_size + 1).unsqueeze(0)
        windows = text[idx]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __call__(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Minibatch ``b``: inputs and targets, both ``(batch_size, block_size)`` int64."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + b + 1)
        starts = torch.randint(0, len(self.train) - self.block_size - 1, (self.batch_size,), generator=g)
        return self._windows(self.train, starts)

    def held_out_batches(self, n_windows: int = 256, batch_size: int | None = None
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed set of ``n_windows`` held-out windows, spread evenly over the held-out text, in minibatches."""
        last = len(self.held) - self.block_size - 1
        starts = torch.linspace(0, last, n_windows).round().to(torch.long)
        size = batch_size or self.batch_size
        return [self._windows(self.held, starts[i:i + size]) for i in range(0, n_windows, size)]
