"""Feeding minibatches to the pipeline: stage 0 reads each one once, its targets travel to the last stage.

A *feed* gives the executor the inputs of minibatch ``b`` (on stage 0) and its targets (on the last stage).
:func:`make_feed` builds one for a data source (see :mod:`pipedream_ft.pipeline.sources` for the kinds):

* :class:`CallableFeed` for ``data(b) -> (inputs, targets)``: stage 0 calls ``data(b)`` for the inputs and the
  last stage calls it for the targets, exactly as a callable always was used (random access, no state).
* :class:`StreamFeed` for everything iterable. **Only stage 0 reads it, each minibatch exactly once**: the
  pre-flight check reads minibatch ``position`` and the forward of that minibatch uses that same read. Each
  minibatch must be an ``(inputs, targets)`` pair; the targets (a tensor, or a tuple/list/dict of tensors)
  go from the stage-0 replica that runs the minibatch *straight to* the last-stage replica that runs it, as
  one message on the ``"tgt"`` channel of the :class:`~pipedream_ft.pipeline.comm.Messenger`: a header and
  the tensors, like activations, plus the structure of the targets (a ``uint8`` tensor). The channel has its
  own tag space, and under NCCL its own two-rank communicator per (stage-0 rank, last-stage rank) pair
  (:func:`target_links`), so targets never queue behind activations. The last stage never reads the source.

**Replicated stage 0.** Replica ``r`` of a stage with ``R`` replicas runs minibatches ``b`` with
``b % R == r``. Every replica reads the whole stream, keeping its own minibatches and dropping the others'
(so each replica sees the same sequence, and every replica's checkpoint holds the same source state); data
loading on stage 0 costs ``R`` times one replica's.

**Exact resume.** Stage 0 reads ahead of a checkpoint cut ``c`` (the minibatches in flight), but its part of
the checkpoint must hold the source's state after exactly ``c`` reads. With checkpointing on, the feed keeps a
small ring of the states after each of the last reads (``state_dict()`` copied after every read) and its
:class:`DataComponent` puts the one after ``c`` reads into the part; on resume that state is loaded into the
source before its first read. A source attached at position ``p`` without a saved state (a fresh source at a
later position, or a checkpoint written while a callable fed the run) is read from its start and its first
``p`` minibatches are skipped.

**Minibatches as users write them.** A minibatch is an ``(inputs, targets)`` pair or a Hugging Face-style dict
(``{"input_ids": ..., "attention_mask": ..., "labels": ...}``, a tokenizer's ``BatchEncoding``): its
``"labels"`` are the targets and its other entries the inputs, bound to the model's inputs by name
(:func:`bind_inputs`). The inputs of a pair are one tensor for a one-input model, or a tuple/list for a model
with several positional inputs (``data(b) -> ((input_ids, attention_mask), labels)``), or a dict by name.

A source that has ``len()`` is checked before training: asking for more minibatches than it has stops every
rank with one line. One without ``len()`` that runs out mid-training raises a
:class:`~pipedream_ft.errors.JobError` on stage 0 naming how many minibatches it gave: every rank stops with
that line (no recovery is attempted: the source would end again).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from ..errors import JobError, PipelineError, PipelineSetupError
from .comm import Header, Messenger
from .connection import Connection
from .group import CommGroup
from ..schedules.replicated import in_flight
from .sources import describe, is_stateful, resume_problem, source_length, wrap
from .topology import Topology

__all__ = ["LABELS", "CallableFeed", "DataComponent", "StreamFeed", "agree", "bind_inputs", "make_feed",
           "pack_targets", "split_batch",
           "source_problem", "target_links", "training_feed", "unpack_targets"]

_FAILED = 1
"""Header flag of a pre-flight targets message: stage 0 could not read its minibatch."""
PREFLIGHT = -1
"""Minibatch number of the pre-flight messages."""


class CallableFeed:
    """``data(b) -> (inputs, targets)``, called by stage 0 and by the last stage (random access).

    Every feed has :attr:`source`, :meth:`prepare` (before the pre-flight check of minibatch ``position``),
    :meth:`inputs` (stage 0) and :meth:`targets` (the last stage); ``preflight=True`` is the pre-flight's look
    at minibatch ``position``, which the forward of that minibatch uses again.
    """

    def __init__(self, data: Any) -> None:
        self.source = data

    def prepare(self, position: int) -> None:
        """Nothing to move: the last stage calls ``data`` itself."""

    def inputs(self, b: int, *, preflight: bool = False) -> Any:
        return split_batch(self.source(b), b, describe(self.source))[0]

    def targets(self, b: int, *, preflight: bool = False) -> Any:
        return split_batch(self.source(b), b, describe(self.source))[1]


def pack_targets(targets: Any, device: torch.device) -> list[torch.Tensor]:
    """``targets`` as a message: its tensors (moved to ``device``) and its structure as a ``uint8`` tensor."""
    leaves, spec = pytree.tree_flatten(targets)
    bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
    if bad:
        raise PipelineSetupError(f"targets must be tensors (or tuples, lists, dicts of tensors) to travel to the last "
                                 f"stage; these are {', '.join(sorted(set(bad)))}")
    structure = torch.frombuffer(bytearray(pytree.treespec_dumps(spec).encode()), dtype=torch.uint8)
    # non-blocking: a blocking copy to a GPU waits for everything queued before it, once per minibatch
    return [t.to(device, non_blocking=True) for t in leaves] + [structure.to(device, non_blocking=True)]


def unpack_targets(tensors: list[torch.Tensor]) -> Any:
    """The targets :func:`pack_targets` sent."""
    spec = pytree.treespec_loads(bytes(tensors[-1].cpu().tolist()).decode())
    return pytree.tree_unflatten(list(tensors[:-1]), spec)


def target_links(topo: Topology) -> list[tuple[int, str]]:
    """``(peer, "tgt")`` for each rank this one exchanges targets with: stage-0 replica ``i`` and last-stage
    replica ``j`` share minibatches iff ``i`` and ``j`` agree modulo the gcd of the two replica counts."""
    last = topo.num_stages - 1
    if last == 0 or topo.stage not in (0, last):
        return []
    other = last if topo.stage == 0 else 0
    g = math.gcd(topo.replicas[0], topo.replicas[last])
    return [(r, "tgt") for i, r in enumerate(topo.plan.stages[other].ranks) if i % g == topo.replica % g]


LABELS = "labels"
"""The entry of a dict minibatch that holds its targets (Hugging Face's name)."""


def split_batch(batch: Any, b: int, name: str) -> tuple[Any, Any]:
    """``(inputs, targets)`` of minibatch ``b`` (a pair, or a dict whose ``"labels"`` are the targets)."""
    if type(batch) is tuple and len(batch) == 2:  # the common case, before the slower check against Mapping
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        if LABELS not in batch:
            raise PipelineSetupError(f"minibatch {b} of data source {name} is a dict without {LABELS!r} (its keys: "
                                     f"{sorted(batch)}); a dict minibatch holds the inputs by name and the targets "
                                     f"as {LABELS!r}")
        return {k: v for k, v in batch.items() if k != LABELS}, batch[LABELS]
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise PipelineSetupError(f"minibatch {b} of data source {name} is a {describe(batch)}, not an "
                                 "(inputs, targets) pair or a dict with 'labels'")
    return batch[0], batch[1]


_split = split_batch


def bind_inputs(inputs: Any, names: Sequence[str]) -> list[Any]:
    """The model's positional inputs ``names`` from a minibatch's inputs: one value (one input), a tuple/list in
    order, or a dict by name. Raises :class:`PipelineSetupError` naming what does not match."""
    if isinstance(inputs, Mapping):
        missing = [n for n in names if n not in inputs]
        extra = sorted(str(k) for k in inputs if k not in names)
        if missing or extra:
            raise PipelineSetupError(
                f"the model takes inputs {list(names)}, but the minibatch's dict "
                + (f"lacks {missing}" if missing else "") + (" and " if missing and extra else "")
                + (f"has {extra} besides" if extra else ""))
        return [inputs[n] for n in names]
    vals = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if len(vals) != len(names):
        raise PipelineSetupError(f"the model takes {len(names)} inputs {list(names)}, but the data gives {len(vals)}")
    return vals


class StreamFeed:
    """An iterable source read by stage 0 only, once per minibatch (see the module docstring).

    ``channel``: the messenger channel of the targets (``"tgt"``, or ``"eval-tgt"`` for evaluation);
    ``record``: keep the ring of source states (checkpointing is on).
    """

    def __init__(self, source: Any, *, topo: Topology, connection: Connection, channel: str = "tgt",
                 record: bool = False) -> None:
        self.source = source
        self.iterable = wrap(source)
        self.topo = topo
        self.connection = connection
        self.channel = channel
        self.record = record and is_stateful(self.iterable)
        self.name = describe(source)
        self.reads = 0
        """Minibatches read from the source (the next read is minibatch ``reads``)."""
        self._it: Any = None
        self._cache: dict[int, tuple[Any, Any]] = {}
        self._ring: dict[int, Any] = {}
        r0 = topo.replicas[0]
        self._lag = (in_flight(0, topo.replicas) + 2) * r0
        """States older than this many reads can no longer be asked for by a cut."""
        self._preflight_error: BaseException | None = None
        self._preflight_targets: Any = None
        self._local_targets: dict[int, Any] = {}

    @property
    def messenger(self) -> Messenger:
        return self.connection.messenger

    def rewind(self) -> None:
        """The group failed and was formed again: forget what was read ahead; stage 0 is then positioned again
        with :meth:`DataComponent.attach` (the restored state)."""
        self._cache.clear()
        self._ring.clear()
        self._local_targets.clear()
        self._preflight_error = None
        self._preflight_targets = None
        self._it = None

    # -- reading (stage 0) ----------------------------------------------------------------------------------

    def start(self, position: int, saved: dict[str, Any] | None = None) -> None:
        """Stage 0: position the source at ``position`` reads: load ``saved`` (the state after
        ``saved["position"] <= position`` reads) if given, then read and drop up to ``position``."""
        if saved is not None:
            self.iterable.load_state_dict(saved["state"])
            self.reads = int(saved["position"])
        self._it = iter(self.iterable)
        while self.reads < position:
            self._read()
        if self.record and self.reads not in self._ring:  # a cut at the start itself (in-place recovery's first)
            self._ring[self.reads] = copy.deepcopy(self.iterable.state_dict())

    def _read(self) -> tuple[int, Any]:
        if self._it is None:
            self._it = iter(self.iterable)
        try:
            batch = next(self._it)
        except StopIteration:
            raise JobError(f"data source {self.name} ended after {self.reads} minibatches "
                                f"(minibatch {self.reads} was needed)") from None
        b = self.reads
        self.reads += 1
        if self.record:
            self._ring[self.reads] = copy.deepcopy(self.iterable.state_dict())
            for k in [k for k in self._ring if k < self.reads - self._lag]:
                del self._ring[k]
        return b, batch

    def _mine(self, b: int) -> bool:
        return b % self.topo.replicas[0] == self.topo.replica

    def _get(self, b: int, keep: bool) -> tuple[Any, Any]:
        while self.reads <= b:
            i, batch = self._read()
            if i == b or self._mine(i):
                self._cache[i] = _split(batch, i, self.name)
        for k in [k for k in self._cache if k < b]:  # others' minibatches, or a pre-flight look
            del self._cache[k]
        if b not in self._cache:
            raise JobError(f"minibatch {b} of data source {self.name} was already used (read {self.reads})")
        return self._cache[b] if keep else self._cache.pop(b)

    def inputs(self, b: int, *, preflight: bool = False) -> Any:
        if preflight:
            if self._preflight_error is not None:
                raise self._preflight_error
            return self._get(b, keep=True)[0]
        x, y = self._get(b, keep=False)
        if self.topo.is_last:
            self._local_targets[b] = y
        else:
            peer = self.topo.peer(self.topo.num_stages - 1, b)
            self.messenger.send_activations(peer, Header(b), pack_targets(y, self.messenger.device), self.channel)
        return x

    def capture(self, cut: int) -> dict[str, Any]:
        """The source's state after exactly ``cut`` reads (stage 0, at the cut; reads ahead if it is behind)."""
        while self.reads < cut:
            i, batch = self._read()
            if self._mine(i):
                self._cache[i] = _split(batch, i, self.name)
        if cut not in self._ring:
            raise PipelineError(f"the state of data source {self.name} after {cut} reads is no longer kept "
                                f"(read {self.reads}, kept {sorted(self._ring)})")
        return {"position": cut, "source": self.name, "state": self._ring[cut]}

    # -- targets ---------------------------------------------------------------------------------------------

    def prepare(self, position: int) -> None:
        """Stage 0 reads minibatch ``position`` and each of its replicas sends the targets to the last-stage
        replicas ``j`` with ``j % R0 == replica`` (a pre-flight message, flagged if the read failed); each
        last-stage replica receives its one message. Nothing else waits on it, so no rank hangs."""
        topo = self.topo
        last = topo.num_stages - 1
        r0 = topo.replicas[0]
        if topo.is_first:
            tensors: list[torch.Tensor] = []
            try:
                x, y = self._get(position, keep=True)
                if not topo.is_last:
                    tensors = pack_targets(y, self.messenger.device)
            except Exception as exc:  # reported by the pre-flight check, on every rank
                self._preflight_error = exc
            if not topo.is_last:
                flags = _FAILED if self._preflight_error is not None else 0
                for j, rank in enumerate(topo.plan.stages[last].ranks):
                    if j % r0 == topo.replica:
                        self.messenger.send_activations(rank, Header(PREFLIGHT, 0, flags), tensors, self.channel)
        elif topo.is_last:
            peer = topo.plan.stages[0].ranks[topo.replica % r0]
            header, tensors = self.messenger.post_activations(peer, PREFLIGHT, self.channel).wait()
            assert header is not None
            self._preflight_targets = None if header.flags & _FAILED else unpack_targets(tensors)

    def targets(self, b: int, *, preflight: bool = False) -> Any:
        topo = self.topo
        if topo.is_first:
            return self._get(b, keep=True)[1] if preflight else self._local_targets.pop(b)
        if preflight:
            if self._preflight_targets is None:
                raise PipelineSetupError("stage 0 could not read the pre-flight minibatch")
            return self._preflight_targets
        peer = topo.peer(0, b)
        header, tensors = self.messenger.post_activations(peer, b, self.channel).wait()
        return unpack_targets(tensors)


def make_feed(data: Any, *, topo: Topology, connection: Connection, channel: str = "tgt",
              record: bool = False) -> CallableFeed | StreamFeed:
    """The feed for ``data``: a callable, or an iterable (see :mod:`pipedream_ft.pipeline.sources`)."""
    if hasattr(data, "__iter__"):
        return StreamFeed(data, topo=topo, connection=connection, channel=channel, record=record)
    if callable(data):
        return CallableFeed(data)
    raise PipelineSetupError(f"data must be a callable data(b) -> (inputs, targets), a DataLoader, or an iterable of "
                             f"(inputs, targets) minibatches; got {describe(data)}")


def source_problem(data: Any, *, start: int, stop: int, checkpointing: bool, what: str = "training") -> str | None:
    """Why ``data`` cannot feed minibatches ``[start, stop)``, in one line (``None``: it can)."""
    if checkpointing:
        problem = resume_problem(data)
        if problem is not None:
            return problem
    n = source_length(data)
    if n is not None and n < stop:
        return (f"data source {describe(data)} has {n} minibatches, but {what} asks for minibatches {start}..{stop - 1} "
                f"({stop} in all); pass a longer one" + (", or Epochs(loader, n) for several epochs"
                                                          if what == "training" else ""))
    return None


def agree(group: CommGroup, problem: str | None) -> None:
    """Every rank raises :class:`PipelineSetupError` with the first rank's problem, if any rank has one.
    A collective."""
    problems = [p for p in group.all_gather_object(problem) if p]
    if problems:
        raise PipelineSetupError(problems[0])


class DataComponent:
    """Stage 0's data position in its checkpoint part: the attached source's state after ``cut`` reads.

    Restored (or resharded) state waits in :attr:`pending` until the trainer attaches a source to continue.
    """

    def __init__(self) -> None:
        self.feed: StreamFeed | None = None
        self.pending: dict[str, Any] | None = None

    def capture(self, cut: int) -> Any:
        feed = self.feed
        return feed.capture(cut) if feed is not None and feed.record else None

    def restore(self, value: Any) -> None:
        self.pending = value

    def reshard(self, values: list[Any]) -> None:
        self.pending = next((v for v in values if v is not None), None)

    def attach(self, feed: StreamFeed, position: int) -> None:
        """Make ``feed`` the training source at ``position``: load the pending state if it fits, then skip."""
        saved = self.pending
        if saved is not None and (not feed.record or int(saved["position"]) > position):
            saved = None
        self.pending = None
        feed.start(position, saved)
        self.feed = feed


def training_feed(data: Any, current: CallableFeed | StreamFeed | None, *, topo: Topology, connection: Connection,
                  component: DataComponent, position: int, steps: int, checkpointing: bool
                  ) -> CallableFeed | StreamFeed:
    """The feed for training minibatches ``[position, position + steps)`` from ``data``: ``current`` if it reads
    the same source object (its stream continues), else a new one that stage 0 positions at ``position``.

    For an iterable source every rank checks it (length; with ``checkpointing``, exact resumability) and the
    ranks agree, so a problem stops every rank with the same :class:`PipelineSetupError`, before training.
    A collective for iterable sources only (a callable, as always, is trusted without one).
    """
    fresh = current is None or current.source is not data
    feed = make_feed(data, topo=topo, connection=connection, record=checkpointing) if fresh else current
    assert feed is not None
    if isinstance(feed, CallableFeed):
        component.feed = None  # checkpoints no longer hold a stream's state
    if isinstance(feed, StreamFeed):
        problem = source_problem(data, start=position, stop=position + steps, checkpointing=checkpointing)
        if problem is None and fresh and topo.is_first:
            try:
                component.attach(feed, position)
            except Exception as exc:  # a state that does not load, a source shorter than its len()
                problem = (f"cannot position data source {feed.name} at minibatch {position}: "
                           f"{type(exc).__name__}: {exc}")
        agree(connection.group, problem)
    return feed
