"""Random small profiles for property tests."""

from __future__ import annotations

import random

from profiler.profile import Layer, Profile

__all__ = ["random_profile", "PROFILES_DIR"]

from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parents[2] / "shared" / "profiles"


def random_profile(rng: random.Random, n: int, *, dag: bool, with_input: bool = False) -> Profile:
    """``n`` layers in topological order: a chain, or a DAG where every layer has >= 1 predecessor."""
    layers = []
    for i in range(n):
        desc = "Input" if (with_input and i == 0) else rng.choice(["Conv2d", "ReLU", "Linear", "Add"])
        fwd = rng.choice([0.0, rng.uniform(0.1, 20.0)]) if rng.random() < 0.1 else rng.uniform(0.1, 20.0)
        layers.append(Layer(
            name=f"l{i}", description=desc, forward_ms=fwd, backward_ms=rng.uniform(0.0, 2.0) * fwd,
            activation_bytes=float(rng.choice([0, rng.randrange(1, 10**7)])),
            parameter_bytes=float(rng.choice([0, rng.randrange(1, 10**8)])),
        ))
    edges = set()
    for j in range(1, n):
        if dag:
            edges.add((rng.randrange(0, j), j))
            if j >= 2 and rng.random() < 0.4:
                edges.add((rng.randrange(0, j), j))
        else:
            edges.add((j - 1, j))
    return Profile(tuple(layers), tuple(sorted(edges)))
