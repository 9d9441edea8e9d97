"""ASTRA-sim's configuration files: system.json, the analytical network.yml, memory.json.

Readers turn a user's files into the model's types and reject what the real simulator would
misread or abort on, with one-line errors naming the key. Writers produce files the simulator
reads, byte-for-byte deterministic (fixed key order), so that exported run directories diff
cleanly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from stage_cosim.adapters.astra_sim.astra_system import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL,
                                                         REDUCE_SCATTER, AstraSystem)
from stage_cosim.errors import UserError, require
from stage_cosim.hardware.network import TOPOLOGIES, NetworkDim

# system.json key of each collective's implementation list, in the order the simulator's own
# example files use.
IMPLEMENTATION_KEYS = (
    (ALL_REDUCE, "all-reduce-implementation"),
    (ALL_GATHER, "all-gather-implementation"),
    (REDUCE_SCATTER, "reduce-scatter-implementation"),
    (ALL_TO_ALL, "all-to-all-implementation"),
)
_KNOWN_SYSTEM_KEYS = {"scheduling-policy", "collective-optimization", "endpoint-delay",
                      "active-chunks-per-dimension", "preferred-dataset-splits", "local-mem-bw",
                      "peak-perf", "roofline-enabled"} | {k for _, k in IMPLEMENTATION_KEYS}
NETWORK_KEYS = ("topology", "npus_count", "bandwidth", "latency")
MEMORY_TYPES = ("NO_MEMORY_EXPANSION", "PER_NODE_MEMORY_EXPANSION", "PER_NPU_MEMORY_EXPANSION",
                "MEMORY_POOL")
NO_MEMORY_EXPANSION = "NO_MEMORY_EXPANSION"


# -- helpers ----------------------------------------------------------------------------------

def _load_json(path: Path, what: str, parameter: str) -> Any:
    """The file's JSON; errors name ``parameter`` (the flag that gave the file) and the path."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(parameter, f"{path}: cannot read the {what} ({exc.strerror or exc})") from exc
    except UnicodeDecodeError:
        raise UserError(parameter, f"{path}: the {what} is not a text file") from None
    except json.JSONDecodeError as exc:
        raise UserError(parameter, f"{path}: the {what} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc


def _int(value: Any, key: str, minimum: int) -> int:
    """JSON integers; a float with an integral value (``4.0``) is accepted as the simulator's
    JSON library would convert it."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(key, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise UserError(key, f"must be a positive number, got {value!r}")
    return value


def _plain_number(value: float) -> int | float:
    """Write 1600.0 as 1600: both parse to the same double, the integer reads better."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# -- system.json ------------------------------------------------------------------------------

def read_system_json(path: Path, parameter: str = "system-configuration") -> AstraSystem:
    """Parse an ASTRA-sim system configuration; unknown keys are kept in ``extra``. Errors about
    the file as a whole name ``parameter``, errors about a key name the key."""
    raw = _load_json(path, "system configuration", parameter)
    require(isinstance(raw, dict), parameter, f"{path}: the system configuration must be a JSON object")
    require("preferred-dataset-splits" in raw, "preferred-dataset-splits",
            "is required (the simulator crashes at the first collective without it)")
    impls: dict[str, tuple[str, ...]] = {}
    for coll, key in IMPLEMENTATION_KEYS:
        if key in raw:
            value = raw[key]
            require(isinstance(value, list) and value and all(isinstance(v, str) for v in value),
                    key, f"must be a non-empty list of implementation names, got {value!r}")
            impls[coll] = tuple(value)
    roofline = raw.get("roofline-enabled", 0)
    require(roofline in (0, 1) or isinstance(roofline, bool), "roofline-enabled",
            f"must be 0 or 1, got {roofline!r}")
    policy = raw.get("scheduling-policy", "LIFO")
    optimization = raw.get("collective-optimization", "baseline")
    require(isinstance(policy, str), "scheduling-policy", f"must be a string, got {policy!r}")
    require(isinstance(optimization, str), "collective-optimization",
            f"must be a string, got {optimization!r}")
    return AstraSystem(
        scheduling_policy=policy,
        collective_optimization=optimization,
        endpoint_delay_ns=_int(raw.get("endpoint-delay", 10), "endpoint-delay", 0),
        active_chunks_per_dimension=_int(raw.get("active-chunks-per-dimension", 1),
                                         "active-chunks-per-dimension", 1),
        preferred_dataset_splits=_int(raw["preferred-dataset-splits"], "preferred-dataset-splits", 1),
        implementations=impls,
        local_mem_bw_GBps=(_number(raw["local-mem-bw"], "local-mem-bw")
                           if "local-mem-bw" in raw else None),
        peak_perf_TFLOPS=_number(raw["peak-perf"], "peak-perf") if "peak-perf" in raw else None,
        roofline_enabled=bool(roofline),
        extra=tuple(sorted((k, v) for k, v in raw.items() if k not in _KNOWN_SYSTEM_KEYS)),
    )


def system_json_dict(system: AstraSystem) -> dict[str, Any]:
    """The system configuration as an ordered dict (the order ``write_system_json`` uses)."""
    out: dict[str, Any] = {
        "scheduling-policy": system.scheduling_policy,
        "endpoint-delay": system.endpoint_delay_ns,
        "active-chunks-per-dimension": system.active_chunks_per_dimension,
        "preferred-dataset-splits": system.preferred_dataset_splits,
    }
    for coll, key in IMPLEMENTATION_KEYS:
        if coll in system.implementations:
            out[key] = list(system.implementations[coll])
    out["collective-optimization"] = system.collective_optimization
    out["roofline-enabled"] = 1 if system.roofline_enabled else 0
    if system.local_mem_bw_GBps is not None:
        out["local-mem-bw"] = _plain_number(system.local_mem_bw_GBps)
    if system.peak_perf_TFLOPS is not None:
        out["peak-perf"] = _plain_number(system.peak_perf_TFLOPS)
    for key, value in system.extra:
        out.setdefault(key, value)
    return out


def write_system_json(system: AstraSystem, path: Path) -> None:
    """Write a system configuration the simulator reads; every collective it will run must have
    its implementation list (the simulator never completes one without)."""
    Path(path).write_text(json.dumps(system_json_dict(system), indent=1) + "\n")


# -- network.yml ------------------------------------------------------------------------------

def read_network_yml(path: Path, parameter: str = "network-configuration") -> list[NetworkDim]:
    """Parse an analytical network configuration: four lists of equal length, one entry per
    dimension (a scalar makes the simulator abort, so it is rejected here)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise UserError(parameter, f"{path}: cannot read the network configuration ({exc.strerror or exc})") from exc
    except UnicodeDecodeError:
        raise UserError(parameter, f"{path}: the network configuration is not a text file") from None
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise UserError(parameter, f"{path}: the network configuration is not valid YAML ({problem})") from exc
    require(isinstance(raw, dict), parameter, f"{path}: the network configuration must be a YAML mapping")
    lists: dict[str, list[Any]] = {}
    for key in NETWORK_KEYS:
        require(key in raw, key, "is required in the network configuration")
        value = raw[key]
        require(isinstance(value, list), key,
                f"must be a list with one entry per dimension (a scalar aborts the simulator), "
                f"got {value!r}")
        require(len(value) > 0, key, "must list at least one dimension")
        lists[key] = value
    lengths = {len(v) for v in lists.values()}
    require(len(lengths) == 1, "network", "topology, npus_count, bandwidth and latency must have "
                                          f"the same length, got {[len(lists[k]) for k in NETWORK_KEYS]}")
    dims = []
    for i in range(len(lists["topology"])):
        topo = lists["topology"][i]
        require(topo in TOPOLOGIES, f"topology[{i}]",
                f"must be one of {', '.join(TOPOLOGIES)}, got {topo!r}")
        npus = _int(lists["npus_count"][i], f"npus_count[{i}]", 1)
        bandwidth = _number(lists["bandwidth"][i], f"bandwidth[{i}]")
        latency = lists["latency"][i]
        require(not isinstance(latency, bool) and isinstance(latency, (int, float))
                and math.isfinite(latency) and latency >= 0, f"latency[{i}]",
                f"must be a non-negative number, got {latency!r}")
        dims.append(NetworkDim(topo, npus, bandwidth, latency))
    return dims


def _yaml_list(values: list[Any]) -> str:
    return "[ " + ", ".join(str(v) for v in values) + " ]"


def write_network_yml(dims: list[NetworkDim], path: Path) -> None:
    """Write the analytical network configuration in the simulator's own flow-list style."""
    require(len(dims) > 0, "network", "needs at least one dimension")
    text = (f"topology: {_yaml_list([d.topology for d in dims])}\n"
            f"npus_count: {_yaml_list([d.npus for d in dims])}\n"
            f"bandwidth: {_yaml_list([_plain_number(float(d.bandwidth_GBps)) for d in dims])}\n"
            f"latency: {_yaml_list([_plain_number(float(d.latency_ns)) for d in dims])}\n")
    Path(path).write_text(text)


# -- memory.json ------------------------------------------------------------------------------

def read_memory_json(path: Path, parameter: str = "remote-memory-configuration") -> str:
    """The remote-memory type (the simulator requires the file even when memory is unused)."""
    raw = _load_json(path, "remote-memory configuration", parameter)
    require(isinstance(raw, dict) and "memory-type" in raw, "memory-type",
            "is required in the remote-memory configuration")
    kind = raw["memory-type"]
    require(kind in MEMORY_TYPES, "memory-type", f"must be one of {', '.join(MEMORY_TYPES)}, got {kind!r}")
    return kind


def write_memory_json(path: Path, memory_type: str = NO_MEMORY_EXPANSION) -> None:
    """Write the remote-memory configuration; only NO_MEMORY_EXPANSION needs no further keys."""
    require(memory_type == NO_MEMORY_EXPANSION, "memory-type",
            f"only {NO_MEMORY_EXPANSION} can be written (other types need remote-memory settings)")
    Path(path).write_text(json.dumps({"memory-type": memory_type}) + "\n")
