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
from stage_cosim.hardware.network import SCALE_OUT_TOPOLOGIES, TIERED_TOPOLOGIES, TOPOLOGIES, NetworkDim
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
    """The network between domains. ``Switch``, ``Ring``, ``FullyConnected`` (ASTRA-sim's names):
    one number, the NIC's bandwidth divided by ``oversubscription``, for every collective. The
    tiered designs (``fat-tree``, ``rail-optimized``, ``rail-only``) are switches of
    ``switch_radix`` ports in tiers, half of a leaf's ports down to NICs; each tier's uplinks
    carry its downlinks' bandwidth divided by that tier's oversubscription (one number: the
    leaves'; a list: per tier, leaf first), and collectives share them flow by flow
    (:mod:`stage_cosim.adapters.roofline.contention`)."""

    bandwidth_GBps: float      # per GPU per direction, 10^9 B/s (all its planes together)
    latency_ns: float
    topology: str = "Switch"
    oversubscription: float | tuple[float, ...] = 1.0
    switch_radix: int = 64     # ports per switch (at the plane's port speed)
    # independent networks the NICs' ports are striped over (multi-plane); each carries
    # bandwidth_GBps / planes per GPU and has its own switches
    planes: int = 1
    # SHARP-style reductions in the switches (NCCL's CollNet algorithm for all-reduce)
    in_network_reduction: bool = False

    def __post_init__(self) -> None:
        over = self.oversubscription
        if isinstance(over, list):
            object.__setattr__(self, "oversubscription", over := tuple(over))
        tiers = over if isinstance(over, tuple) else (over,)
        require(len(tiers) > 0 and all(not isinstance(o, bool) and isinstance(o, (int, float)) and o >= 1
                                       for o in tiers), "cluster.scale_out.oversubscription",
                f"must be a number of at least 1 or a list of them, one per tier above the leaf, got "
                f"{list(over) if isinstance(over, tuple) else over!r}")
        require(not isinstance(over, tuple) or self.topology in TIERED_TOPOLOGIES or len(tiers) == 1,
                "cluster.scale_out.oversubscription",
                f"a list per tier needs a tiered topology ({', '.join(TIERED_TOPOLOGIES)}), not {self.topology!r}")
        r = self.switch_radix
        require(not isinstance(r, bool) and isinstance(r, int) and r >= 4 and r % 2 == 0,
                "cluster.scale_out.switch_radix", f"must be an even number of ports, at least 4, got {r!r}")
        p = self.planes
        require(not isinstance(p, bool) and isinstance(p, int) and 1 <= p <= 16, "cluster.scale_out.planes",
                f"must be a whole number from 1 to 16, got {p!r}")
        require(isinstance(self.in_network_reduction, bool), "cluster.scale_out.in_network_reduction",
                f"must be true or false, got {self.in_network_reduction!r}")

    @property
    def tiers_oversubscription(self) -> tuple[float, ...]:
        """Each tier's oversubscription above the leaf, leaf first (one number: the leaves')."""
        over = self.oversubscription
        return tuple(float(o) for o in over) if isinstance(over, tuple) else (float(over),)

    @property
    def tiered(self) -> bool:
        return self.topology in TIERED_TOPOLOGIES

    @property
    def flat_bandwidth_GBps(self) -> float:
        """What one collective's flow gets where the network is one number: the NIC's share of
        the leaf's uplinks (a tiered network's contention is left to the flow model)."""
        return self.bandwidth_GBps if self.tiered else self.bandwidth_GBps / self.tiers_oversubscription[0]

    def astra_refusal(self) -> str | None:
        """Why ASTRA-sim's network file cannot express this network one to one (None: it can; a
        non-blocking single-plane fat-tree is one switch to its analytical backend)."""
        if not self.tiered:
            return None
        if any(o != 1 for o in self.tiers_oversubscription):
            return (f"a {self.topology} with oversubscribed tiers {list(self.tiers_oversubscription)} has no "
                    f"ASTRA-sim network dimension (its analytical backend has one bandwidth per dimension)")
        if self.topology == "rail-only":
            return "a rail-only network has no ASTRA-sim dimension (rails never meet: no switch joins them)"
        if self.in_network_reduction:
            return "ASTRA-sim's network has no in-network reduction"
        return None


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
            names = TOPOLOGIES if part == "scale_up" else SCALE_OUT_TOPOLOGIES
            require(obj.topology in names, f"cluster.{part}.topology",
                    f"must be one of {', '.join(names)}, got {obj.topology!r}")
        if self.scale_out.topology in ("rail-optimized", "rail-only"):
            rails = self.rails
            require(self.domain % rails == 0 or self.num_domains == 1, "cluster.scale_out.topology",
                    f"{self.scale_out.topology} needs the job's GPUs in whole nodes of {rails} (one NIC per rail)")

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

    @property
    def rails(self) -> int:
        """GPUs of one node, each with its own NIC on its own rail: a tray's (NVL72), else a
        domain's (a DGX node)."""
        return self.scale_up.gpus_per_tray or self.scale_up.gpus_per_domain

    def network_dims(self) -> list[NetworkDim]:
        """Innermost first; ASTRA-sim units (GB/s with GB = 2^30 B, ns per hop)."""
        dims = [NetworkDim(self.scale_up.topology, self.domain, self.scale_up.bandwidth_GBps * GIB_PER_GB,
                           self.scale_up.latency_ns)]
        if self.num_domains > 1:
            why = self.scale_out.astra_refusal()
            require(why is None, "cluster.scale_out.topology", f"ASTRA-sim cannot express this network: {why}")
            bw = self.scale_out.flat_bandwidth_GBps
            # a non-blocking tiered network is one switch to ASTRA-sim's analytical backend
            topology = "Switch" if self.scale_out.tiered else self.scale_out.topology
            dims.append(NetworkDim(topology, self.num_domains, bw * GIB_PER_GB,
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
            # every GPU field is a number but its name, architecture (checked by the GPU) and
            # the record its efficiencies come from
            if k not in ("name", "arch", "record") and v is not None:
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
        sub = dict(sub)
        for name, f in known.items():
            value = sub.get(name)
            if name not in sub:
                if f.default is MISSING:
                    raise UserError(f"cluster.{key}.{name}", f"is required in {where}")
            elif f.type == "str":
                if not isinstance(value, str):
                    raise UserError(f"cluster.{key}.{name}", f"{where}: must be a name, got {value!r}")
            elif f.type == "bool":
                if not isinstance(value, bool):
                    raise UserError(f"cluster.{key}.{name}", f"{where}: must be true or false, got {value!r}")
            elif isinstance(value, list) and f.type.startswith("float | tuple"):
                for v in value:      # a per-tier list (oversubscription)
                    _number(v, f"cluster.{key}.{name}", where)
                sub[name] = tuple(value)
            else:
                _number(value, f"cluster.{key}.{name}", where)
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
