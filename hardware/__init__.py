"""Hardware descriptions: GPUs and clusters (real presets and hypothetical ones).

The names below load their modules on first use, so that code needing only the network
dimensions (reading an ASTRA-sim network file) does not read the GPU and cluster records
(``data/gpus/`` and ``data/clusters/``, one file per preset).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "CLUSTER_PRESETS": "cluster", "Cluster": "cluster", "ScaleOut": "cluster", "ScaleUp": "cluster",
    "check_fits": "cluster", "cluster_presets": "cluster", "resolve_cluster": "cluster",
    "GPU": "gpu", "get_gpu": "gpu", "gpu_names": "gpu", "gpu_records": "gpu",
    "NetworkDim": "network",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
