"""Parts of a stage's training state that live outside the weights and the optimizer, checkpointed with them.

A *component* is registered under a name in :attr:`~pipedream_ft.pipeline.state.StageState.components`; the
stage's checkpoint part holds ``{"components": {name: component.capture(cut)}}``. Components in this package:
the data source's position (stage 0, :class:`~pipedream_ft.pipeline.data.DataComponent`), the LR scheduler
(:class:`~pipedream_ft.pipeline.stepper.SchedulerComponent`) and the float16 loss scale
(:class:`~pipedream_ft.pipeline.precision.LossScaler`).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Component"]


class Component(Protocol):
    """Checkpointed state with its own capture and restore."""

    def capture(self, cut: int) -> Any:
        """The value to save at ``cut`` (right after this stage's update for minibatch ``cut - 1``): plain values
        and tensors that are not modified afterwards, or ``None``."""

    def restore(self, value: Any) -> None:
        """Load what :meth:`capture` returned in this stage's own part (``None`` if the part has none)."""

    def reshard(self, values: list[Any]) -> None:
        """Load from the parts of another plan's stages that hold this stage's layers, in stage order (``None``
        for a part without this component)."""
