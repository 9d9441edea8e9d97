"""Clusters: GPUs in scale-up domains (NVLink) joined by a scale-out network (InfiniBand …).

Internally a cluster is a list of network dimensions in ASTRA-sim's vocabulary
(:class:`~stage_cosim.hardware.network.NetworkDim`), so the ASTRA-sim adapter maps it one to one.
The presets are records, one per file in ``data/clusters/`` (``CLUSTER_PRESETS``: name -> record).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import yaml

from stage_cosim.errors import UserError, require
from stage_cosim.files import local_files_allowed, read_yaml
from stage_cosim.hardware.gpu import GPU, get_gpu, gpu_names
from stage_cosim.hardware.network import TOPOLOGIES, NetworkDim
from stage_cosim.limits import MAX_RANKS, MAX_RANKS_TEXT

GIB_PER_GB = 1e9 / (1 << 30)   # ASTRA-sim's "GB/s" is 2^30 B/s; vendor figures are 10^9 B/s


@dataclass(frozen=True)
class ScaleUp:
    """The domain where every GPU reaches every other at full bandwidth (an NVLink switch)."""

    gpus_per_domain: int
    bandwidth_GBps: float      # per GPU per direction, 10^9 B/s
    latency_ns: float
    topology: str = "Switch"
    # GPUs per tray (a rack's unit of allocation: GB200 NVL72's compute tray holds 4), or 0
    # where a domain is one box that a job takes whole (a DGX node). A job on domains of trays
    # need not fill whole domains: see Cluster.domain.
    gpus_per_tray: int = 0


@dataclass(frozen=True)
class ScaleOut:
    """The network between domains; bandwidth per GPU (its NIC), divided by oversubscription."""

    bandwidth_GBps: float      # per GPU per direction, 10^9 B/s
    latency_ns: float
    topology: str = "Switch"
    oversubscription: float = 1.0


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPU
    num_gpus: int
    scale_up: ScaleUp
    scale_out: ScaleOut

    def __post_init__(self) -> None:
        require(isinstance(self.num_gpus, int) and self.num_gpus > 0, "cluster.num_gpus",
                f"must be a positive integer, got {self.num_gpus!r}")
        require(self.num_gpus <= MAX_RANKS, "cluster.num_gpus",
                f"{self.num_gpus:,} GPUs, more than the {MAX_RANKS_TEXT}")
        d = self.scale_up.gpus_per_domain
        require(isinstance(d, int) and d > 0, "cluster.scale_up.gpus_per_domain", f"must be a positive integer, got {d!r}")
        tray = self.scale_up.gpus_per_tray
        require(isinstance(tray, int) and tray >= 0 and (tray == 0 or d % tray == 0), "cluster.scale_up.gpus_per_tray",
                f"must be 0 or a whole number of GPUs that divides gpus_per_domain ({d}), got {tray!r}")
        if tray:
            require(self._domain_of_trays() is not None, "cluster",
                    f"{self.num_gpus} GPUs cannot be spread evenly over racks of {d} in whole trays of {tray}")
        else:
            require(self.num_gpus <= d or self.num_gpus % d == 0, "cluster",
                    f"{self.num_gpus} GPUs do not fill whole scale-up domains of {d}")
        for part, obj in (("scale_up", self.scale_up), ("scale_out", self.scale_out)):
            require(obj.bandwidth_GBps > 0, f"cluster.{part}.bandwidth_GBps", f"must be positive, got {obj.bandwidth_GBps!r}")
            require(obj.latency_ns >= 0, f"cluster.{part}.latency_ns", f"must be non-negative, got {obj.latency_ns!r}")
            require(obj.topology in TOPOLOGIES, f"cluster.{part}.topology",
                    f"must be one of {', '.join(TOPOLOGIES)}, got {obj.topology!r}")
        require(self.scale_out.oversubscription >= 1, "cluster.scale_out.oversubscription",
                f"must be at least 1, got {self.scale_out.oversubscription!r}")

    def _domain_of_trays(self) -> int | None:
        """The job's GPUs in each rack when racks are allocated by trays: the same number of
        whole trays in every rack it uses, as many as a rack holds (the fewest racks)."""
        d, tray = self.scale_up.gpus_per_domain, self.scale_up.gpus_per_tray
        if self.num_gpus <= d:
            return self.num_gpus if self.num_gpus % tray == 0 or self.num_gpus < tray else None
        return next((k for k in range(d - d % tray, 0, -tray) if self.num_gpus % k == 0), None)

    @property
    def domain(self) -> int:
        """GPUs of the job in one scale-up domain: the whole domain, or all the job's GPUs where
        they fit in one; on racks of trays (NVL72), the job's GPUs in each rack it spreads over
        evenly, in whole trays (256 GPUs: 4 racks of 64, 16 of each rack's 18 trays)."""
        if self.scale_up.gpus_per_tray:
            return self._domain_of_trays() or self.num_gpus
        return min(self.scale_up.gpus_per_domain, self.num_gpus)

    @property
    def num_domains(self) -> int:
        return self.num_gpus // self.domain

    def network_dims(self) -> list[NetworkDim]:
        """Innermost first; ASTRA-sim units (GB/s with GB = 2^30 B, ns per hop)."""
        dims = [NetworkDim(self.scale_up.topology, self.domain, self.scale_up.bandwidth_GBps * GIB_PER_GB,
                           self.scale_up.latency_ns)]
        if self.num_domains > 1:
            bw = self.scale_out.bandwidth_GBps / self.scale_out.oversubscription
            dims.append(NetworkDim(self.scale_out.topology, self.num_domains, bw * GIB_PER_GB,
                                   self.scale_out.latency_ns))
        return dims

    def with_gpus(self, num_gpus: int) -> "Cluster":
        return replace(self, num_gpus=num_gpus)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu"] = self.gpu.to_dict()
        return d


@lru_cache(maxsize=1)
def cluster_presets() -> dict[str, dict]:
    """The cluster presets, one record each in data/clusters/<name>.yaml (the fields of a
    --cluster file but num_gpus), in the order of their GPUs (gpu_names)."""
    out = {}
    for path in resources.files("stage_cosim.hardware").joinpath("data", "clusters").iterdir():
        if not path.name.endswith(".yaml"):
            continue
        doc = yaml.safe_load(path.read_text())
        name = path.name.removesuffix(".yaml")
        if not isinstance(doc, dict) or doc.get("name") != name:
            raise ValueError(f"hardware/data/clusters/{path.name}: a preset's record names it as its file does")
        out[name] = doc
    order = {g: i for i, g in enumerate(gpu_names())}

    def key(item: tuple[str, dict]) -> tuple[int, str]:
        gpu = item[1].get("gpu")
        base = gpu.get("base") if isinstance(gpu, dict) else gpu
        return order.get(base, len(order)), item[0]

    return dict(sorted(out.items(), key=key))


def __getattr__(name: str) -> Any:
    # CLUSTER_PRESETS (preset name -> its record) reads the records on first use, not on import
    if name == "CLUSTER_PRESETS":
        return cluster_presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _number(value: object, parameter: str, where: str) -> None:
    """A cluster field that must be a finite number (the dataclasses compare it as one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(parameter, f"{where}: must be a finite number, got {value!r}")


def _build(doc: dict, where: str, num_gpus: int | None) -> Cluster:
    if not isinstance(doc, dict):
        raise UserError("cluster", f"{where}: expected a mapping")
    known = {"name", "gpu", "num_gpus", "scale_up", "scale_out"}
    for k in doc:
        if k not in known:
            raise UserError(f"cluster.{k}", f"{where}: unknown key (known: {', '.join(sorted(known))})")
    gpu_doc = doc.get("gpu")
    if isinstance(gpu_doc, str):
        gpu = get_gpu(gpu_doc)
    elif isinstance(gpu_doc, dict):
        base = gpu_doc.get("base")
        overrides = {k: v for k, v in gpu_doc.items() if k != "base"}
        for k, v in overrides.items():
            # every GPU field is a number but its name and architecture (checked by the GPU)
            if k not in ("name", "arch") and v is not None:
                _number(v, f"cluster.gpu.{k}", where)
        if base is not None:
            gpu = get_gpu(base).with_overrides(**overrides)
        else:
            try:
                gpu = GPU(**overrides)
            except TypeError as exc:
                raise UserError("cluster.gpu", f"{where}: {exc} (or give 'base: <preset>' and overrides)") from None
    else:
        raise UserError("cluster.gpu", f"{where}: must be a GPU preset name or a mapping")

    def part(cls, key: str):
        sub = doc.get(key)
        if not isinstance(sub, dict):
            raise UserError(f"cluster.{key}", f"{where}: required mapping is missing")
        known = {f.name: f for f in fields(cls)}
        for k in sub:
            if k not in known:
                raise UserError(f"cluster.{key}.{k}", f"{where}: unknown key (known: {', '.join(sorted(known))})")
        for name, f in known.items():
            if name not in sub:
                if f.default is MISSING:
                    raise UserError(f"cluster.{key}.{name}", f"is required in {where}")
            elif f.type == "str":
                if not isinstance(sub[name], str):
                    raise UserError(f"cluster.{key}.{name}", f"{where}: must be a name, got {sub[name]!r}")
            else:
                _number(sub[name], f"cluster.{key}.{name}", where)
        return cls(**sub)

    n = num_gpus if num_gpus is not None else doc.get("num_gpus")
    if n is None:
        raise UserError("cluster.num_gpus", f"is required in {where} (or give PRESET:COUNT)")
    return Cluster(str(doc.get("name", where)), gpu, n, part(ScaleUp, "scale_up"), part(ScaleOut, "scale_out"))


def resolve_cluster(spec: str, default_gpus: int | None = None) -> Cluster:
    """``preset``, ``preset:COUNT`` or a YAML file describing every field (where files are read:
    a server's requests name presets only, and the name is never looked up on disk)."""
    path = Path(spec)
    if local_files_allowed() and (spec.endswith((".yaml", ".yml")) or path.is_file()):
        doc = read_yaml(path, "cluster")
        return _build(doc, spec, None if doc and isinstance(doc, dict) and "num_gpus" in doc else default_gpus)
    name, colon, count = spec.partition(":")
    presets = cluster_presets()
    if name not in presets:
        how = "or a YAML file" if local_files_allowed() else \
            "files are not read here: send the description's content"
        raise UserError("cluster", f"unknown preset {name!r} (known: {', '.join(presets)}; {how})")
    n = default_gpus
    if colon:
        try:
            n = int(count)
        except ValueError:
            raise UserError("cluster", f"GPU count after ':' must be an integer, got {count!r}") from None
        if n <= 0:
            raise UserError("cluster", f"GPU count after ':' must be positive, got {count!r}")
        if n > MAX_RANKS:
            raise UserError("cluster", f"{n:,} GPUs, more than the {MAX_RANKS_TEXT}")
    return _build(dict(presets[name]), name, n if n is not None else presets[name]["scale_up"]["gpus_per_domain"])


def cluster_from(spec: "str | Mapping[str, Any]", default_gpus: int | None = None) -> Cluster:
    """A cluster from a request: ``preset[:COUNT]``, a YAML path (see :func:`resolve_cluster`), or
    the description itself as a mapping (its ``num_gpus``, else ``default_gpus``)."""
    if isinstance(spec, Mapping):
        return _build(dict(spec), "cluster", spec["num_gpus"] if spec.get("num_gpus") is not None else default_gpus)
    return resolve_cluster(str(spec), default_gpus)


def check_fits(cluster: Cluster, mesh, expert_mesh=None) -> None:  # noqa: ANN001 (DeviceMesh; avoids an import cycle)
    """The mesh must use every GPU, and no tensor-parallel group (nor, for expert layers, any
    expert_tp group) may straddle scale-up domains unevenly (it either lies inside one domain or
    covers whole domains)."""
    require(cluster.num_gpus == mesh.world_size, "cluster",
            f"has {cluster.num_gpus} GPUs but dp*tp*cp*pp = {mesh.world_size}")
    d = cluster.domain
    for m, axis in ((mesh, "tp"), (expert_mesh, "expert_tp")):
        if m is None or axis not in m.size or m.size[axis] == 1:
            continue
        for members in m.groups(axis):
            counts: dict[int, int] = {}
            for r in members:
                counts[r // d] = counts.get(r // d, 0) + 1
            if len(set(counts.values())) > 1 or (len(counts) > 1 and min(counts.values()) != d):
                raise UserError(axis.replace("_", "-"), f"tensor-parallel group {members[:8]}"
                                f"{'…' if len(members) > 8 else ''} splits unevenly across scale-up domains of {d} GPUs")
