"""KV offload: the prefix cache's second tier in host memory, against hand-worked cases."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from stage_cosim import api
from stage_cosim.errors import UserError
from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference import InferenceConfig
from stage_cosim.inference.config import BatchShape, Sequence
from stage_cosim.parallel import ParallelConfig
from stage_cosim.serving.config import SLO, ServingConfig
from stage_cosim.serving.engine import Cluster
from stage_cosim.serving.prefix import HostTier
from stage_cosim.serving.requests import Requests
from stage_cosim.serving.run import _windows, deploy, simulate_serving

GiB = 1 << 30
H100_H2D_GBPS = 51.0     # nvbandwidth host_to_device on Azure ND H100 v5, as the guide publishes it


@pytest.fixture(scope="module")
def llama():
    from stage_cosim.model import resolve_model

    return resolve_model("llama3-8b").with_overrides(layers=4)


def _deployment(llama, gpu_blocks=None, host_blocks=0, cluster="dgx-h100", **serving):
    """One GPU; with ``gpu_blocks`` a KV cache of that many 16-token blocks, and a host tier of
    ``host_blocks`` (its size given in GiB, as the flag takes it)."""
    probe = deploy(llama, ParallelConfig(), InferenceConfig("decode"), resolve_cluster(cluster, 1),
                   ServingConfig(step_resolution=0.0, enable_prefix_caching=True))
    block = probe.kind.kv.usage_of(16)
    dep = deploy(llama, ParallelConfig(), InferenceConfig("decode"), resolve_cluster(cluster, 1),
                 ServingConfig(step_resolution=0.0, enable_prefix_caching=True,
                               kv_offloading_size=host_blocks * block / GiB, **serving), kind=None)
    if gpu_blocks is not None:
        dep.kind.kv = replace(dep.kind.kv, capacity_bytes=dep.kind.kv.usage_of(gpu_blocks * 16))
    return dep, block


def _run(dep, reqs):
    return Cluster(dep.pools, dep.serving, dep.cluster, _windows(dep.model)).run(reqs)


def _apart(inputs, ids, gap=10.0) -> Requests:
    n = len(inputs)
    return Requests(np.arange(n) * gap, np.asarray(inputs), np.ones(n, dtype=int), tuple(ids), 512)


# A (600 tokens, id 1) leaves its 32 prefix blocks cached on a GPU of 50 blocks; B (700 tokens,
# id 2) needs 44, so 26 of A's are evicted, tail first (A's blocks 31 down to 6); C (600, id 1)
# then finds A's blocks 0-5 on the GPU and, with offload, 6-31 in host memory.
STREAM = ([600, 700, 600], [(1,), (2,), (1,)])


def test_a_prefix_evicted_to_host_is_loaded_back(llama) -> None:
    """With room for 40 blocks in host memory, C hits all 32 blocks of its id (512 tokens), 26
    of them loaded back: its first token is one prefill of its 88 new tokens over 512 cached,
    plus 26 blocks' bytes at the H100's measured host-to-device rate."""
    dep, block = _deployment(llama, gpu_blocks=50, host_blocks=40)
    assert dep.kind.kv.host_to_device_GBps == H100_H2D_GBPS
    assert dep.kind.kv.host_bytes == pytest.approx(40 * block)
    log, trace = _run(dep, _apart(*STREAM))
    assert log.cached_tokens == [0, 0, 512]
    assert trace.offload_hit_tokens == 26 * 16
    assert trace.offload_loaded_blocks == 26
    load = 26 * block / (H100_H2D_GBPS * 1e9)
    assert trace.offload_load_s == load
    step = dep.kind.timer(BatchShape.of([Sequence(88, 512)], frozenset(llama.layer_windows())))
    assert log.first_token[2] - log.arrival[2] == pytest.approx(step + load, rel=1e-12)
    # B's eviction stored 26 blocks; C's loads (26 blocks) and its 6 new ones evicted 20 of B's
    # 32 from a GPU holding 6 + 32 free cached blocks: 46 stored, as many as the GPU evicted
    assert trace.offload_stored_blocks == trace.prefix_evicted_blocks == 26 + 20


def test_without_offload_the_prefix_is_prefilled_again(llama) -> None:
    dep, _ = _deployment(llama, gpu_blocks=50)
    log, trace = _run(dep, _apart(*STREAM))
    assert log.cached_tokens == [0, 0, 96]
    assert trace.offload_loaded_blocks == 0 and trace.offload_load_s == 0.0
    step = dep.kind.timer(BatchShape.of([Sequence(504, 96)], frozenset(llama.layer_windows())))
    assert log.first_token[2] - log.arrival[2] == pytest.approx(step, rel=1e-12)


def test_a_small_host_tier_keeps_the_last_evicted(llama) -> None:
    """Room for 10 blocks: of the 26 evicted (31 down to 6) the last 10 stay, blocks 15 down to
    6, so C hits blocks 0-5 on the GPU and 6-15 from host memory (256 tokens) and stops at 16."""
    dep, block = _deployment(llama, gpu_blocks=50, host_blocks=10)
    log, trace = _run(dep, _apart(*STREAM))
    assert log.cached_tokens == [0, 0, 256]
    assert trace.offload_loaded_blocks == 10
    assert trace.offload_load_s == 10 * block / (H100_H2D_GBPS * 1e9)


def test_host_tier_is_least_recently_used() -> None:
    tier = HostTier(2)
    for k in (1, 2, 1, 3):           # 1 again refreshes it: 2 is the oldest when 3 comes
        tier.put(k)
    assert list(tier.blocks) == [1, 3] and tier.dropped == 1
    assert tier.match([1, 3, 4], 0, 3, {}) == 2 and tier.match([1, 3], 0, 2, {3: 1}) == 1


def test_zero_is_no_offload_bit_identically(llama) -> None:
    stream = Requests(np.sort(np.random.default_rng(3).uniform(0, 20, 200)), np.full(200, 900),
                      np.full(200, 30), tuple((int(g), 100 + i) for i, g in enumerate(np.arange(200) % 7)), 512)
    a, _ = _deployment(llama, gpu_blocks=400)
    b, _ = _deployment(llama, gpu_blocks=400, host_blocks=0)
    assert b.serving.kv_offloading_size == 0
    one = simulate_serving(a, stream, SLO())
    two = simulate_serving(b, stream, SLO())
    assert json.dumps(one, sort_keys=True) == json.dumps(two, sort_keys=True)
    # and a tier the GPU never evicts into changes no time either
    c, _ = _deployment(llama, host_blocks=1000)
    d, _ = _deployment(llama)
    three, four = simulate_serving(c, stream, SLO()), simulate_serving(d, stream, SLO())
    assert three["prefix_cache"]["evicted_blocks"] == 0
    assert three["latency_s"] == four["latency_s"] and three["kv_offload"]["stored_blocks"] == 0


@pytest.mark.parametrize("kw,message", [
    ({"kv_offloading_size": -1.0}, "kv-offloading-size"),
    ({"kv_offloading_size": float("nan")}, "kv-offloading-size"),
    ({"kv_offloading_size": True}, "kv-offloading-size"),
])
def test_bad_sizes(kw, message) -> None:
    with pytest.raises(UserError, match=message):
        ServingConfig(enable_prefix_caching=True, **kw)


def test_offload_needs_prefix_caching() -> None:
    with pytest.raises(UserError, match="kv-offloading-size.*prefix-caching"):
        ServingConfig(kv_offloading_size=4.0)


def test_a_gpu_without_a_measured_host_link_refuses(llama) -> None:
    with pytest.raises(UserError, match="kv-offloading-size.*L40S"):
        deploy(llama, ParallelConfig(), InferenceConfig("decode"), resolve_cluster("l40s-pcie-8", 1),
               ServingConfig(enable_prefix_caching=True, kv_offloading_size=4.0))


def test_cli(run_cli) -> None:
    base = ("serve-sim", "--model", "llama3-8b", "--layers", "4", "--rate", "5", "--num-requests", "20")
    code, out, err = run_cli(*base, "--kv-offloading-size", "-2", "--enable-prefix-caching")
    assert code == 2 and err.startswith("error: ") and "kv-offloading-size" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(*base, "--kv-offloading-size", "8")
    assert code == 2 and "prefix-caching" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(*base, "--prefix-len", "512", "--enable-prefix-caching", "--kv-offloading-size", "8")
    assert code == 0, err
    assert "KV offload" in out and "51 GB/s" in out
    code, out, err = run_cli(*base, "--prefix-len", "512", "--enable-prefix-caching", "--kv-offloading-size", "8",
                             "--json")
    doc = json.loads(out)
    assert doc["serving"]["kv_offloading_size"] == 8 and doc["deployment"]["instance"]["host_to_device_GBps"] == 51.0
    assert api.serve_sim({"model": "llama3-8b", "layers": 4, "rate": 5, "num_requests": 5, "prefix_len": 512,
                          "enable_prefix_caching": True, "kv_offloading_size": 8})["kv_offload"]["load_time_s"] >= 0
