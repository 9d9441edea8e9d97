"""The SMs a communication kernel takes from compute while it runs (SM sharing).

An NCCL collective is one kernel with one thread block (CTA) per channel, and a CTA of NCCL
holds its SM for the kernel's whole run (its shared memory leaves no room for a compute
block beside it), so a GEMM or attention kernel that runs while a collective does gets the
GPU's other SMs: its rate falls to (SMs - channels) / SMs of its own for that time.

Channels per collective, as NCCL picks them (read from its topology search and enqueue
logic, NCCL 2.18-2.22, the releases the calibrated Megatron-Core and NeMo tables ran):

* ring and tree (and CollNet): the communicator's channel count, ``RING_CHANNELS`` by GPU
  generation (the NVSwitch systems' search result: DGX A100 logs 24 channels, DGX H100 32,
  NCCL's MAXCHANNELS), cut for small messages: NCCL lowers the channels while the message
  holds fewer than 512 threads x 64 bytes (the Simple protocol's per-thread threshold) per
  channel, so a collective of B bytes uses min(channels, max(1, B / 32 KiB)) of them. B is the
  whole buffer NCCL moves (an all-gather's output, a reduce-scatter's input);
* NVLS (NVLink SHARP all-reduce): ``NVLS_CHANNELS`` (NCCL_NVLS_NCHANNELS' default: the switch
  does the reduction, 16 CTAs feed it), whatever the size;
* all-to-all: grouped sends and receives over NCCL's point-to-point channels, the same
  count as the ring's.

Not modelled: point-to-point pipeline and context-parallel messages (a send to one peer runs
on a few channels), and Transformer Engine's userbuffer overlap, which takes a stated number
of SMs (or copy engines) per GEMM instead of NCCL's channels: its tensor-parallel chunks are
priced as NCCL collectives. The SMs left to compute never fall below one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from stage_cosim.hardware.gpu import GPU

RING_CHANNELS = {"ampere": 24, "hopper": 32, "blackwell": 32}
DEFAULT_CHANNELS = 32                 # NCCL's MAXCHANNELS before 2.23
NVLS_CHANNELS = 16
BYTES_PER_CHANNEL = 512 * 64          # Simple protocol: threads per CTA x bytes per thread


def channels(coll: str, nbytes: int, n: int, algorithm: str, arch: str) -> int:
    """The CTAs (one per channel) NCCL runs ``coll`` with over ``n`` ranks (``nbytes`` in the
    network model's convention: an all-gather's is each rank's shard)."""
    if n <= 1:
        return 0
    if algorithm == "nvls":
        return NVLS_CHANNELS
    most = RING_CHANNELS.get(arch, DEFAULT_CHANNELS)
    if coll == "ALL_TO_ALL":
        return most
    total = nbytes * n if coll == "ALL_GATHER" else nbytes
    return max(1, min(most, int(total // BYTES_PER_CHANNEL)))


@dataclass(frozen=True)
class CommSMs:
    """The share of a rank's SMs each collective takes while it runs (what the replay engine
    asks for every collective when SM sharing is on)."""

    gpu: GPU
    network: object                    # a NetworkModel; its timed() names the algorithm where it has one
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def ceiling(self) -> float:
        """The most the running collectives can take together: all SMs but one."""
        return 1.0 - 1.0 / self.gpu.sm_count

    def fraction(self, coll: str, nbytes: int, members: Sequence[int]) -> float:
        sms = self.gpu.sm_count
        if not sms or len(members) <= 1:
            return 0.0
        key = (coll, nbytes, tuple(members))
        found = self._cache.get(key)
        if found is None:
            timed = getattr(self.network, "timed", None)
            algorithm = timed(coll, nbytes, members)[1] if timed is not None and coll != "ALL_TO_ALL" else "ring"
            found = self._cache[key] = min(channels(coll, nbytes, len(members), algorithm, self.gpu.arch), sms) / sms
        return found


def comm_sms(network, gpu: GPU) -> CommSMs | None:  # noqa: ANN001 (a NetworkModel)
    """The SM sharing of ``gpu`` on ``network`` (None where the GPU's SM count is not known)."""
    return CommSMs(gpu, network) if gpu.sm_count else None
