"""The pool as a service: jobs in a database, run as real processes, resized by a policy.

:mod:`.store` (the tables and the lease), :mod:`.runner` (torchrun launches, stops, re-attaching),
:mod:`.service` (the round loop), :mod:`.api` (HTTP JSON and the dashboard), :mod:`.k8s` (Kueue manifests and
a controller), :mod:`.cli` (the subcommands). It never imports the runtime: jobs are processes, their
progress is read from their metrics files.
"""

__all__ = ["add_subcommands"]


def add_subcommands(sub: object) -> None:
    """Add ``serve``, ``submit``, ``list``, ``status``, ``logs``, ``cancel``, ``policy`` and ``render-k8s``."""
    from .cli import add_subcommands as add

    add(sub)
