"""Tiered scale-out networks: the cluster schema (topology, switch_radix, oversubscription per
tier, planes, in_network_reduction), max-min fair sharing of links, and what contention does to
collectives, each against a hand-worked or closed-form figure."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from stage_cosim.adapters.roofline import collectives as co
from stage_cosim.adapters.roofline.contention import Contention, concurrent_groups, flows, max_min_rates
from stage_cosim.adapters.roofline.network import CalibratedNetwork
from stage_cosim.adapters.roofline.topology import Fabric
from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import Cluster, cluster_from, resolve_cluster

GiB = 1 << 30


def _rail_optimized(over: float | list, gpus: int = 1024, topology: str = "rail-optimized") -> Cluster:
    """DGX H100 nodes on a two-tier fat-tree of radix-64 switches, 50 GB/s NICs."""
    return cluster_from({"name": "ro", "gpu": "H100-SXM", "num_gpus": gpus,
                         "scale_up": {"gpus_per_domain": 8, "bandwidth_GBps": 450, "latency_ns": 700},
                         "scale_out": {"bandwidth_GBps": 50, "latency_ns": 2000, "topology": topology,
                                       "switch_radix": 64, "oversubscription": over}})


def _busbw(cluster: Cluster, op: str, gpus: int, algorithm: str = "auto", size: int = GiB) -> float:
    return co.nccl_tests(cluster, op, gpus, [size], algorithm)["results"][0]["busbw_GBps"]


# -- max-min fairness, hand-worked ---------------------------------------------------------------

def test_two_flows_on_one_link_get_half_each() -> None:
    rates = max_min_rates(np.array([0, 1]), np.array([0, 0]), np.array([10.0]), 2)
    assert rates.tolist() == [5.0, 5.0]


def test_a_flow_bottlenecked_elsewhere_leaves_the_rest_to_the_other() -> None:
    # flow 0 crosses link 0 (capacity 1) and link 1 (10); flow 1 crosses link 1 only
    rates = max_min_rates(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([1.0, 10.0]), 2)
    assert rates == pytest.approx([1.0, 9.0])


def test_parking_lot() -> None:
    # flows 0 and 1 share link 0 (capacity 2); flows 0 and 2 share link 1 (capacity 3): flow 0
    # and 1 get 1 each, flow 2 the rest of link 1, 2
    rates = max_min_rates(np.array([0, 0, 1, 2]), np.array([0, 1, 0, 1]), np.array([2.0, 3.0]), 3)
    assert rates == pytest.approx([1.0, 1.0, 2.0])


# -- the fabric: 1,024 H100, rail-optimized, radix-64 leaves, 50 GB/s NICs ------------------

def test_an_oversubscribed_spine_cuts_all_to_all_but_not_the_ring() -> None:
    full, thin = _rail_optimized(1), _rail_optimized(4)
    a2a = _busbw(thin, "all-to-all", 1024) / _busbw(full, "all-to-all", 1024)
    ring = _busbw(thin, "all-reduce", 1024, "ring") / _busbw(full, "all-reduce", 1024, "ring")
    assert a2a <= 0.4 and ring >= 0.8
    # closed form of the slowest all-to-all flow: a rail's leaf has 32 nodes below it and 32 x 50 / 4
    # GB/s above, which its 32 x 96 flows to the other leaves share; on NICs alone a node's
    # flow to each of its 127 peers gets 50 / 127
    slowdown = (32 * 50 / 4 / (32 * 96)) / (50 / 127)
    assert CalibratedNetwork(thin, concurrent=False).contention.slowdown("all-to-all", list(range(1024))) \
        == pytest.approx(slowdown, rel=1e-9)


def test_a_job_under_one_leaf_group_never_pays_for_the_spine() -> None:
    full, thin = _rail_optimized(1), _rail_optimized(16)
    for op in ("all-to-all", "all-reduce", "all-gather"):
        assert _busbw(thin, op, 256) == _busbw(full, op, 256)
    # twice as many nodes, and the job's all-to-all crosses the spine
    assert _busbw(thin, "all-to-all", 512) < _busbw(full, "all-to-all", 512)


def test_a_non_blocking_fabric_is_the_one_switch_model() -> None:
    flat = cluster_from({"name": "flat", "gpu": "H100-SXM", "num_gpus": 1024,
                         "scale_up": {"gpus_per_domain": 8, "bandwidth_GBps": 450, "latency_ns": 700},
                         "scale_out": {"bandwidth_GBps": 50, "latency_ns": 2000}})
    for op in ("all-to-all", "all-reduce", "reduce-scatter"):
        assert _busbw(_rail_optimized(1), op, 1024) == pytest.approx(_busbw(flat, op, 1024), rel=1e-12)


def test_concurrent_groups_share_the_spine() -> None:
    # a group of two nodes in different leaf groups (nodes 0 and 32): alone, one flow per rail
    # leaf crosses the 4:1 spine; with its 63 translates (every node paired with the one 32 on)
    # each rail leaf sends 32 NIC-rate flows up 32 x 50 / 4 GB/s: a quarter of the NIC each
    members = list(range(8)) + list(range(256, 264))
    assert len(concurrent_groups(members, 1024)) == 64
    thin = _rail_optimized(4)
    alone = Contention(Fabric.of(thin), 8, concurrent=False).slowdown("all-to-all", members)
    together = Contention(Fabric.of(thin), 8, concurrent=True).slowdown("all-to-all", members)
    assert alone == 1.0 and together == pytest.approx(0.25)


def test_rail_only_routes_as_rail_optimized_with_pxn() -> None:
    fabric = Fabric.of(_rail_optimized(1))
    # GPU 3 (node 0, rail 3) to GPU 13 (node 1, rail 5): NVLink to node 0's rail-5 GPU first
    assert fabric.pxn(np.array([3]), np.array([13])).tolist() == [5]
    for op in ("all-to-all", "all-reduce"):
        assert _busbw(_rail_optimized(4, topology="rail-only"), op, 1024) == _busbw(_rail_optimized(4), op, 1024)


def test_oversubscription_per_tier() -> None:
    # a three-tier fat-tree of radix-8 switches (4 endpoints per leaf, 16 per pod) under 64 GPUs of
    # one GPU per domain; the pods' uplinks 4:1: a pod's 16 x 48 flows out share 16 x 50 / 4 GB/s,
    # while the leaves (non-blocking: 4 x 50 GB/s for 4 x 60 flows) never limit a flow below
    # its NIC share, 50 / 63
    c = cluster_from({"name": "ft", "gpu": "H100-SXM", "num_gpus": 64,
                      "scale_up": {"gpus_per_domain": 1, "bandwidth_GBps": 450, "latency_ns": 700},
                      "scale_out": {"bandwidth_GBps": 50, "latency_ns": 2000, "topology": "fat-tree",
                                    "switch_radix": 8, "oversubscription": [1, 4]}})
    fabric = Fabric.of(c)
    assert fabric.tiers == 2
    got = Contention(fabric, 1, concurrent=False).slowdown("all-to-all", list(range(64)))
    assert got == pytest.approx((16 * 50 / 4 / (16 * 48)) / (50 / 63), rel=1e-9)


def test_ring_and_tree_flows() -> None:
    # two domains of two members: rings per local index, both ways round
    src, dst = flows("ring", [0, 1, 8, 9], 8)
    assert sorted(zip(src.tolist(), dst.tolist())) == [(0, 8), (1, 9), (8, 0), (9, 1)]
    # NCCL's double binary tree of 4 positions: 1 and 3 under 2, 2 under the root 0; the second
    # tree its mirror image (1 and 3 ... positions 2 and 0 under 1, 1 under 3), in both directions
    src, dst = flows("tree", [0, 8, 16, 24], 8)
    edges = set(zip(src.tolist(), dst.tolist()))
    assert {(8, 16), (16, 0), (24, 16)} <= edges and {(16, 8), (8, 24), (0, 8)} <= edges


# -- in-network reduction (CollNet) --------------------------------------------------------------

def test_collnet_halves_the_scale_out_step_of_a_large_all_reduce() -> None:
    racks = resolve_cluster("gb200-nvl72-racks:288")
    net = CalibratedNetwork(racks)
    members = list(range(288))
    t_c, name = net.timed("ALL_REDUCE", GiB, members, "collnet")
    t_r, _ = net.timed("ALL_REDUCE", GiB, members, "ring")
    assert name == "collnet" and net.timed("ALL_REDUCE", GiB, members)[1] == "collnet"
    # the inter-domain step: 1/72 of a GiB per rank; ring 2 * 3/4 of it, collnet once
    share = GiB / 72 / net.bw_out
    assert t_r - t_c == pytest.approx(2 * 3 / 4 * share + 6 * net.lat_out - share - 2 * net.lat_out, rel=1e-9)
    with pytest.raises(UserError, match="collnet"):
        co.nccl_tests(resolve_cluster("dgx-h100:16"), "all-reduce", 16, [GiB], "collnet")


# -- the schema --------------------------------------------------------------------------------

@pytest.mark.parametrize("scale_out, parameter", [
    ({"topology": "torus"}, "cluster.scale_out.topology"),
    ({"oversubscription": [2, 1]}, "cluster.scale_out.oversubscription"),         # a list needs tiers
    ({"topology": "fat-tree", "oversubscription": [1, 0.5]}, "cluster.scale_out.oversubscription"),
    ({"topology": "fat-tree", "switch_radix": 63}, "cluster.scale_out.switch_radix"),
    ({"topology": "fat-tree", "planes": 0}, "cluster.scale_out.planes"),
    ({"topology": "fat-tree", "in_network_reduction": "yes"}, "cluster.scale_out.in_network_reduction"),
])
def test_bad_topology_input_names_the_key(scale_out, parameter) -> None:
    doc = {"name": "bad", "gpu": "H100-SXM", "num_gpus": 16,
           "scale_up": {"gpus_per_domain": 8, "bandwidth_GBps": 450, "latency_ns": 700},
           "scale_out": {"bandwidth_GBps": 50, "latency_ns": 2000, **scale_out}}
    with pytest.raises(UserError) as err:
        cluster_from(doc)
    assert err.value.parameter == parameter


def test_bad_topology_file_is_one_line_and_exit_2(run_cli, tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\ngpu: H100-SXM\nnum_gpus: 16\n"
                    "scale_up: {gpus_per_domain: 8, bandwidth_GBps: 450, latency_ns: 700}\n"
                    "scale_out: {bandwidth_GBps: 50, latency_ns: 2000, topology: fat-tree, switch_radix: 7}\n")
    code, out, err = run_cli("collective", "--cluster", str(path), "--op", "all-reduce", "--bytes", "1M")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: cluster.scale_out.switch_radix:")


def test_astra_sim_export_maps_what_it_can_and_refuses_the_rest() -> None:
    superpod = resolve_cluster("dgx-h100-superpod:64")
    assert [d.topology for d in superpod.network_dims()] == ["Switch", "Switch"]
    assert superpod.network_dims()[1].bandwidth_GBps == resolve_cluster("dgx-h100:64").network_dims()[1].bandwidth_GBps
    for refused in (_rail_optimized(4, gpus=64), resolve_cluster("dgx-h100-rail-only:64"),
                    resolve_cluster("gb200-nvl72-racks:144")):
        with pytest.raises(UserError) as err:
            refused.network_dims()
        assert err.value.parameter == "cluster.scale_out.topology" and "\n" not in str(err.value)
    # the one-switch presets keep their scalar oversubscription as before: NIC / oversubscription
    old = resolve_cluster("dgx-h100:64")
    two = replace(old, scale_out=replace(old.scale_out, oversubscription=2))
    assert two.network_dims()[1].bandwidth_GBps == pytest.approx(old.network_dims()[1].bandwidth_GBps / 2)
