"""The built-in policies: one module each (see :mod:`pipedream_ft.pool.policy` for the interface)."""

from .elastic_fifo import ElasticFifo
from .fifo import Fifo
from .goodput import Goodput
from .round_robin import RoundRobin
from .tiresias import Tiresias

__all__ = ["Fifo", "ElasticFifo", "RoundRobin", "Tiresias", "Goodput"]
