"""Former home of the trainer; kept so that older scripts importing from here still work."""

from .pipeline.executor import mix_seed as _mix  # noqa: F401
from .trainer import MODES, PipelineConfig, PipelineTrainer, RankStats, TrainResult

__all__ = ["MODES", "PipelineConfig", "RankStats", "TrainResult", "PipelineTrainer"]
