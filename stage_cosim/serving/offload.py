"""The host link a KV-cache offload tier loads over: measured host-to-device rates per GPU.

A block offloaded to host memory comes back over the GPU's host link (PCIe, or NVLink-C2C on
Grace parts). The rates are nvbandwidth's ``host_to_device`` copy-engine test (TransferBench on
MI300X) as the Azure AI benchmarking guide publishes them for its ND-series VMs: one GPU copying
alone, 10^9 B/s. Each GPU of an instance loads its own shard of a block over its own link at
once, so a load takes ``bytes per GPU / rate``. GPUs on the same host link as a measured one
borrow its rate, and say so; a GPU with neither refuses offload rather than guess.
"""

from __future__ import annotations

from stage_cosim.errors import UserError

_AZURE = "Azure AI benchmarking guide, nvbandwidth host_to_device"
# GPU record name -> (GB/s, where it comes from)
HOST_TO_DEVICE_GBPS: dict[str, tuple[float, str]] = {
    "A100-80GB": (26.28, f"{_AZURE}, ND A100 v4 (PCIe Gen4 x16)"),
    "A100-40GB": (26.28, f"borrowed from A100-80GB ({_AZURE}): the same HGX A100 board, PCIe Gen4 x16"),
    "H100-SXM": (51.0, f"{_AZURE}, ND H100 v5 (PCIe Gen5 x16)"),
    "H800": (51.0, f"borrowed from H100-SXM ({_AZURE}): the same HGX H100 board, PCIe Gen5 x16"),
    "H200": (55.0, f"{_AZURE}, ND H200 v5, CUDA 12.8 run (PCIe Gen5 x16)"),
    "B200": (51.0, f"borrowed from H100-SXM ({_AZURE}): HGX B200's PCIe Gen5 x16 host links"),
    "GB200": (201.0, f"{_AZURE}, ND GB200 v6 (NVLink-C2C to Grace)"),
    "MI300X": (55.0, "Azure AI benchmarking guide, TransferBench host to device, ND MI300X v5 (PCIe Gen5 x16)"),
    "MI325X": (55.0, "borrowed from MI300X (Azure AI benchmarking guide, TransferBench): the same OAM platform, "
                     "PCIe Gen5 x16"),
}


def host_to_device_GBps(gpu_name: str) -> float:
    """The measured (or borrowed) host-to-device rate of ``gpu_name``, 10^9 B/s."""
    if gpu_name not in HOST_TO_DEVICE_GBPS:
        raise UserError("kv-offloading-size", f"no measured host-to-device rate for {gpu_name} (known: "
                                              f"{', '.join(sorted(HOST_TO_DEVICE_GBPS))}): offload is not modelled there")
    return HOST_TO_DEVICE_GBPS[gpu_name][0]

