"""What a training or inference process holds on each GPU besides its tensors.

A real run starts only if, beside the model states, activations and workspaces the schedule
counts, the GPU also holds:

* **the CUDA context** — the driver's per-process state, most of it proportional to the SMs (each
  SM's local-memory reservation). Two published measurements of a bare context on one driver:
  555 MiB on a 188-SM Blackwell RTX PRO 6000 and 107 MiB on a 34-SM RTX 4060 Ti (llama.cpp pull
  request 23604); the line through them gives 322 MiB for A100's 108 SMs, in line with PyTorch's
  maintainers' "around 300-400 MB with CUDA >= 11.7's lazy module loading" (pytorch/pytorch issues
  107667 and 109888), 392 MiB for H100's 132 SMs and 439 MiB for B200's 148.
* **cuBLAS workspaces** — PyTorch gives every (cuBLAS handle, stream) pair a workspace of
  ``CUBLAS_WORKSPACE_CONFIG``'s default size, ``:4096:8`` = 32 MiB on sm90 (cuBLAS's
  recommendation for Hopper) and ``:4096:2:16:8`` = 8,519,680 B before (aten CublasHandlePool.cpp;
  the cuBLASLt workspace shares it). Handles are per thread, and the autograd engine runs the
  backward on a thread of its own: two workspaces. Transformer Engine, whose GEMMs Megatron-Core
  runs, keeps one more of its own: 32 MiB on compute capability 9.0 and later, 4 MiB before
  (``get_cublas_workspace_size_bytes``). Blackwell is taken as Hopper.
* **NCCL's buffers** — every connection (one channel, one direction between two ranks) holds a
  buffer per protocol: SIMPLE ``NCCL_BUFFSIZE`` (4 MiB), LL (8 lines x 512 threads x 8 steps x
  16 B = 512 KiB) and LL128 (120 x 640 x 8 x 8 B = 4,915,200 B), NCCL's defaults (init.cc); the
  receiving end holds them (the P2P transport moves the SIMPLE buffer to the sender under P2P
  read, which changes where, not how much). A ring collective receives from one neighbour per
  channel; point-to-point traffic (pipeline sends, the cp ring, all-to-alls) from each peer on
  every channel it uses to that peer. Channel counts follow NCCL's topology search: two channels
  per NVLink inside a scale-up domain, at most 32 (NCCL logs 24 on HGX A100's 12 NVLinks and 16
  on H800's 8; H100's 18 reach the cap); a ring that leaves the domain runs two channels per NIC
  its members use there, one NIC per GPU (16 rings on DGX H100 nodes of 8); point-to-point to a
  peer in another domain ``NCCL_NCHANNELS_PER_NET_PEER`` = 2 channels, inside one as many as
  the ring. Not counted: tree and NVLink SHARP buffers (left to the margin).
* **allocator fragmentation** — PyTorch's caching allocator keeps freed blocks reserved; what it
  holds beyond the tensors, as published for large-model runs: 563 MB beside 41,291 MB allocated
  (1.4 %, a Megatron-LM training step's own memory log, Megatron-LM issue 965) and 1.83 GiB
  beside 75.31 GiB (2.4 %, a Llama 70B job's out-of-memory report, vllm-project/compressed-tensors
  pull request 587). The larger share is charged on every byte of tensors. Irregular allocation
  patterns lose far more — GMLake (Guo et al., ASPLOS 2024) measured 15 % of reserved memory on
  average (up to 33 %) under DeepSpeed ZeRO-3, offloading and LoRA — but not a step that makes
  the same allocations every micro-batch: Llama 3 405B's published 8K configuration, whose
  activations alone are 70 GiB of the 80 here, could not have run with 15 %.

What is left unmodelled — kernel images CUDA loads lazily as the run first calls them (all of
PyTorch's took more than 1,000 MB before lazy loading), NVLink SHARP and tree buffers, allocator
rounding — is the search's default margin, :data:`DEFAULT_HEADROOM` of HBM (1.6 GiB of 80).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MiB = 1 << 20

# -- CUDA context ------------------------------------------------------------------------------
# (SMs, MiB) of two bare contexts measured on one driver (llama.cpp pull request 23604)
CONTEXT_MEASURED = ((188, 555.0), (34, 107.0))
# SMs of a GPU whose description does not say (its architecture's data-center part)
_ARCH_SMS = {"ampere": 108, "hopper": 132, "blackwell": 148, "ada": 142, "cdna2": 208, "cdna3": 304,
             # Gaudi has no SMs and no measured context: Gaudi 3's 64 vector cores (TPCs) stand in
             "gaudi": 64}

# -- cuBLAS -------------------------------------------------------------------------------------
PYTORCH_CUBLAS_WORKSPACE = {"ampere": 4096 * 1024 * 2 + 16 * 1024 * 8, "hopper": 4096 * 1024 * 8,
                            "blackwell": 4096 * 1024 * 8}
PYTORCH_CUBLAS_HANDLES = 2          # the forward's thread and the autograd engine's
TE_CUBLAS_WORKSPACE = {"ampere": 4 * MiB, "hopper": 32 * MiB, "blackwell": 32 * MiB}
# The serving parts of other generations hold what a pre-Hopper GPU does: Ada is compute
# capability 8.9 (below sm90 in both defaults); ROCm's PyTorch parses the same
# CUBLAS_WORKSPACE_CONFIG for hipBLAS(Lt), and Gaudi's runtime is taken alike (no figure of its own).
for _arch in ("ada", "cdna2", "cdna3", "gaudi"):
    PYTORCH_CUBLAS_WORKSPACE[_arch] = PYTORCH_CUBLAS_WORKSPACE["ampere"]
    TE_CUBLAS_WORKSPACE[_arch] = TE_CUBLAS_WORKSPACE["ampere"]

# -- NCCL ---------------------------------------------------------------------------------------
NCCL_BUFFSIZE = 4 * MiB                       # SIMPLE
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16           # NCCL_LL_LINES_PER_THREAD x threads x NCCL_STEPS x line
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8       # elements per thread x threads x NCCL_STEPS x 8 B
NCCL_CONNECTION_BYTES = NCCL_BUFFSIZE + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE
NCCL_MAX_CHANNELS = 32
NCCL_CHANNELS_PER_NET_PEER = 2
# NVLink bandwidth per link and direction, GB/s: NVLink 3 and 4 (A100, H100) 25, NVLink 5 50
_NVLINK_LINK_GBPS = {"ampere": 25.0, "hopper": 25.0, "blackwell": 50.0,
                     # the scale-up links of the others, each way: Ada's one PCIe Gen4 x16 port,
                     # an Infinity Fabric link (MI250 50, MI300 64), a 200 GbE RoCE port
                     "ada": 32.0, "cdna2": 50.0, "cdna3": 64.0, "gaudi": 25.0}

# -- the caching allocator ------------------------------------------------------------------
# (reserved but unallocated, allocated) of the two published logs, in their own units (MB, GiB)
FRAGMENTATION_MEASURED = ((41854.0 - 41291.0, 41291.0), (1.83, 75.31))
FRAGMENTATION = max(free / used for free, used in FRAGMENTATION_MEASURED)    # 2.43 % of the allocated bytes

# The search keeps this share of HBM free besides everything modelled (what is not: see above).
DEFAULT_HEADROOM = 0.02


def sm_count(gpu) -> int:  # noqa: ANN001 (hardware.gpu.GPU)
    n = getattr(gpu, "sm_count", 0) or 0
    return int(n) if n > 0 else _ARCH_SMS[gpu.arch]


def cuda_context_bytes(gpu) -> int:  # noqa: ANN001
    """The bare CUDA context of one process on ``gpu``: the line through the measurements."""
    (s1, m1), (s2, m2) = CONTEXT_MEASURED
    per_sm = (m1 - m2) / (s1 - s2)
    return int(round((m2 + per_sm * (sm_count(gpu) - s2)) * MiB))


def cublas_workspace_bytes(gpu) -> int:  # noqa: ANN001
    return PYTORCH_CUBLAS_HANDLES * PYTORCH_CUBLAS_WORKSPACE[gpu.arch] + TE_CUBLAS_WORKSPACE[gpu.arch]


def nvlinks(gpu, scale_up_GBps: float) -> int:  # noqa: ANN001
    """NVLinks per GPU of a scale-up domain of ``scale_up_GBps`` per GPU and direction."""
    return max(1, round(scale_up_GBps / _NVLINK_LINK_GBPS[gpu.arch]))


def ring_channels(gpu, scale_up_GBps: float, members_per_domain: int, spans_domains: bool) -> int:  # noqa: ANN001
    """Channels of a ring collective's communicator: two per NVLink inside a domain (at most
    NCCL's 32); across domains two per NIC its members use in a domain (one NIC per GPU)."""
    inside = min(NCCL_MAX_CHANNELS, 2 * nvlinks(gpu, scale_up_GBps))
    return min(inside, 2 * members_per_domain) if spans_domains else inside


def p2p_channels(gpu, scale_up_GBps: float, same_domain: bool) -> int:  # noqa: ANN001
    """Channels point-to-point traffic uses to one peer."""
    return ring_channels(gpu, scale_up_GBps, 1, False) if same_domain else NCCL_CHANNELS_PER_NET_PEER


@dataclass(frozen=True)
class Communicator:
    """What a rank's NCCL buffers depend on for one communicator it uses.

    ``ring``: the channels of its ring collectives (0: none); ``peers``: for point-to-point
    traffic, the channels to each peer it receives from."""

    kind: str
    size: int
    ring: int = 0
    peers: tuple[int, ...] = ()

    @property
    def connections(self) -> int:
        return self.ring + sum(self.peers)

    @property
    def buffer_bytes(self) -> int:
        return self.connections * NCCL_CONNECTION_BYTES


def fragmentation_bytes(allocated: float) -> int:
    """What the caching allocator holds beyond ``allocated`` bytes of tensors."""
    return int(math.ceil(FRAGMENTATION * max(0.0, allocated)))
