"""Former home of the checkpointer; kept so that older scripts importing from here still work."""

from .ft.checkpointer import CheckpointConfig, Checkpointer, Preempted, plan_hash

__all__ = ["CheckpointConfig", "Checkpointer", "Preempted", "plan_hash"]
