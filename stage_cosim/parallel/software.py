"""Software profiles: which framework release runs the step, and what it does by default.

A published run names its layout (tp, pp, dp, ...), its precision and its batch; the rest of a
recipe (sequence parallelism, communication overlap, the gradient reduction's precision) is what
the framework release does when nobody sets it. Those defaults are data, one record per release
(``data/software.yaml``), so that the published layout alone reproduces the run and a report can
name every setting it assumed. The default profile is the newest one calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Literal

import yaml

from stage_cosim.errors import UserError

if TYPE_CHECKING:
    # the configuration imports the profiles, so the type is named for annotations only
    from stage_cosim.parallel.config import GradReduceDtype

Framework = Literal["megatron", "nemo", "torchtitan"]
DEFAULT_SOFTWARE = "megatron-core-0.8"
# The ParallelConfig fields a profile fills when a request leaves them unset (None).
PROFILE_SWITCHES = ("sp", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather", "grad_reduce_dtype")
# Switches a framework may lack: the ParallelConfig fields above and Megatron-LM's
# --use-distributed-optimizer (ZeRO 1).
LACKABLE = (*PROFILE_SWITCHES, "use_distributed_optimizer")


@dataclass(frozen=True)
class SoftwareProfile:
    """One framework release and its defaults."""

    name: str
    framework: Framework
    released: str
    source: str
    # sequence parallelism whenever tp > 1
    sp: bool
    # tp collectives pipelined with their GEMMs whenever tp > 1 and sp is on
    tp_comm_overlap: bool
    # data-parallel gradient reduction in buckets behind the backward
    overlap_grad_reduce: bool
    # ZeRO 1/2: the updated parameters gathered ahead of each block's next forward
    overlap_param_gather: bool
    # the data-parallel gradient reduction's precision
    grad_reduce_dtype: GradReduceDtype
    # the fused attention kernel the release runs (attention_kernels_h100.csv's name; None: none
    # of its own); a GPU record may hold this release's attention efficiencies for it
    attention_kernel: str | None = None
    # switches the framework has no setting for (a request that sets one is refused)
    lacks: tuple[str, ...] = ()

    def default(self, switch: str, *, tp: int, sp: bool) -> bool | str:
        """The value of ``switch`` this release runs with when unset, for a step with tensor
        parallelism ``tp`` (and, for tp_comm_overlap, sequence parallelism ``sp``)."""
        if switch == "sp":
            return self.sp and tp > 1
        if switch == "tp_comm_overlap":
            return self.tp_comm_overlap and tp > 1 and sp
        return getattr(self, switch)

    def refuse_lacking(self, given: dict[str, object]) -> None:
        """Refuse a switch set in ``given`` (name -> value, None: unset) that this framework lacks."""
        for name in self.lacks:
            if given.get(name) is not None:
                raise UserError(name.replace("_", "-"),
                                f"has no {self.framework} setting (software profile {self.name}); leave it unset "
                                f"or pick another --software")


@lru_cache(maxsize=1)
def _profiles() -> dict[str, SoftwareProfile]:
    with resources.files("stage_cosim.parallel").joinpath("data", "software.yaml").open() as f:
        doc = yaml.safe_load(f)
    out = {}
    for name, entry in doc.items():
        entry = dict(entry)
        lacks = tuple(entry.pop("lacks", ()) or ())
        unknown = [s for s in lacks if s not in LACKABLE]
        if unknown:
            raise ValueError(f"software.yaml: {name} lacks unknown switches {unknown}")
        out[name] = SoftwareProfile(name=name, lacks=lacks, released=str(entry.pop("released")), **entry)
    return out


def software_names() -> list[str]:
    return list(_profiles())


def get_software(name: str | None) -> SoftwareProfile:
    """The profile called ``name`` (None: the default)."""
    profiles = _profiles()
    if name is None:
        name = DEFAULT_SOFTWARE
    if name not in profiles:
        raise UserError("software", f"unknown software profile {name!r} (known: {', '.join(profiles)})")
    return profiles[name]
