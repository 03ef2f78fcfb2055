"""Layer-by-layer profiling of PyTorch models, and the profile format the partitioner plans from."""

from .graphtxt import dumps_graph_txt, parse_graph_txt
from .profile import FORMAT, VERSION, Layer, Profile, ProfileError, load_profile

__all__ = [
    "FORMAT",
    "VERSION",
    "Layer",
    "Profile",
    "ProfileError",
    "load_profile",
    "parse_graph_txt",
    "dumps_graph_txt",
]
