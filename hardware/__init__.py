"""Hardware descriptions: GPUs and clusters (real presets and hypothetical ones)."""

from stage_cosim.hardware.cluster import CLUSTER_PRESETS, Cluster, ScaleOut, ScaleUp, check_fits, resolve_cluster
from stage_cosim.hardware.gpu import GPU, get_gpu, gpu_names
from stage_cosim.hardware.network import NetworkDim

__all__ = ["CLUSTER_PRESETS", "Cluster", "ScaleOut", "ScaleUp", "check_fits", "resolve_cluster",
           "GPU", "get_gpu", "gpu_names", "NetworkDim"]
