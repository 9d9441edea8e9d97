"""The scale-out network's bill of materials (hardware.fabric) against hand-counted folded Clos
networks, and an explore spec that prices it."""

from __future__ import annotations

import pytest

from stage_cosim.errors import UserError
from stage_cosim.hardware.cluster import cluster_from
from stage_cosim.hardware.fabric import check_prices, cost_per_gpu, count, tiers_for
from stage_cosim.search.explore import cost_range
from stage_cosim.search.explore_spec import spec_from_dict


def _cluster(topology: str, gpus: int = 1024, over: float | list = 1, radix: int = 64, planes: int = 1):
    return cluster_from({"name": "c", "gpu": "H100-SXM", "num_gpus": gpus,
                         "scale_up": {"gpus_per_domain": 8, "bandwidth_GBps": 450, "latency_ns": 700},
                         "scale_out": {"bandwidth_GBps": 50, "latency_ns": 2000, "topology": topology,
                                       "switch_radix": radix, "oversubscription": over, "planes": planes}})


def test_tiers_of_a_folded_clos() -> None:
    # radix 64: one switch takes 64 NICs, two tiers 2 x 32^2 = 2,048, three 65,536
    assert [tiers_for(n, 64) for n in (64, 65, 2048, 2049, 65536)] == [1, 2, 2, 3, 3]


def test_two_tier_fat_tree_by_hand() -> None:
    # 1,024 NICs on 64-port switches: 32 leaves of 32 down / 32 up, 1,024 uplinks on 16 spines of
    # 64 ports down; 1,024 NIC links + 1,024 leaf-to-spine links
    c = count(_cluster("fat-tree"))
    assert c.switches == (32, 16) and c.links == (1024, 1024) and c.optics == (2048, 2048)
    # a 4:1 leaf: 8 uplinks per leaf, 256 in all, on 4 spines
    thin = count(_cluster("fat-tree", over=4))
    assert thin.switches == (32, 4) and thin.links == (1024, 256)
    # rail-optimized with whole leaves per rail (128 nodes per rail, 4 leaves each) counts the same
    assert count(_cluster("rail-optimized")) == c


def test_rail_only_drops_the_spine_where_a_rail_fits_one_switch() -> None:
    # 256 GPUs: 32 nodes, so each of the 8 rails has 32 NICs: one 64-port switch per rail, no
    # spine; the rail-optimized network puts the 32 NICs of a rail on one leaf (32 down, 32 up)
    # and a spine of 256 / 64 = 4 switches over all of them
    only, opt = count(_cluster("rail-only", 256)), count(_cluster("rail-optimized", 256))
    assert only.switches == (8,) and only.links == (256,)
    assert opt.switches == (8, 4) and opt.links == (256, 256)
    prices = {"nic": 1000, "switch_port": 500, "optic": [100, 600], "cable": 10}
    # rail-only: 256 NICs + 8 x 64 ports + 512 optics at 100 + 256 cables
    assert cost_per_gpu(_cluster("rail-only", 256), prices) == pytest.approx(
        (256 * 1000 + 8 * 64 * 500 + 512 * 100 + 256 * 10) / 256)
    assert cost_per_gpu(_cluster("rail-optimized", 256), prices) == pytest.approx(
        (256 * 1000 + 12 * 64 * 500 + 512 * 100 + 512 * 600 + 512 * 10) / 256)


def test_planes_repeat_the_network_but_not_the_nics() -> None:
    one, two = count(_cluster("fat-tree")), count(_cluster("fat-tree", planes=2))
    assert two.nics == one.nics and two.switches == tuple(2 * s for s in one.switches)
    assert two.links == tuple(2 * x for x in one.links)


@pytest.mark.parametrize("prices, parameter", [
    ({"nics": 1}, "network_cost.nics"), ({"nic": -1}, "network_cost.nic"), ({"switch_port": [1, 2]}, "network_cost.switch_port"),
    ({"optic": "cheap"}, "network_cost.optic"), ([], "network_cost"),
])
def test_bad_prices_name_the_key(prices, parameter) -> None:
    with pytest.raises(UserError) as e:
        check_prices(prices)
    assert e.value.parameter == parameter


def test_a_ring_has_no_switches_to_price() -> None:
    with pytest.raises(UserError, match="no switches"):
        count(_cluster("Ring"))


def _spec(**over) -> dict:
    doc = {"model": "llama3-8b", "baseline": "dgx-h100-superpod:256", "global_batch": 256, "seq_len": 4096,
           "variables": {"scale_out.topology": {"values": ["rail-optimized", "rail-only"]},
                         "scale_out.oversubscription": {"values": [1, 4]}},
           "network_cost": {"nic": 1000, "switch_port": 500, "optic": [100, 600], "cable": 10},
           "cost": {"base": 30000}}
    return {**doc, **over}


def test_an_explore_spec_prices_each_design() -> None:
    spec = spec_from_dict(_spec())
    topo = spec.variables[0]
    assert topo.choice and topo.values == ("rail-optimized", "rail-only")
    lo, hi = cost_range(spec)
    # cheapest: rail-only (no spine, whatever the oversubscription); dearest: rail-optimized 1:1
    assert lo == pytest.approx(30000 + cost_per_gpu(_cluster("rail-only", 256), spec.network_cost))
    assert hi == pytest.approx(30000 + cost_per_gpu(_cluster("rail-optimized", 256), spec.network_cost))


@pytest.mark.parametrize("over, parameter", [
    ({"variables": {"scale_out.topology": {"values": ["torus"]}}}, "variables.scale_out.topology.values"),
    ({"variables": {"scale_out.switch_radix": {"min": 32, "max": 128}}}, "variables.scale_out.switch_radix"),
    ({"network_cost": None}, "network_cost"),
    ({"network_cost": {"nic": 1}, "baseline": {"name": "r", "gpu": "H100-SXM", "num_gpus": 16,
      "scale_up": {"gpus_per_domain": 8, "bandwidth_GBps": 450, "latency_ns": 700},
      "scale_out": {"bandwidth_GBps": 50, "latency_ns": 2000, "topology": "Ring"}},
      "variables": {"gpu.hbm_GBps": {"min": 2000, "max": 4000}}}, "scale_out.topology"),
])
def test_bad_network_variables_are_one_line(over, parameter) -> None:
    with pytest.raises(UserError) as e:
        spec_from_dict(_spec(**over))
    assert e.value.parameter == parameter


EXAMPLE = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "explore_network.yaml"


@pytest.mark.slow
def test_explore_compares_network_designs() -> None:
    from stage_cosim.search.explore import apply, explore
    from stage_cosim.search.explore_spec import load_spec

    spec = load_spec(EXAMPLE)
    doc = explore(spec)
    # every candidate's cost is its network's bill at the spec's prices, plus the base
    for c in doc["all"]:
        if c["step_time_s"] is not None:
            expect = 30000 + cost_per_gpu(apply(spec.baseline, c["values"]), spec.network_cost)
            assert c["cost_per_gpu"] == pytest.approx(expect)
    topology = next(d for d in doc["sensitivity"] if d["variable"] == "scale_out.topology")
    assert topology["elasticity"] is None and set(topology["step_time_s"]) == {"rail-only", "fat-tree"}
