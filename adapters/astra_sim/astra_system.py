"""ASTRA-sim's analytical model: its vocabulary, and the system settings that change timing.

This module holds the collectives, implementations and bounds the model knows, and
:class:`AstraSystem` (the timing settings of system.json). The model as a whole is an exact
re-implementation of ASTRA-sim's congestion-unaware analytical backend.

ASTRA-sim is a C++ program users build themselves, so the project cannot count on having it.
The model reproduces what its congestion-unaware binary prints (per-rank finish time and
exposed communication) from the rules in ``astra-sim-cost-model.md``, which were inferred from
the real simulator and checked against every successful reference run. Section numbers in the
comments (§1 ... §7) refer to that file.

Three layers, as in ASTRA-sim:

* network (§1, §2; :mod:`astra_network`): the delay of one message between two ranks, and the
  reduction cost;
* system (§3 - §6): one collective, chunked, run phase by phase over the network dimensions
  (or over a communicator group's logical ring), with each rank's per-dimension queues: the
  phases and one phase of one chunk in :mod:`astra_phases` (§4, §5), the chunks through the
  phases in :mod:`astra_collectives` (§3, §6);
* workload (§7; :mod:`astra_workload`, :mod:`astra_replay`): event-driven replay of every rank's
  Chakra node graph, one compute slot and one communication slot per rank, collectives coupling
  the ranks of their group.

All times are integer nanoseconds (ASTRA-sim's cycles).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from stage_cosim.errors import UserError, require

# -- vocabulary ---------------------------------------------------------------------------------

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = ("ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER",
                                                      "ALL_TO_ALL")
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)
# Chakra CollectiveCommType codes of the collectives ASTRA-sim simulates.
COLLECTIVE_BY_CODE = {0: ALL_REDUCE, 2: ALL_GATHER, 6: ALL_TO_ALL, 7: REDUCE_SCATTER}
# A BROADCAST is not simulated as a collective: it holds the rank's communication slot for its
# duration_micros (0 gives 1 ns), on each rank alone.
BROADCAST_CODE = 5
IMPLEMENTATIONS = ("ring", "direct", "halvingDoubling", "doubleBinaryTree", "oneRing",
                   "oneDirect", "oneHalvingDoubling")
SCHEDULING_POLICIES = ("LIFO", "FIFO")
OPTIMIZATIONS = ("baseline", "localBWAware")
# A communicator group that is not all ranks always pays this endpoint delay (§2).
GROUP_ENDPOINT_DELAY_NS = 10
# Bounds on preferred-dataset-splits. Every split is a chunk that each member of a collective's
# group carries through every phase: the replay holds a queue entry and an event per chunk and
# member (about 90 B) and spends 4-10 µs of CPU on each, per distinct collective
# (``python benchmarks/astra_replay_speed.py --splits …`` measures it; docs/guide/astra-sim.md
# has the figures). So chunks x members is bounded, at 2^20: about 100 MB and 5-10 s for one
# collective (4096 splits over 256 ranks took 5.5 s, 2048 over 512 ranks 10.5 s; 4096 over 512
# ranks, twice the bound, did not finish in 300 s). The splits alone are bounded at 4096 as well,
# where the binary is already slow (61 s of CPU for one all-reduce over 64 ranks); its own
# examples use 4 to 64.
MAX_DATASET_SPLITS = 4096
MAX_CHUNK_COPIES = 1 << 20

# Chakra node types (et_def.proto NodeType).
COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE = 4, 5, 6, 7


@dataclass(frozen=True)
class AstraSystem:
    """The settings of ASTRA-sim's system configuration (system.json) that change timing.

    ``implementations`` maps a collective name (``"ALL_REDUCE"`` ...) to one implementation per
    network dimension, exactly as the ``*-implementation`` lists of the file. ``extra`` keeps
    keys this model does not interpret (``boost-mode``, ``trace-enabled`` ...) so that reading
    and writing a file round-trips them.
    """

    scheduling_policy: str = "LIFO"
    collective_optimization: str = "baseline"
    endpoint_delay_ns: int = 10
    active_chunks_per_dimension: int = 1
    preferred_dataset_splits: int = 1
    implementations: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    local_mem_bw_GBps: float | None = None
    peak_perf_TFLOPS: float | None = None
    roofline_enabled: bool = False
    extra: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        require(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling-policy",
                f"must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        require(self.collective_optimization in OPTIMIZATIONS, "collective-optimization",
                f"must be one of {', '.join(OPTIMIZATIONS)}, got {self.collective_optimization!r}")
        _require_int(self.endpoint_delay_ns, "endpoint-delay", minimum=0)
        _require_int(self.active_chunks_per_dimension, "active-chunks-per-dimension", minimum=1)
        _require_int(self.preferred_dataset_splits, "preferred-dataset-splits", minimum=1)
        require(self.preferred_dataset_splits <= MAX_DATASET_SPLITS, "preferred-dataset-splits",
                f"must be at most {MAX_DATASET_SPLITS}, got {self.preferred_dataset_splits} (each split is a chunk "
                f"that every group member carries through every phase: more cannot be simulated in reasonable time)")
        impls: dict[str, tuple[str, ...]] = {}
        for coll, names in dict(self.implementations).items():
            require(coll in COLLECTIVES, "implementations",
                    f"keys must be {', '.join(COLLECTIVES)}, got {coll!r}")
            names = (names,) if isinstance(names, str) else tuple(names)
            for name in names:
                require(name in IMPLEMENTATIONS, _impl_key(coll),
                        f"entries must be one of {', '.join(IMPLEMENTATIONS)}, got {name!r}")
            impls[coll] = names
        object.__setattr__(self, "implementations", MappingProxyType(impls))
        for value, key in ((self.local_mem_bw_GBps, "local-mem-bw"),
                           (self.peak_perf_TFLOPS, "peak-perf")):
            require(value is None or (_is_number(value) and value > 0), key,
                    f"must be a positive number or absent, got {value!r}")
        object.__setattr__(self, "roofline_enabled", bool(self.roofline_enabled))
        object.__setattr__(self, "extra", tuple((str(k), v) for k, v in self.extra))

    def __hash__(self) -> int:
        # The implementation map and ``extra`` values are not hashable as stored; hash a
        # canonical form so systems can key caches.
        return hash((self.scheduling_policy, self.collective_optimization, self.endpoint_delay_ns,
                     self.active_chunks_per_dimension, self.preferred_dataset_splits,
                     tuple(sorted(self.implementations.items())), self.local_mem_bw_GBps,
                     self.peak_perf_TFLOPS, self.roofline_enabled, repr(self.extra)))

    def implementation_list(self, collective: str) -> tuple[str, ...]:
        """The per-dimension implementations of ``collective``; a missing list is an error
        because the real simulator then never completes the collective."""
        impls = self.implementations.get(collective)
        if not impls:
            raise UserError(_impl_key(collective), "missing: the simulator aborts on a collective "
                                                   "without its implementation list")
        return impls


def _impl_key(collective: str) -> str:
    return collective.lower().replace("_", "-") + "-implementation"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require_int(value: object, key: str, minimum: int) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key,
            f"must be an integer >= {minimum}, got {value!r}")
