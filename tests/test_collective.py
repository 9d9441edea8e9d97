"""``stage-cosim collective``: nccl-tests' figures (size, time, algbw, busbw) from the calibrated
network model, its algorithm choice (ring, tree, NVLS), and the check against nccl-tests rows."""

from __future__ import annotations

import json

import pytest

from stage_cosim.adapters.roofline import collectives as co
from stage_cosim.adapters.roofline.network import CalibratedNetwork
from stage_cosim.errors import UserError
from stage_cosim.hardware import get_gpu, resolve_cluster

GiB = 1 << 30


def _zero_latency(tmp_path, gpus: int = 16, up: float = 450, out: float = 50) -> tuple[str, float, float]:
    """A cluster file of H100s with no latency anywhere: (path, scale-up and scale-out B/s as
    the model achieves them: link x efficiency)."""
    path = tmp_path / "zero.yaml"
    path.write_text(f"name: zero\ngpu: H100-SXM\nnum_gpus: {gpus}\n"
                    f"scale_up: {{gpus_per_domain: 8, bandwidth_GBps: {up}, latency_ns: 0}}\n"
                    f"scale_out: {{bandwidth_GBps: {out}, latency_ns: 0}}\n")
    g = get_gpu("H100-SXM")
    return str(path), up * 1e9 * g.scale_up_efficiency, out * 1e9 * g.scale_out_efficiency


def _json(run_cli, *args: str) -> dict:
    code, out, err = run_cli("collective", *args, "--json")
    assert code == 0, err
    return json.loads(out)


# -- nccl-tests' definitions on hand-worked cases ---------------------------------------------------

def test_bus_factors_are_nccl_tests() -> None:
    assert co.bus_factor("all-reduce", 8) == 2 * 7 / 8
    for op in ("all-gather", "reduce-scatter", "all-to-all"):
        assert co.bus_factor(op, 8) == 7 / 8
    assert co.bus_factor("broadcast", 8) == 1
    # the model's sizes: an all-gather's shard, every other collective's per-rank buffer
    assert co.model_bytes("all-gather", GiB, 8) == GiB / 8
    assert co.model_bytes("reduce-scatter", GiB, 8) == GiB


@pytest.mark.parametrize("op", list(co.OPS))
def test_a_ring_with_no_latency_runs_at_the_link_rate_times_efficiency(run_cli, tmp_path, op) -> None:
    """8 GPUs of one domain, link B, efficiency e, no latency. Ring all-reduce: 2·7 steps of S/8
    at B·e, so algbw = S/t = B·e·8/14 and busbw = algbw·2·7/8 = B·e exactly; all-gather and
    reduce-scatter: 7 steps of S/8, busbw = algbw·7/8 = B·e; all-to-all: 7 peers' S/8 each,
    the same; broadcast: the chain's whole buffer once, busbw = algbw = B·e."""
    path, bw, _ = _zero_latency(tmp_path)
    algorithm = "auto" if op == "all-to-all" else "ring"
    report = _json(run_cli, "--cluster", path, "--op", op, "--gpus", "8", "--bytes", "1G,3M",
                   "--algorithm", algorithm)
    for r in report["results"]:
        assert r["busbw_GBps"] == pytest.approx(bw / 1e9, rel=1e-12)
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9, rel=1e-12)
        assert r["algorithm"] == ("p2p" if op == "all-to-all" else "ring")


def test_tree_and_nvls_with_no_latency(run_cli, tmp_path) -> None:
    """Tree: 2·S at B·e, so busbw = (2·7/8)·S / (2·S/(B·e)) = 7/8·B·e. NVLS: each link carries
    (1 + 1/8)·S each way at the switch's reduction rate, NVLS_EFFICIENCY of the link's data-sheet
    rate L (not the ring's achieved one), so busbw = (2·7/8) / (9/8)·L·0.684 = 14/9·L·0.684 on
    Hopper: 478.8 GB/s at 450 GB/s, nccl-tests' 478.87 on 8 H100s."""
    path, bw, _ = _zero_latency(tmp_path)
    tree = _json(run_cli, "--cluster", path, "--op", "all-reduce", "--gpus", "8", "--bytes", "1G", "--algorithm", "tree")
    assert tree["results"][0]["busbw_GBps"] == pytest.approx(7 / 8 * bw / 1e9, rel=1e-12)
    nvls = _json(run_cli, "--cluster", path, "--op", "all-reduce", "--gpus", "8", "--bytes", "1G", "--algorithm", "nvls")
    assert nvls["results"][0]["busbw_GBps"] == pytest.approx(14 / 9 * 450e9 * 0.684 / 1e9, rel=1e-12)
    assert nvls["results"][0]["busbw_GBps"] == pytest.approx(478.87, rel=1e-3)
    assert nvls["results"][0]["algorithm"] == "nvls"


def test_across_domains_the_ring_is_hierarchical(run_cli, tmp_path) -> None:
    """16 GPUs in 2 domains of 8, no latency: reduce-scatter inside (7 steps of S/8 at the
    NVLink rate), all-reduce of S/8 across the 2 domains (2 steps of S/16 at the NIC rate),
    all-gather inside."""
    path, up, out = _zero_latency(tmp_path)
    S = GiB
    report = _json(run_cli, "--cluster", path, "--op", "all-reduce", "--gpus", "16", "--bytes", "1G",
                   "--algorithm", "ring")
    assert (report["domains"], report["gpus_per_domain"]) == (2, 8)
    t = 2 * 7 * S / 8 / up + 2 * 1 * (S / 8 / 2) / out
    assert report["results"][0]["time_s"] == pytest.approx(t, rel=1e-12)
    assert report["results"][0]["busbw_GBps"] == pytest.approx(S / t * 2 * 15 / 16 / 1e9, rel=1e-12)
    # broadcast: a chain through both domains at its slower link, the NIC
    b = _json(run_cli, "--cluster", path, "--op", "broadcast", "--gpus", "16", "--bytes", "1G")
    assert b["results"][0]["busbw_GBps"] == pytest.approx(out / 1e9, rel=1e-12)


def test_auto_is_the_faster_of_ring_and_tree_and_says_which() -> None:
    """auto takes the fastest (what simulate uses) and reports the algorithm it took: on Ampere
    (no NVLS) a tree for small sizes (log-depth latency), a ring for large ones; on Hopper NVLS
    where it beats both."""
    h100 = resolve_cluster("dgx-h100:8")
    by = {a: co.nccl_tests(h100, "all-reduce", 8, [8, 1 << 20, GiB], a)["results"] for a in ("auto", "ring", "tree", "nvls")}
    for i, r in enumerate(by["auto"]):
        fastest = min(("ring", "tree", "nvls"), key=lambda a: by[a][i]["time_s"])
        assert (r["time_s"], r["algorithm"]) == (by[fastest][i]["time_s"], fastest)
    assert by["auto"][2]["algorithm"] == "nvls"
    cluster = resolve_cluster("dgx-a100:8")
    report = {a: co.nccl_tests(cluster, "all-reduce", 8, [8, 1 << 20, GiB], a) for a in ("auto", "ring", "tree")}
    auto = report["auto"]["results"]
    assert [r["algorithm"] for r in auto] == ["tree", "tree", "ring"]
    for i, r in enumerate(auto):
        assert r["time_s"] == min(report["ring"]["results"][i]["time_s"], report["tree"]["results"][i]["time_s"])
    net = CalibratedNetwork(cluster)
    assert net.algorithm == "auto"          # what simulate builds (on A100: no NVLS)
    assert net.duration("ALL_REDUCE", GiB, list(range(8))) == auto[2]["time_s"]


def test_the_networks_nvls_falls_back_where_it_cannot_run() -> None:
    """As NCCL does with NCCL_ALGO=NVLS: an all-reduce NVLS cannot run (Ampere, several domains)
    takes the auto rule; where it can, NVLS is faster for large buffers on 8 GPUs."""
    a100 = resolve_cluster("dgx-a100:8")
    assert CalibratedNetwork(a100, algorithm="nvls").timed("ALL_REDUCE", GiB, list(range(8))) == \
        CalibratedNetwork(a100).timed("ALL_REDUCE", GiB, list(range(8)))
    h100 = resolve_cluster("dgx-h100:16")
    nvls = CalibratedNetwork(h100, algorithm="nvls")
    assert nvls.timed("ALL_REDUCE", GiB, list(range(16)))[1] == "ring"
    t, name = nvls.timed("ALL_REDUCE", GiB, list(range(8)))
    assert name == "nvls" and t < CalibratedNetwork(h100, algorithm="ring").duration("ALL_REDUCE", GiB, list(range(8)))
    with pytest.raises(ValueError, match="algorithm"):
        CalibratedNetwork(h100, algorithm="nvlstree")


def test_eight_h100_all_reduce_of_1_GiB(run_cli) -> None:
    report = _json(run_cli, "--cluster", "dgx-h100", "--op", "all-reduce", "--gpus", "8", "--bytes", "1G")
    r = report["results"][0]
    assert r["bytes"] == GiB and r["algorithm"] == "nvls"       # NCCL's default on 8 H100 at 1 GiB
    assert 300 < r["busbw_GBps"] < 500
    # the DGX H100 row nccl-tests measured (Azure ND H100 v5, NVLS, 1 GiB): 466.35 GB/s
    assert r["busbw_GBps"] == pytest.approx(466.35, rel=0.15)


# -- the output ------------------------------------------------------------------------------------

def test_json_shape(run_cli) -> None:
    report = _json(run_cli, "--cluster", "dgx-h100:16", "--op", "all_gather", "--gpus", "16", "--bytes", "8,1M,1G")
    assert {"cluster", "op", "gpus", "algorithm", "results"} <= set(report)
    assert (report["cluster"], report["op"], report["gpus"], report["algorithm"]) == \
        ("dgx-h100", "all-gather", 16, "auto")
    assert [r["bytes"] for r in report["results"]] == [8, 1 << 20, GiB]
    for r in report["results"]:
        assert set(r) == {"bytes", "time_s", "algbw_GBps", "busbw_GBps", "algorithm"}
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 15 / 16)


def test_text_table(run_cli) -> None:
    code, out, _ = run_cli("collective", "--cluster", "dgx-b200", "--op", "reduce-scatter", "--bytes", "64K,8G")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("# reduce-scatter on 8 B200 GPUs of dgx-b200")
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert [r[0] for r in rows] == ["65536", "8589934592"] and all(r[-1] == "ring" for r in rows)


def test_a_bare_preset_grows_to_the_gpus_it_needs(run_cli) -> None:
    report = _json(run_cli, "--cluster", "dgx-h100", "--op", "all-reduce", "--gpus", "32", "--bytes", "1G")
    assert (report["gpus"], report["domains"], report["gpus_per_domain"]) == (32, 4, 8)
    # a GB200 rack: any number of GPUs of its one domain
    report = _json(run_cli, "--cluster", "gb200-nvl72", "--op", "all-reduce", "--gpus", "6", "--bytes", "1G",
                   "--algorithm", "nvls")
    assert (report["domains"], report["results"][0]["algorithm"]) == (1, "nvls")


# -- sizes --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, sizes", [
    ("8,1M,1G", [8, 1 << 20, 1 << 30]),
    ("64k", [65536]),
    (" 1024 , 2K ", [1024, 2048]),
    ("8G", [8 << 30]),
])
def test_sizes_are_integers_or_powers_of_two(text, sizes) -> None:
    assert co.parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["", "1M,", "1.5G", "1T", "-8", "0", "abc", "1 M B", "2048P"])
def test_bad_sizes_are_refused(text) -> None:
    with pytest.raises(UserError) as exc:
        co.parse_sizes(text)
    assert exc.value.parameter == "bytes"


def test_size_format_round_trips() -> None:
    assert [co.format_size(s) for s in (8, 1536, 1 << 20, 3 << 30)] == ["8", "1536", "1M", "3G"]


# -- bad input: one line naming the parameter, exit 2 --------------------------------------------------

BASE = ["--cluster", "dgx-h100:16", "--bytes", "1M"]


@pytest.mark.parametrize("args, param", [
    (["--cluster", "dgx-h100", "--op", "all-shuffle", "--bytes", "1M"], "op:"),
    ([*BASE, "--op", "all-reduce", "--gpus", "0"], "gpus:"),
    ([*BASE, "--op", "all-reduce", "--gpus", "1"], "gpus:"),
    ([*BASE, "--op", "all-reduce", "--gpus", "32"], "gpus:"),
    ([*BASE, "--op", "all-reduce", "--gpus", "12"], "gpus:"),
    ([*BASE, "--op", "all-reduce", "--gpus", "abc"], "gpus:"),
    (["--cluster", "dgx-h100", "--op", "all-reduce", "--gpus", str(1 << 21), "--bytes", "1M"], "gpus:"),
    (["--cluster", "dgx-h100", "--op", "all-reduce", "--bytes", "1X"], "bytes:"),
    (["--cluster", "dgx-h100", "--op", "all-reduce", "--bytes", "1M", "--algorithm", "collnet"], "algorithm:"),
    (["--cluster", "dgx-a100", "--op", "all-reduce", "--bytes", "1M", "--algorithm", "nvls"], "algorithm:"),
    ([*BASE, "--op", "all-reduce", "--algorithm", "nvls"], "algorithm:"),
    ([*BASE, "--op", "all-gather", "--algorithm", "tree"], "algorithm:"),
    ([*BASE, "--op", "all-to-all", "--algorithm", "ring"], "algorithm:"),
    (["--cluster", "dgx-h100", "--bytes", "1M"], "op:"),
    (["--op", "all-reduce", "--bytes", "1M"], "cluster:"),
    (["--cluster", "dgx-h100", "--op", "all-reduce"], "bytes:"),
    (["--cluster", "dgx-z100", "--op", "all-reduce", "--bytes", "1M"], "cluster:"),
    (["--validate", "--cluster", "dgx-h100"], "validate:"),
])
def test_bad_input_is_one_line(run_cli, args, param) -> None:
    code, out, err = run_cli("collective", *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {param}"), err


def test_nvls_refusals_say_why(run_cli) -> None:
    _, _, err = run_cli("collective", "--cluster", "dgx-a100", "--op", "all-reduce", "--bytes", "1M", "--algorithm", "nvls")
    assert "ampere" in err and "NVLink SHARP" in err
    _, _, err = run_cli("collective", *BASE, "--op", "all-reduce", "--algorithm", "nvls")
    assert "span 2 NVLink domains" in err


# -- the check against nccl-tests' rows ----------------------------------------------------------------

def test_validation_accounts_for_every_row(run_cli) -> None:
    report = _json(run_cli, "--validate")
    assert report["total"] == len(report["rows"]) > 300
    assert report["expressed"] + sum(report["not_expressed"].values()) == report["total"]
    done = [r for r in report["rows"] if not r["reason"]]
    assert len(done) == report["expressed"] > 100
    assert all(r["predicted_GBps"] > 0 and r["measured_GBps"] > 0 for r in done)
    assert {r["algorithm"] for r in done} == {"auto", "ring", "nvls"}
    # every system/algorithm group of expressed rows is summarized, its rows counted once
    assert sum(s["rows"] for s in report["summary"]) == report["expressed"]
    # the rows the model cannot run say why
    assert any("cloud network" in why for why in report["not_expressed"])
    assert any("no cluster preset" in why for why in report["not_expressed"])
    # the 8-GPU H100 NVLS row of 1 GiB, run as nvls on dgx-h100
    h100 = [r for r in done if r["gpu"] == "H100-SXM5-80GB" and r["bytes"] == GiB and r["label"] == "NVLS"]
    assert len(h100) == 1 and h100[0]["ran"] == "nvls" and h100[0]["cluster"] == "dgx-h100:8"


def test_validation_text(run_cli) -> None:
    code, out, _ = run_cli("collective", "--validate")
    assert code == 0
    assert "mean absolute error per system and algorithm" in out and "not expressed, by reason" in out


def test_validation_runs_the_algorithm_each_row_names() -> None:
    """A100 rows labelled NVLS ran NCCL's fallback (Ampere has no NVLS): auto. The H200 sweep's
    NCCL default was a ring up to 1 MiB and NVLS from 2 MiB (the author's NCCL_DEBUG). An NVLS
    default on B200 that does not say which algorithm it chose is not expressed."""
    from stage_cosim.validation.components import busbw_checks

    checks = busbw_checks()
    a100 = [c for c in checks if "as labelled" in c.label and c.gpu == "A100-SXM4-80GB" and not c.reason]
    assert a100 and {c.algorithm for c in a100} == {"auto"}
    h200 = {c.bytes: c for c in checks if "RING/LL up to 1MiB" in c.label}
    assert (h200[1 << 20].algorithm, h200[2 << 20].algorithm) == ("ring", "nvls")
    b200 = [c for c in checks if c.label.startswith("NCCL default") and c.gpu == "B200" and c.nodes == 1]
    assert b200 and all("does not say which algorithm" in c.reason for c in b200)
