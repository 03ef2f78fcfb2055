"""Linearising a layer DAG into antichain states, the way PipeDream's optimizer does.

A pipeline stage must be closed under "everything this stage needs was computed earlier": the layers of the
first ``s`` stages form a *downset* (a set closed under predecessors). PipeDream describes each such cut by
the *antichain* of its maximal layers and only considers the cuts it reaches from the source by this rule:

* the **augmented** antichain of ``A`` is ``A`` plus every strict ancestor ``p`` of some ``a`` in ``A`` that
  has an out-edge leaving ``ancestors(a) ∪ {a}`` (these are the layers whose outputs still have to cross the
  cut: skip connections);
* from an augmented antichain, for every member ``u`` and out-edge ``u -> v`` with ``v`` not in ``A`` and no
  descendant of ``v`` in the augmented set, the **next** antichain is the augmented set with ``u`` replaced
  by ``v``, minus every member that is an ancestor of another member.

Each reached antichain is a :class:`AntichainStates` *state*. Per state we keep the totals over its downset
(compute ``Σ (forward_ms + backward_ms) / 1000`` in seconds, parameter bytes, activation bytes) and its
**output size** ``Σ activation_bytes`` over the augmented antichain: the bytes that cross a cut placed
there. State ``k`` may precede state ``j`` in a pipeline iff ``downset(k) ⊊ downset(j)`` (which is what
reachability in PipeDream's antichain DAG amounts to); the layers of a stage between them are
``downset(j) \\ downset(k)``.

Model inputs (``Profile.inputs``) that a layer outside the downset still reads also cross the cut: their
bytes are added to the output size (PipeDream's own profiles list none, so nothing changes for them).

Tied parameters (``Profile.tied``): per state and group, the number of the group's layers in the downset and
whether its first user (the layer whose ``parameter_bytes`` counts the parameter) is in it, from which the
cost model tells whether a stage splits the group.

Like PipeDream, source layers whose description starts with ``Input`` are taken out (their cost is not
counted; they always belong to stage 0), and so are sink layers whose description starts with
``__getitem__`` (they join the stage of their last predecessor). If several sources remain, the search
starts from the antichain of all of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from profiler.profile import Profile

__all__ = ["AntichainStates", "linearize"]


@dataclass(frozen=True)
class AntichainStates:
    """The antichain states of a profile, ordered so that a state's strict sub-downsets come before it."""

    antichains: tuple[tuple[int, ...], ...]
    """Each state's antichain, as profile layer indices (ascending)."""
    downsets: tuple[tuple[int, ...], ...]
    """Each state's downset (the layers up to and including the antichain), profile indices ascending."""
    compute_s: np.ndarray
    """Σ (forward_ms + backward_ms) / 1000 over each state's downset."""
    parameter_bytes: np.ndarray
    """Σ parameter_bytes over each state's downset."""
    activation_bytes: np.ndarray
    """Σ activation_bytes over each state's downset."""
    output_bytes: np.ndarray
    """Σ activation_bytes over each state's augmented antichain (bytes crossing a cut after this state)."""
    precedes: np.ndarray
    """Boolean matrix: ``precedes[k, j]`` iff ``downset(k) ⊊ downset(j)``."""
    removed_inputs: tuple[int, ...]
    """Profile indices of the ``Input`` sources taken out of the search (always stage 0)."""
    removed_sinks: tuple[int, ...]
    """Profile indices of the ``__getitem__`` sinks taken out (they follow their predecessors)."""
    tied_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Bytes of each tied group's parameter (``G`` groups)."""
    tied_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Number of layers of each tied group."""
    tied_counts: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    """``(G, S)``: layers of group ``g`` in the downset of state ``s``."""
    tied_first: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))
    """``(G, S)``: whether the first user of group ``g`` is in the downset of state ``s``."""
    crossing: tuple[tuple[int, ...], ...] = ()
    """Each state's augmented antichain (ascending): the layers whose outputs are counted as crossing a cut
    after it. It holds every layer of the downset that a later layer reads (and, as PipeDream counts it,
    possibly a layer whose readers all lie in the downset too, when the cut runs through a diamond)."""

    @property
    def num_states(self) -> int:
        return len(self.antichains)

    def longest_chain(self) -> int:
        """The most stages any pipeline can have: the longest chain of states ending at the last one."""
        if not self.num_states:
            return 0
        length = np.ones(self.num_states, dtype=np.int64)
        for j in range(self.num_states):  # predecessors come first
            ks = np.nonzero(self.precedes[:, j])[0]
            if len(ks):
                length[j] = 1 + int(length[ks].max())
        return int(length[-1])

    def stage_layers(self, cuts: list[int], profile: Profile) -> list[list[int]]:
        """Profile layers of each stage for a chain of state indices ``cuts`` (the last state of each stage).

        Every profile layer lands in exactly one stage: removed inputs in the first, removed sinks in the
        stage of their latest predecessor.
        """
        stages: list[list[int]] = []
        prev: set[int] = set()
        for c in cuts:
            down = set(self.downsets[c])
            stages.append(sorted(down - prev))
            prev = down
        if not stages:
            stages = [[]]
        owner = {layer: s for s, layers in enumerate(stages) for layer in layers}
        for layer in self.removed_inputs:
            stages[0].append(layer)
            owner[layer] = 0
        preds = profile.predecessors()
        for layer in sorted(self.removed_sinks):
            s = max((owner[p] for p in preds[layer] if p in owner), default=len(stages) - 1)
            stages[s].append(layer)
            owner[layer] = s
        for layer in range(len(profile.layers)):  # layers outside every downset (should not happen)
            if layer not in owner:
                stages[-1].append(layer)
        return [sorted(s) for s in stages]


def _bits(mask: int) -> list[int]:
    """Positions of the set bits of ``mask``, ascending."""
    if mask.bit_count() > 16:  # many bits: unpack them with numpy
        raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
        return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _unpack(masks: list[int], n: int) -> np.ndarray:
    """Bit masks over ``n`` layers as a ``(len(masks), n)`` boolean matrix."""
    width = (n + 7) // 8
    raw = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), dtype=np.uint8)
    return np.unpackbits(raw.reshape(len(masks), width), axis=1, bitorder="little")[:, :n].astype(bool)


def linearize(profile: Profile) -> AntichainStates:
    """Enumerate PipeDream's antichain states of ``profile`` (see the module docstring)."""
    layers = profile.layers
    n = len(layers)
    preds = profile.predecessors()
    succs = profile.successors()
    removed_inputs = [i for i in range(n) if not preds[i] and layers[i].description.startswith("Input")]
    gone = set(removed_inputs)
    live_succ = [[v for v in succs[i] if v not in gone] for i in range(n)]
    removed_sinks = [
        i for i in range(n) if i not in gone and not live_succ[i] and layers[i].description.startswith("__getitem__")
    ]
    gone.update(removed_sinks)
    live = [i for i in range(n) if i not in gone]
    if not live:
        empty = np.zeros(0)
        return AntichainStates((), (), empty, empty, empty, empty, np.zeros((0, 0), bool),
                               tuple(removed_inputs), tuple(removed_sinks))
    out = [[v for v in succs[i] if v not in gone] for i in range(n)]
    inn = [[u for u in preds[i] if u not in gone] for i in range(n)]

    anc = [0] * n  # strict ancestors as bitmasks over profile indices
    for v in live:  # profile order is topological
        m = 0
        for u in inn[v]:
            m |= anc[u] | (1 << u)
        anc[v] = m
    desc = [0] * n
    for v in reversed(live):
        m = 0
        for w in out[v]:
            m |= desc[w] | (1 << w)
        desc[v] = m
    out_mask = [sum(1 << w for w in out[v]) for v in range(n)]
    branchy = [v for v in live if len(out[v]) > 1]  # only these can be "extra" members

    extra_cache: dict[int, int] = {}

    def extra(a: int) -> int:
        if a not in extra_cache:
            inside = anc[a] | (1 << a)
            m = 0
            for p in branchy:
                if (anc[a] >> p) & 1 and out_mask[p] & ~inside:
                    m |= 1 << p
            extra_cache[a] = m
        return extra_cache[a]

    def augmented(antichain: tuple[int, ...]) -> int:
        m = 0
        for a in antichain:
            m |= extra(a) | (1 << a)
        return m

    def deaugment(mask: int) -> tuple[int, ...]:
        return tuple(x for x in _bits(mask) if not desc[x] & mask)

    start = tuple(v for v in live if not inn[v])
    seen = {start: augmented(start)}
    queue = deque([start])
    while queue:
        antichain = queue.popleft()
        aug = seen[antichain]
        members = set(antichain)
        for u in _bits(aug):
            for v in out[u]:
                if v in members or desc[v] & aug:
                    continue
                nxt = deaugment((aug & ~(1 << u)) | (1 << v))
                if nxt not in seen:
                    seen[nxt] = augmented(nxt)
                    queue.append(nxt)

    fwd = np.array([(l.forward_ms + l.backward_ms) / 1000.0 for l in layers])
    par = np.array([float(l.parameter_bytes) for l in layers])
    act = np.array([float(l.activation_bytes) for l in layers])
    records = []
    for antichain, aug in seen.items():
        down = 0
        for a in antichain:
            down |= anc[a] | (1 << a)
        records.append((down.bit_count(), antichain, down, aug))
    records.sort(key=lambda r: (r[0], r[1]))
    s = len(records)
    member = _unpack([r[2] for r in records], n)  # (s, n) bool: downsets
    crossing_m = _unpack([r[3] for r in records], n)  # augmented antichains
    # summed in ascending layer order (a running sum; adding 0.0 changes nothing), as ``sum`` over the
    # members would: equal downsets give bit-identical totals
    compute = np.cumsum(np.where(member, fwd, 0.0), axis=1)[:, -1]
    params = np.cumsum(np.where(member, par, 0.0), axis=1)[:, -1]
    acts = np.cumsum(np.where(member, act, 0.0), axis=1)[:, -1]
    outs = np.cumsum(np.where(crossing_m, act, 0.0), axis=1)[:, -1]
    downsets = tuple(tuple(np.flatnonzero(row).tolist()) for row in member)
    crossing = tuple(tuple(np.flatnonzero(row).tolist()) for row in crossing_m)
    member = member.astype(np.float32)
    gone_mask = sum(1 << g for g in gone)
    for inp in profile.inputs:  # an input a later layer reads crosses the cut too
        readers = sum(1 << r for r in inp.readers) & ~gone_mask
        if inp.bytes and readers:
            for i, rec in enumerate(records):
                if readers & ~rec[2]:
                    outs[i] += float(inp.bytes)
    groups = list(profile.tied)
    t_counts = np.zeros((len(groups), s), dtype=np.int64)
    t_first = np.zeros((len(groups), s), dtype=bool)
    for gi, g in enumerate(groups):
        gmask = sum(1 << i for i in g.layers)
        for i, rec in enumerate(records):
            t_counts[gi, i] = bin(rec[2] & gmask).count("1")
            t_first[gi, i] = bool((rec[2] >> g.layers[0]) & 1)
    sizes = member.sum(axis=1)
    # downset(k) ⊆ downset(j)  iff  |downset(k) \ downset(j)| == 0
    outside = member @ (1.0 - member).T
    precedes = (outside == 0) & (sizes[:, None] < sizes[None, :])
    return AntichainStates(
        antichains=tuple(r[1] for r in records),
        downsets=downsets,
        compute_s=compute,
        parameter_bytes=params,
        activation_bytes=acts,
        output_bytes=outs,
        precedes=precedes,
        crossing=crossing,
        removed_inputs=tuple(removed_inputs),
        removed_sinks=tuple(removed_sinks),
        tied_bytes=np.array([float(g.bytes) for g in groups]),
        tied_sizes=np.array([len(g.layers) for g in groups], dtype=np.int64),
        tied_counts=t_counts,
        tied_first=t_first,
    )
