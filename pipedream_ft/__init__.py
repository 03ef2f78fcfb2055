"""pipedream-ft: PipeDream's asynchronous 1F1B pipeline with weight stashing, with pluggable fault tolerance."""

__all__: list[str] = []
