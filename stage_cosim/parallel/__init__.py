"""How the work is split: parallel degrees, batch, ZeRO, recomputation, pipeline layout."""

from stage_cosim.parallel.config import ParallelConfig
from stage_cosim.parallel.mesh import DeviceMesh

__all__ = ["ParallelConfig", "DeviceMesh"]
