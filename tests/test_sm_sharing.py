"""SM sharing between collectives and compute: a compute kernel runs at the share of its rank's
SMs the running collectives leave, in the node-level replay and the fast path alike."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from stage_cosim.adapters.roofline.comm_sms import NVLS_CHANNELS, CommSMs, channels, comm_sms
from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.roofline.engine import AgentProgram, replay
from stage_cosim.adapters.roofline import fast as fast_module
from stage_cosim.adapters.roofline.fast import simulate_fast
from stage_cosim.adapters.roofline.breakdown import step_breakdown
from stage_cosim.adapters.roofline.fast_tail import NotAlone, TailState
from stage_cosim.adapters.roofline.network import CalibratedNetwork
from stage_cosim.adapters.roofline.routing import TokenRouting
from stage_cosim.adapters.roofline.simulate import _programs, make_network, simulate
from stage_cosim.hardware import get_gpu, resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.parallel import ParallelConfig
from stage_cosim.workload import synthesize


class _Fixed:
    """A network whose every collective takes ``c`` seconds from its last member's issue."""

    name = "fixed"

    def __init__(self, c: float) -> None:
        self.c = c

    def stream(self, node_type, kind):
        return None if node_type == "RECV" else f"comm:{kind}"

    def collective(self, coll, nbytes, members, starts, kind=""):
        return [max(starts) + self.c] * len(members)

    def p2p(self, src, dst, nbytes):
        return 0.0, 0.0


@dataclass(frozen=True)
class _Share:
    f: float
    ceiling: float = 0.99

    def fraction(self, coll, nbytes, members, kind=""):
        return self.f


def _gemm_and_allreduce(gemm_s: float, comm_at: float) -> AgentProgram:
    """One GEMM from time 0; an all-reduce (of a group of two) issued at ``comm_at`` (a WAIT
    node holds it back) on its own stream."""
    return AgentProgram("a", 0, [0, 1, 2], ["COMP", "WAIT", "COLL"], [[], [], [1]], [gemm_s, comm_at, 0.0],
                        ["", "", "dp"], [None, None, "ALL_REDUCE"], [0, 0, 64 << 20], [-1] * 3, [0] * 3,
                        [None, None, "g"], [None, None, (0, 1)], streams=["compute", "wait", "comm:dp"])


def _finish(d: float, t1: float, c: float, f: float) -> float:
    """Closed form: a kernel of ``d`` seconds alone, with a collective over [t1, t1 + c] that
    leaves it 1 - f of the SMs."""
    if d <= t1:
        return d
    if d - t1 <= c * (1 - f):          # done while the collective still runs
        return t1 + (d - t1) / (1 - f)
    return d + c * f                   # the collective ends first: it cost c·f of the kernel's time


@pytest.mark.parametrize("d,t1,c,f", [
    (1.0, 0.25, 0.5, 0.25),            # the collective ends mid-kernel: 1 + 0.125
    (1.0, 0.5, 2.0, 0.2),              # the kernel ends under the collective: 0.5 + 0.5 / 0.8
    (1.0, 0.0, 0.3, 0.5),              # both start together
    (1.0, 2.0, 1.0, 0.5),              # no overlap
])
def test_gemm_under_one_allreduce_closed_form(d, t1, c, f) -> None:
    rep = replay([_gemm_and_allreduce(d, t1)], _Fixed(c), {"g": 1}, lambda r: 0, _Share(f))
    assert rep.end[0][0] == pytest.approx(_finish(d, t1, c, f), rel=1e-12)
    assert rep.end[0][2] == pytest.approx(t1 + c, rel=1e-12)       # the collective is not slowed


def test_off_changes_nothing() -> None:
    rep = replay([_gemm_and_allreduce(1.0, 0.25)], _Fixed(0.5), {"g": 1}, lambda r: 0)
    assert rep.end[0][0] == 1.0
    assert not ComputeModel(get_gpu("H100-SXM")).comm_sm_sharing


def test_h100_nvls_allreduce_takes_its_channels() -> None:
    """An all-reduce of 64 MiB over one DGX H100's 8 GPUs runs as NVLS (16 CTAs of 132 SMs):
    a GEMM of 1 ms starting with it finishes as the closed form says."""
    cluster = resolve_cluster("dgx-h100", 8)
    net = CalibratedNetwork(cluster)
    share = CommSMs(cluster.gpu, net)
    members = tuple(range(8))
    assert net.timed("ALL_REDUCE", 64 << 20, members)[1] == "nvls"
    f = share.fraction("ALL_REDUCE", 64 << 20, members)
    assert f == NVLS_CHANNELS / 132
    prog = _gemm_and_allreduce(1e-3, 0.0)
    prog.members[2] = members
    rep = replay([prog], net, {"g": 1}, lambda r: 0, share)
    c = net.duration("ALL_REDUCE", 64 << 20, members)
    assert rep.end[0][0] == pytest.approx(_finish(1e-3, 0.0, c, f), rel=1e-12)


def test_channels_follow_nccl_size_rule() -> None:
    # Simple protocol: one channel per 512 threads x 64 B = 32 KiB, up to the ring's channels
    assert channels("ALL_REDUCE", 64 << 20, 8, "ring", "hopper") == 32
    assert channels("ALL_REDUCE", 96 << 10, 8, "ring", "hopper") == 3
    assert channels("ALL_REDUCE", 1000, 8, "tree", "hopper") == 1
    assert channels("ALL_GATHER", 8 << 10, 8, "ring", "ampere") == 2       # the output: 64 KiB
    assert channels("ALL_REDUCE", 1 << 30, 8, "ring", "ampere") == 24
    assert channels("ALL_REDUCE", 1 << 10, 8, "nvls", "hopper") == NVLS_CHANNELS
    assert channels("ALL_REDUCE", 1 << 30, 1, "ring", "hopper") == 0


def test_the_collectives_never_take_every_sm() -> None:
    rep = replay([_gemm_and_allreduce(1.0, 0.0)], _Fixed(1.0), {"g": 1}, lambda r: 0, _Share(1.5, 0.75))
    assert rep.end[0][0] == pytest.approx(1.0 + 0.75, rel=1e-12)   # a quarter of the rate for 1 s


# -- the fast path equals the node-level replay ------------------------------------------------

SHARED = [   # (model, layout, whether the fast path charges the breakdown as the replay does)
    ("llama3-8b", dict(dp=4, tp=2, pp=1, global_batch=16, seq_len=1024, sp=True, zero=1), True),
    ("llama3-8b", dict(dp=2, tp=2, pp=2, global_batch=8, seq_len=1024, sp=True, tp_comm_overlap=True, zero=1),
     True),
    ("llama3-8b", dict(dp=2, tp=2, pp=2, vp=2, global_batch=8, seq_len=1024, sp=True, zero=1,
                       overlap_param_gather=True), True),
    ("gpt3-175b", dict(dp=2, tp=2, pp=2, global_batch=8, seq_len=512, recompute="full"), True),
    # ZeRO-3: a pass's gradient reduce-scatters (and a last kernel) run on after the pass's sinks,
    # which the fast path's breakdown leaves out, with or without sharing
    ("llama3-8b", dict(dp=4, tp=2, pp=1, global_batch=8, seq_len=1024, zero=3), False),
]


def _node_level(w, net, compute):
    """The reference: the simulator's node-level replay of one rank per stage, with sharing."""
    programs, participants, agent_of_rank = _programs(w, compute, True)
    rep = replay(programs, net, participants, agent_of_rank, comm_sms(net, compute.gpu))
    step, pp = max(rep.finish), w.parallel.pp
    return rep.finish, [step_breakdown(p, rep, a, step, pp > 1) for a, p in enumerate(programs)]


@pytest.mark.parametrize("name,kw,same_breakdown", SHARED)
def test_fast_path_equals_node_level_replay_with_sharing(name, kw, same_breakdown, monkeypatch) -> None:
    def fell_back(*args):
        raise AssertionError("the fast path fell back to the node-level replay")

    model = get_preset(name).with_overrides(layers=8)
    par = ParallelConfig(**kw)
    w, cluster = synthesize(model, par), resolve_cluster("dgx-h100", par.world_size)
    net = make_network("calibrated", cluster, TokenRouting.of(w.model, w.parallel))
    compute = ComputeModel(cluster.gpu, comm_sm_sharing=True)
    full, full_bd = _node_level(w, net, compute)
    monkeypatch.setattr(fast_module, "exact", fell_back)      # (none of these layouts needs it)
    fast, fast_bd = simulate_fast(w, net, compute)
    assert max(fast) == pytest.approx(max(full), rel=1e-9)
    for s, bd in enumerate(fast_bd):
        assert fast[s] == pytest.approx(full[s], rel=1e-9)
        assert sum(bd.values()) == pytest.approx(max(fast), rel=1e-9)
        if same_breakdown:
            assert bd["compute"] == pytest.approx(full_bd[s]["compute"], rel=1e-9)
    # sharing slows the step (the gradient reductions overlap backward compute), never speeds it
    off, _, _ = simulate(w, cluster)
    assert max(fast) >= off.step_time_s


def test_fast_path_falls_back_to_the_node_level_replay(monkeypatch) -> None:
    """Where something outside a pass overlaps it, the fast path replays every node instead."""
    model = get_preset("llama3-8b").with_overrides(layers=4)
    par = ParallelConfig(dp=2, tp=2, pp=2, global_batch=8, seq_len=1024, sp=True, zero=1)
    w, cluster = synthesize(model, par), resolve_cluster("dgx-h100", par.world_size)
    net = make_network("calibrated", cluster, TokenRouting.of(w.model, w.parallel))
    compute = ComputeModel(cluster.gpu, comm_sm_sharing=True)
    want, want_bd = _node_level(w, net, compute)

    def overlapped(self, *args, **kw):
        raise NotAlone("an overlap")

    monkeypatch.setattr(TailState, "check_start", overlapped)
    got, got_bd = simulate_fast(w, net, compute)
    assert got == pytest.approx(want, rel=1e-12)
    for bd, ref in zip(got_bd, want_bd):
        assert bd == pytest.approx(ref, rel=1e-9, abs=1e-12)
