"""Observers of the training loop: progress, metrics, timelines and watchdogs are hooks.

The executor and the trainer call these at fixed points; every method is a no-op by default, so a hook
implements only what it watches. Times are wall-clock seconds (``time.time()``) so ranks line up.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..schedules.actions import Action

__all__ = ["Hooks", "HookList"]


class Hooks:
    """Called by the training loop; override what you need."""

    def on_train_start(self, start: int, stop: int) -> None:
        """A run of minibatches ``[start, stop)`` begins."""

    def on_action(self, action: Action) -> None:
        """``action`` is about to run."""

    def on_forward(self, minibatch: int, start: float, end: float) -> None:
        """The forward of ``minibatch`` ran from ``start`` to ``end``."""

    def on_backward(self, minibatch: int, start: float, end: float) -> None:
        """The backward of ``minibatch`` ran from ``start`` to ``end`` (a split backward's input half ``I``)."""

    def on_weight_backward(self, minibatch: int, start: float, end: float) -> None:
        """The weight half ``W`` of a split backward of ``minibatch`` ran from ``start`` to ``end``."""

    def on_update(self, round_: int, done: int, start: float, end: float) -> None:
        """Update ``round_`` ran; ``done`` minibatches are now trained."""

    def on_wait(self, what: str, minibatch: int, peer: int, start: float, end: float) -> None:
        """The rank waited for ``what`` ("activation" or "gradient") of ``minibatch`` from ``peer``."""

    def on_checkpoint(self, cut: int, start: float, end: float, snapshot_s: float) -> None:
        """This rank took its part of the checkpoint at ``cut`` (the time training waited)."""

    def on_event(self, name: str, **args: Any) -> None:
        """A one-off event (a restart, a recovery, a re-plan) with its details."""

    def on_train_end(self, start: int, stop: int) -> None:
        """The run of minibatches ended (normally or not)."""

    def close(self) -> None:
        """The trainer is closing: release files and threads."""


_HOT = ("on_action", "on_forward", "on_backward", "on_weight_backward", "on_update", "on_wait")
"""The calls made for every action: only the hooks that override one are called for it."""


class HookList(Hooks):
    """Calls every hook in order (for the per-action calls, only the hooks that do something there)."""

    def __init__(self, hooks: Iterable[Hooks] = ()) -> None:
        self.hooks: list[Hooks] = []
        self._hot: dict[str, list[Any]] = {name: [] for name in _HOT}
        for h in hooks:
            self.add(h)

    def add(self, hook: Hooks) -> None:
        self.hooks.append(hook)
        for name in _HOT:
            if getattr(type(hook), name) is not getattr(Hooks, name):
                self._hot[name].append(getattr(hook, name))

    def on_train_start(self, start: int, stop: int) -> None:
        for h in self.hooks:
            h.on_train_start(start, stop)

    def on_action(self, action: Action) -> None:
        for call in self._hot["on_action"]:
            call(action)

    def on_forward(self, minibatch: int, start: float, end: float) -> None:
        for call in self._hot["on_forward"]:
            call(minibatch, start, end)

    def on_backward(self, minibatch: int, start: float, end: float) -> None:
        for call in self._hot["on_backward"]:
            call(minibatch, start, end)

    def on_weight_backward(self, minibatch: int, start: float, end: float) -> None:
        for call in self._hot["on_weight_backward"]:
            call(minibatch, start, end)

    def on_update(self, round_: int, done: int, start: float, end: float) -> None:
        for call in self._hot["on_update"]:
            call(round_, done, start, end)

    def on_wait(self, what: str, minibatch: int, peer: int, start: float, end: float) -> None:
        for call in self._hot["on_wait"]:
            call(what, minibatch, peer, start, end)

    def on_checkpoint(self, cut: int, start: float, end: float, snapshot_s: float) -> None:
        for h in self.hooks:
            h.on_checkpoint(cut, start, end, snapshot_s)

    def on_event(self, name: str, **args: Any) -> None:
        for h in self.hooks:
            h.on_event(name, **args)

    def on_train_end(self, start: int, stop: int) -> None:
        for h in self.hooks:
            h.on_train_end(start, stop)

    def close(self) -> None:
        for h in self.hooks:
            h.close()
