"""Context parallelism against closed forms and hand-worked cases.

Megatron-Core's semantics: the sequence is sharded over cp (2*cp chunks, rank i holding chunks i
and 2*cp-1-i); only attention communicates, by the ring of K/V sends (p2p), an all-gather of
K and V, DeepSpeed-Ulysses all-to-alls (a2a) or both (a2a+p2p); weight gradients are reduced
over dp and cp together.
"""

from __future__ import annotations

import os

import pytest

from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.errors import UserError
from stage_cosim.hardware import resolve_cluster
from stage_cosim.model import get_preset
from stage_cosim.parallel import ParallelConfig
from stage_cosim.schedule.nodes import COLL, COMP, RECV, SEND
from stage_cosim.search.optimize import OptimizeSettings, optimize
from stage_cosim.workload import synthesize

MODEL = get_preset("llama3-8b").with_overrides(layers=2)   # h 4096, 32 heads, 8 kv heads, d 128
B, S, G, D, HQ = 1, 8192, 8, 128, 32
BF16 = 2
ATTENTION = ("attention", "attention_grad")
VARIANTS = [dict(cp_comm="p2p"), dict(cp_comm="all-gather"), dict(cp_comm="a2a"),
            dict(cp_comm="a2a+p2p", cp_a2a_size=2)]


def workload(**kw):
    base = dict(seq_len=S, micro_batch=B, global_batch=B)
    return synthesize(MODEL, ParallelConfig(**(base | kw)))


def layer_nodes(w, phase: str | None = None, block: str = "layer0"):
    return [n for n in w.role(0).nodes if n.block == block and n.micro_batch == 0
            and (phase is None or n.phase == phase)]


def attention_flops(w) -> int:
    return sum(n.flops for n in w.role(0).nodes if n.type == COMP and n.category in ATTENTION)


# -- FLOPs ---------------------------------------------------------------------------------------

def matmul_flops_over_distinct_ranks(w) -> int:
    """Every rank's own graph's matmul FLOPs, added rank by rank."""
    per_role = [sum(n.flops for n in role.nodes if n.type == COMP and n.matmul) for role in w.roles]
    return sum(per_role[w.role_of(r)] for r in range(w.world_size))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v["cp_comm"])
@pytest.mark.parametrize("tp", [1, 2])
def test_attention_flops_per_rank_are_the_total_over_cp(variant, tp) -> None:
    whole = attention_flops(workload(tp=tp))
    for cp in (2, 4):
        w = workload(tp=tp, cp=cp, **variant)
        assert attention_flops(w) == pytest.approx(whole / cp, abs=64)
        # summed over every rank, the matmul work is the cp = 1 graph's (nothing is computed twice)
        assert matmul_flops_over_distinct_ranks(w) == pytest.approx(
            matmul_flops_over_distinct_ranks(workload(tp=tp)), rel=1e-12)


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "naive"])
@pytest.mark.parametrize("forward", [True, False], ids=["fwd", "bwd"])
def test_ring_work_summed_over_the_cp_ranks_is_the_whole_attention(balanced, forward) -> None:
    """Rank by rank, the ring's steps (the graph is the last rank's) add up to the cp = 1
    kernel: with contiguous chunks rank i does (i + 1/2) of cp/2 blocks' average, so the sum over
    ranks is still the whole causal triangle."""
    from stage_cosim.sharding.context_parallel import ring_steps

    cp = 4
    phase, kind = ("fwd", "attention") if forward else ("bwd", "attention_grad")
    whole = sum(n.flops for n in layer_nodes(workload(), phase) if n.category == kind)
    share = whole / cp                               # one rank's balanced share
    w = workload(cp=cp, cp_load_balance=balanced)
    graph = [n.flops for n in layer_nodes(w, phase) if n.category == kind]
    ranks = [[float(st.work) * share for st in ring_steps(i, cp, balanced, forward)] for i in range(cp)]
    assert graph == pytest.approx(ranks[-1], rel=1e-12)             # the graph is the last rank's
    totals = [sum(r) for r in ranks]
    # hand-derived: every rank 1 share balanced; (2i + 1)/cp of it with contiguous chunks
    expected = [1.0] * cp if balanced else [(2 * i + 1) / cp for i in range(cp)]
    assert totals == pytest.approx([e * share for e in expected], rel=1e-12)
    assert sum(totals) == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize("variant", [dict(cp_comm="p2p"), dict(cp_comm="all-gather")], ids=lambda v: v["cp_comm"])
def test_without_load_balance_the_last_rank_sets_the_attention_work(variant) -> None:
    # Contiguous chunks: rank i's queries see (i + 1/2) chunk-blocks of the causal triangle, the
    # last rank cp - 1/2 of them against cp/2 on average: 2 - 1/cp times the balanced share.
    cp = 4
    balanced = attention_flops(workload(cp=cp, **variant))
    naive = attention_flops(workload(cp=cp, cp_load_balance=False, **variant))
    assert naive == pytest.approx(balanced * (2 - 1 / cp), abs=64)
    # a2a gives every rank whole sequences of its heads: nothing to balance
    assert attention_flops(workload(cp=cp, cp_comm="a2a", cp_load_balance=False)) == \
        attention_flops(workload(cp=cp, cp_comm="a2a"))


# -- the exchange's bytes --------------------------------------------------------------------------

def _kv_chunk(cp: int, tp: int) -> int:
    """K and V of one rank's piece of the sequence: 2 * b * (s/cp) * (kv_heads/tp) * d * bytes."""
    return 2 * B * (S // cp) * (G // tp) * D * BF16


@pytest.mark.parametrize("cp,tp", [(2, 1), (4, 2), (8, 1)])
def test_ring_bytes_per_layer(cp, tp) -> None:
    w = workload(tp=tp, cp=cp)
    sends = lambda phase: sum(n.comm_bytes for n in layer_nodes(w, phase) if n.type == SEND)  # noqa: E731
    recvs = lambda phase: sum(n.comm_bytes for n in layer_nodes(w, phase) if n.type == RECV)  # noqa: E731
    # forward: (cp - 1) steps of 2 * b * (s/cp) * kv_heads * head_dim * bytes
    assert sends("fwd") == recvs("fwd") == (cp - 1) * _kv_chunk(cp, tp)
    # backward: K/V round the ring again, and dK/dV one step behind
    assert sends("bwd") == recvs("bwd") == 2 * (cp - 1) * _kv_chunk(cp, tp)
    assert sum(n.type == SEND for n in layer_nodes(w, "fwd")) == cp - 1
    assert sum(n.type == SEND for n in layer_nodes(w, "bwd")) == cp
    # every send is on the cp stream's group, to the next cp rank (forward) with a tag its receive shares
    fwd = [n for n in layer_nodes(w, "fwd") if n.type in (SEND, RECV)]
    assert {n.group for n in fwd} == {"cp"}
    assert {n.tag for n in fwd if n.type == SEND} == {n.tag for n in fwd if n.type == RECV}
    # the rest of the layer moves no bytes over cp
    assert not [n for n in layer_nodes(w) if n.type == COLL and n.group == "cp"]


def test_all_gather_bytes_per_layer() -> None:
    cp, tp = 4, 2
    w = workload(tp=tp, cp=cp, cp_comm="all-gather")
    colls = lambda phase, kind: [n.comm_bytes for n in layer_nodes(w, phase)  # noqa: E731
                                 if n.type == COLL and n.group == "cp" and n.coll.value == kind]
    half = _kv_chunk(cp, tp) // 2           # K (or V) of one rank's piece: what each rank contributes
    assert colls("fwd", "ALL_GATHER") == [half, half]
    # the backward gathers K and V again and reduce-scatters dK and dV (each rank's full-length input)
    assert colls("bwd", "ALL_GATHER") == [half, half]
    assert colls("bwd", "REDUCE_SCATTER") == [cp * half, cp * half]
    assert not [n for n in layer_nodes(w) if n.type in (SEND, RECV)]


def test_a2a_bytes_per_layer() -> None:
    cp, tp = 4, 2
    w = workload(tp=tp, cp=cp, cp_comm="a2a")
    q = B * (S // cp) * (HQ // tp) * D * BF16
    kv = _kv_chunk(cp, tp) // 2
    a2a = lambda phase: sorted(n.comm_bytes for n in layer_nodes(w, phase)  # noqa: E731
                               if n.type == COLL and n.coll.value == "ALL_TO_ALL")
    # forward: q, k, v to head-sharded, the output back; backward: dout in, dq, dk, dv out
    assert a2a("fwd") == sorted([q, kv, kv, q])
    assert a2a("bwd") == sorted([q, q, kv, kv])
    assert {n.group for n in layer_nodes(w) if n.type == COLL and n.coll.value == "ALL_TO_ALL"} == {"cp"}


def test_hierarchical_a2a_inside_ring_across() -> None:
    cp, a2a, tp = 8, 2, 1
    w = workload(tp=tp, cp=cp, cp_comm="a2a+p2p", cp_a2a_size=a2a)
    ring = cp // a2a
    fwd = layer_nodes(w, "fwd")
    assert sum(n.comm_bytes for n in fwd if n.type == SEND) == (ring - 1) * _kv_chunk(cp, tp)
    assert {n.group for n in fwd if n.type == COLL and n.coll.value == "ALL_TO_ALL"} == {"cp_a2a"}
    assert {abs(n.peer) for n in fwd if n.type == SEND} == {a2a}      # ring neighbours: a2a cp ranks apart
    assert sum(n.category == "attention" for n in fwd) == ring
    # the groups: all-to-all among 2 consecutive cp ranks, the ring over every second one
    assert w.group_members(0, "cp_a2a") == [0, 1]
    assert w.group_members(5, "cp_a2a") == [4, 5]
    assert [w.peer(r, +a2a, "cp") for r in (0, 1, 6, 7)] == [2, 3, 0, 1]


@pytest.mark.parametrize("cp,a2a,tp", [(8, 2, 1), (8, 4, 2), (4, 2, 2)])
def test_hierarchical_a2a_bytes_per_layer(cp, a2a, tp) -> None:
    """Inside each group of cp-a2a-size ranks, the all-to-alls swap a rank's own piece of the
    sequence (s/cp tokens, every head it holds over tp) for whole heads: each all-to-all's
    buffer is q (or the output, dout, dq): b * (s/cp) * (heads/tp) * d * bytes, k or v (dk, dv):
    b * (s/cp) * (kv_heads/tp) * d * bytes; forward q, k, v in and the output back, backward
    dout in and dq, dk, dv back. The ring across the groups passes what a rank holds after the
    swap: (s/ring) tokens of (kv_heads/(tp*a2a)) heads, the same bytes as its own piece."""
    w = workload(tp=tp, cp=cp, cp_comm="a2a+p2p", cp_a2a_size=a2a)
    q = B * (S // cp) * (HQ // tp) * D * BF16
    kv = B * (S // cp) * (G // tp) * D * BF16
    a2a_bytes = lambda phase: sorted(n.comm_bytes for n in layer_nodes(w, phase)  # noqa: E731
                                     if n.type == COLL and n.coll.value == "ALL_TO_ALL")
    assert a2a_bytes("fwd") == sorted([q, kv, kv, q])
    assert a2a_bytes("bwd") == sorted([q, q, kv, kv])
    assert {n.group for n in layer_nodes(w) if n.type == COLL and n.coll.value == "ALL_TO_ALL"} == {"cp_a2a"}
    assert all(len(w.group_members(r, "cp_a2a")) == a2a for r in range(w.world_size))
    ring = cp // a2a
    fwd_sends = [n.comm_bytes for n in layer_nodes(w, "fwd") if n.type == SEND]
    assert fwd_sends == [2 * B * (S // ring) * (G // (tp * a2a)) * D * BF16] * (ring - 1)


# -- gradients -----------------------------------------------------------------------------------

@pytest.mark.parametrize("zero,coll", [(0, "ALL_REDUCE"), (1, "REDUCE_SCATTER")])
@pytest.mark.parametrize("dp", [1, 2])
def test_gradients_reduce_over_dp_and_cp(zero, coll, dp) -> None:
    cp, tp = 4, 2
    # (without sequence parallelism, whose norm-weight gradients are all-reduced over tp as well)
    w = workload(tp=tp, sp=False, cp=cp, dp=dp, zero=zero, global_batch=dp)
    ref = workload(tp=tp, sp=False, dp=dp * cp, zero=zero, global_batch=dp * cp)   # same group size over dp alone
    grads = [n for n in w.role(0).nodes if n.phase == "step" and n.type == COLL and ".grad_" in n.name]
    ref_grads = [n for n in ref.role(0).nodes if n.phase == "step" and n.type == COLL and ".grad_" in n.name]
    assert {n.group for n in grads} == {"dp_cp"}            # dp = 1: still the data-parallel group
    assert {n.coll.value for n in grads} == {coll}
    # the rank's parameter shard in fp32, once per step: what dp*cp-way data parallelism moves
    assert [n.comm_bytes for n in grads] == [n.comm_bytes for n in ref_grads]
    assert len(w.group_members(0, "dp_cp")) == dp * cp
    # members share tp and pp coordinates: rank = tp + 2 cp + 8 dp
    assert w.group_members(0, "dp_cp") == [tp * c + tp * cp * d for d in range(dp) for c in range(cp)]


@pytest.mark.parametrize("order,rank_of", [
    # rank = sum of coordinate * stride, innermost first (tp 2, cp 2, dp 2, pp 2)
    (("cp", "tp", "dp", "pp"), lambda tp, cp, dp, pp: cp + 2 * tp + 4 * dp + 8 * pp),
    (("dp", "tp", "cp", "pp"), lambda tp, cp, dp, pp: dp + 2 * tp + 4 * cp + 8 * pp),
    (("tp", "dp", "pp", "cp"), lambda tp, cp, dp, pp: tp + 2 * dp + 4 * pp + 8 * cp),
    (("tp", "dp", "pp"), lambda tp, cp, dp, pp: tp + 2 * cp + 4 * dp + 8 * pp),   # cp right after tp
])
def test_axis_order_with_cp(order, rank_of) -> None:
    w = workload(tp=2, cp=2, dp=2, pp=2, global_batch=4, axis_order=order)
    coords = [(t, c, d, p) for p in range(2) for d in range(2) for c in range(2) for t in range(2)]
    assert sorted(rank_of(*x) for x in coords) == list(range(16))
    for t, c, d, p in coords:
        r = rank_of(t, c, d, p)
        assert sorted(w.group_members(r, "cp")) == sorted(rank_of(t, x, d, p) for x in range(2))
        assert sorted(w.group_members(r, "tp")) == sorted(rank_of(x, c, d, p) for x in range(2))
        assert sorted(w.group_members(r, "dp_cp")) == sorted(rank_of(t, x, y, p) for x in range(2) for y in range(2))
        assert w.peer(r, +1, "cp") == rank_of(t, 1 - c, d, p)         # the ring's next rank
        if p == 0:
            assert w.peer(r, +1) == rank_of(t, c, d, 1)               # the next pipeline stage


def test_rank_order_tp_cp_dp_pp() -> None:
    w = workload(tp=2, cp=2, dp=2, pp=2, global_batch=4)
    assert w.group_members(0, "tp") == [0, 1]
    assert w.group_members(0, "cp") == [0, 2]
    assert w.group_members(0, "dp") == [0, 4]
    assert w.peer(0, +1) == 8              # the next pipeline stage
    assert w.peer(0, +1, "cp") == 2 and w.peer(2, +1, "cp") == 0     # the ring wraps


# -- memory ------------------------------------------------------------------------------------

def test_activations_shrink_by_cp_and_the_ring_adds_its_buffers() -> None:
    one, four = workload(), workload(cp=4)
    assert four.memory(0).activations == pytest.approx(one.memory(0).activations / 4, rel=1e-9)
    assert one.memory(0).workspace == 0
    # Hand-worked, one layer at cp = 4 (b 1, s 8192, tp 1): K/V chunk 2*1*2048*8*128*2 B = 8 MiB,
    # the output (and q) 1*2048*32*128*2 B = 16 MiB. Forward: two K/V receive buffers, the 4
    # steps' partial outputs kept until they are merged and the fp32 accumulator: 16 + 64 + 32
    # = 112 MiB; backward: K/V and dK/dV double-buffered plus the dQ buffer: 32 + 16 = 48 MiB.
    MiB = 1 << 20
    assert four.memory(0).workspace == 112 * MiB
    # all-gather: K and V of the whole sequence (forward 4*8 MiB; backward that and the unreduced
    # dK, dV: 64 MiB)
    assert workload(cp=4, cp_comm="all-gather").memory(0).workspace == 64 * MiB
    # model states do not change with cp at ZeRO 0 (every cp rank holds the weights)
    assert four.memory(0).weights == one.memory(0).weights
    # ZeRO-1 shards the optimizer over dp*cp
    z = workload(cp=4, zero=1).memory(0)
    assert z.optimizer == pytest.approx(one.memory(0).optimizer / 4, rel=1e-6)


# -- constraints --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,param", [
    (dict(cp=3, seq_len=8196), "seq-len"),                      # 8196 = 6 * 1366: fine ...
    (dict(cp=3, seq_len=8194), "seq-len"),                      # ... not divisible by 2*cp
    (dict(cp=4, tp=2, cp_comm="a2a"), "cp-comm"),               # 8 kv heads over tp*cp = 8 ok ...
    (dict(cp=16, cp_comm="a2a"), "cp-comm"),                    # ... 8 kv heads over 16 ranks: no
    (dict(cp=4, cp_comm="a2a+p2p"), "cp-a2a-size"),             # needs a group size
    (dict(cp=4, cp_comm="a2a+p2p", cp_a2a_size=3), "cp-a2a-size"),
    (dict(cp=4, cp_a2a_size=2), "cp-a2a-size"),                 # only with a2a+p2p
    (dict(cp=4, cp_comm="ring"), "cp-comm"),
    (dict(cp=2, tp=4, sp=True, seq_len=8196), "seq-len"),
])
def test_constraints_name_their_parameter(kw, param) -> None:
    if kw in (dict(cp=4, tp=2, cp_comm="a2a"), dict(cp=3, seq_len=8196)):
        workload(**kw)          # allowed: the sanity case of the next one
        return
    with pytest.raises(UserError) as e:
        workload(**kw)
    assert e.value.parameter == param


def test_ring_refuses_sliding_windows_and_unfused_attention() -> None:
    unfused = MODEL.with_overrides(attention="unfused")
    with pytest.raises(UserError) as e:
        synthesize(unfused, ParallelConfig(seq_len=S, cp=2))
    assert e.value.parameter == "cp-comm"
    synthesize(unfused, ParallelConfig(seq_len=S, cp=2, cp_comm="all-gather"))   # derived: fine
    windowed = MODEL.with_overrides(sliding_window=1024)
    with pytest.raises(UserError) as e:
        synthesize(windowed, ParallelConfig(seq_len=S, cp=2))
    assert e.value.parameter == "cp-comm"
    full = windowed.with_overrides(causal_flops=False)
    for comm in ("all-gather", "a2a"):    # Transformer Engine runs windows with these
        # the kernel over every query's whole window: 4 * b * (s/cp) * w * heads * d
        w = synthesize(full, ParallelConfig(seq_len=S, cp=2, cp_comm=comm))
        fwd = sum(n.flops for n in layer_nodes(w, "fwd") if n.category == "attention")
        assert fwd == 4 * B * (S // 2) * 1024 * HQ * D
        # skipping the masked blocks (the default): query i sees min(i + 1, w) keys, s*w - w^2/2
        # pairs over the sequence, 1 - w/(2s) = 1 - 1024/16384 = 15/16 of the s*w above
        w = synthesize(windowed, ParallelConfig(seq_len=S, cp=2, cp_comm=comm))
        fwd = sum(n.flops for n in layer_nodes(w, "fwd") if n.category == "attention")
        assert fwd == 4 * B * (S // 2) * 1024 * HQ * D * 15 // 16


def test_cli_error_is_one_line(run_cli, tmp_path) -> None:
    code, out, err = run_cli("synth", "--model", "llama3-8b", "--cp", "16", "--cp-comm", "a2a",
                             "--seq-len", "8192", "--out", str(tmp_path / "t"))
    assert code == 2
    assert err.strip().startswith("error: cp-comm:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists()
    code, out, err = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", "--cp", "2", "--seq-len", "8192",
                             "--cluster", "dgx-h100:4", "--dp", "1")
    assert code == 2 and err.strip() == "error: cluster: has 4 GPUs but dp*tp*cp*pp = 2"


# -- sequence length changes numbers only ----------------------------------------------------------

def test_graph_size_does_not_depend_on_the_sequence() -> None:
    sizes = {seq: workload(cp=8, seq_len=seq).role(0).num_nodes for seq in (8192, 131072, 1 << 20)}
    assert len(set(sizes.values())) == 1


# -- simulation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v["cp_comm"])
@pytest.mark.parametrize("schedule", [dict(pp=2, global_batch=4), dict(pp=2, vp=2, global_batch=4)],
                         ids=["1f1b", "interleaved"])
def test_fast_path_agrees_with_the_node_replay(variant, schedule) -> None:
    model = get_preset("llama3-8b").with_overrides(layers=4)
    par = ParallelConfig(tp=2, cp=4, seq_len=S, **variant, **schedule)
    w = synthesize(model, par)
    cluster = resolve_cluster("dgx-h100", par.world_size)
    fast, _, _ = simulate(w, cluster)
    exact, _, _ = simulate(w, cluster, exact=True)
    assert fast.step_time_s == pytest.approx(exact.step_time_s, rel=0.005)


def test_a_slow_ring_shows_as_exposed_cp() -> None:
    from dataclasses import replace

    w = workload(tp=1, cp=8)
    c = resolve_cluster("dgx-h100:8")
    fast = simulate(w, c).result
    slow = simulate(w, replace(c, scale_up=replace(c.scale_up, bandwidth_GBps=1.0))).result
    assert fast.breakdown["exposed_cp"] < 0.01 * fast.step_time_s     # hidden behind the partial kernels
    # at 1 GB/s the ring's transfers outlast the partial kernels: nearly all of their time shows
    ring_s = sum(n.comm_bytes for n in w.role(0).nodes if n.type == SEND) / (1e9 * c.gpu.scale_up_efficiency)
    assert slow.breakdown["exposed_cp"] == pytest.approx(ring_s, rel=0.05)


def test_symmetric_replay_equals_every_rank() -> None:
    w = workload(tp=2, cp=2, dp=2, pp=2, global_batch=4, cp_load_balance=True)
    c = resolve_cluster("dgx-h100:16")
    one, _, _ = simulate(w, c, exact=True)
    every, _, _ = simulate(w, c, symmetric=False)
    assert one.step_time_s == pytest.approx(every.step_time_s, rel=1e-9)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_step_kernels_against_hand_computed_times(causal) -> None:
    """Chunk-shape efficiency: each ring step's kernel is timed with the keys its thread blocks
    loop over and the tiles of 128 rows it splits over the 132 SMs of an H100. Hand-worked for
    tp 8 (4 query heads per rank), cp 4, s 8192, b 1: chunks of c = 1024 tokens, a rank's
    2c = 2048 queries are 2048 * 4 / 128 = 64 tiles. Forward: the diagonal step loops over 2048
    keys, the half-block steps (the last rank's: all queries, the visitor's first chunk) over
    1024. Backward (tiles over keys, loop over queries): the diagonal 64 tiles, the half blocks'
    1024 keys 32 tiles, each looping over 2048 queries.

    FLOPs: run over the full matrix (causal_flops off) a step is a 2048 x 2048 block; skipping
    the masked blocks (the default), every balanced step is half of it: the diagonal step's
    triangle, the half blocks' 2048 x 1024 or 1024 x 2048. The timing rule is the same."""
    from stage_cosim.adapters.roofline.compute import ComputeModel

    gpu = resolve_cluster("dgx-h100:8").gpu
    # 132 SMs: an H100 SXM5 (NVIDIA's H100 Tensor Core GPU Architecture whitepaper)
    assert (gpu.sm_count, gpu.attention_block_rows) == (132, 128)
    model = ComputeModel(gpu)
    full = 4 * B * 2048 * 2048 * (HQ // 8) * D            # one step: 1/cp of the rank's full-matrix work
    fwd_flops = full // 2 if causal else full

    def workload(**kw):
        base = dict(seq_len=S, micro_batch=B, global_batch=B)
        return synthesize(MODEL.with_overrides(causal_flops=causal), ParallelConfig(**(base | kw)))

    def hand(flops: float, keys: int, tiles: int) -> float:
        rate = gpu.bf16_tflops * 1e12 * gpu.attention_efficiency * keys / (keys + gpu.attention_half_keys)
        return flops / (rate * min(1, tiles / 132)) + gpu.kernel_overhead_us * 1e-6

    w = workload(tp=8, cp=4)
    fwd = [n for n in layer_nodes(w, "fwd") if n.category == "attention"]
    bwd = [n for n in layer_nodes(w, "bwd") if n.category == "attention_grad"]
    assert [n.flops for n in fwd] == [fwd_flops] * 4 and [n.flops for n in bwd] == [fwd_flops * 5 // 2] * 4
    assert [model.node_duration_s(n) for n in fwd] == pytest.approx(
        [hand(fwd_flops, 2048, 64)] + [hand(fwd_flops, 1024, 64)] * 3, rel=1e-12)
    assert [model.node_duration_s(n) for n in bwd] == pytest.approx(
        [hand(2.5 * fwd_flops, 2048, 64)] + [hand(2.5 * fwd_flops, 2048, 32)] * 3, rel=1e-12)
    # contiguous chunks: the last rank's diagonal, then whole blocks of 2048 x 2048 (causal: the
    # diagonal's triangle, then unmasked blocks; full: each counted as twice that)
    naive = [n for n in layer_nodes(workload(tp=8, cp=4, cp_load_balance=False), "fwd") if n.category == "attention"]
    assert [model.node_duration_s(n) for n in naive] == pytest.approx(
        [hand(fwd_flops, 2048, 64)] + [hand(2 * fwd_flops, 2048, 64)] * 3, rel=1e-12)
    # one kernel over the whole sequence (cp 1): 8192 keys, 8192 * 4 / 128 = 256 tiles, every SM busy
    whole = [n for n in layer_nodes(workload(tp=8), "fwd") if n.category == "attention"]
    assert model.node_duration_s(whole[0]) == pytest.approx(hand(16 * fwd_flops, 8192, 256), rel=1e-12)
    # so per rank the ring's kernels take longer than a quarter of the whole kernel's time
    assert sum(model.node_duration_s(n) for n in fwd) > 1.5 * model.node_duration_s(whole[0]) / 4


def test_ring_steps_add_up_to_the_causal_closed_form() -> None:
    """With causal FLOPs, the steps' kernels add up to the rank's share of the unmasked
    triangle, 4 * b * (s^2 / 2) * heads * d / cp forward (2.5x that backward), balanced or not
    (the naive split's last rank: 2 - 1/cp times it)."""
    causal = MODEL.with_overrides(causal_flops=True)
    cp, tp = 4, 2
    rank_share = 4 * B * (S * S // 2) * (HQ // tp) * D // cp
    for balanced, factor in ((True, 1.0), (False, 2 - 1 / cp)):
        w = synthesize(causal, ParallelConfig(seq_len=S, micro_batch=B, global_batch=B, tp=tp, cp=cp,
                                              cp_load_balance=balanced))
        fwd = [n.flops for n in layer_nodes(w, "fwd") if n.category == "attention"]
        bwd = [n.flops for n in layer_nodes(w, "bwd") if n.category == "attention_grad"]
        assert len(fwd) == len(bwd) == cp
        assert sum(fwd) == pytest.approx(factor * rank_share, rel=1e-12)
        assert sum(bwd) == pytest.approx(2.5 * factor * rank_share, rel=1e-12)


# -- traces ----------------------------------------------------------------------------------------

def test_ring_trace_files_are_the_nodes_stamped_one_by_one(tmp_path) -> None:
    """The writer stamps a rank's file from its stage's template in a few joins; each file is
    what completing the template's nodes one at a time gives: a node with a hole is its length
    prefix, its body and the rank's fill (ranks 0-63: peers and groups of one and two digits)."""
    from google.protobuf.internal.encoder import _VarintBytes

    from stage_cosim.trace.chakra import metadata_bytes
    from stage_cosim.trace.writer import chakra_holes, chakra_template, write_traces

    w = workload(tp=2, cp=8, dp=2, pp=2, global_batch=2)
    write_traces(w, tmp_path)
    templates = [chakra_template(role) for role in w.roles]
    for rank in range(w.world_size):
        template = templates[w.role_of(rank)]
        fills = chakra_holes(w, rank, {item[1] for item in template if not isinstance(item, bytes)})
        parts = [metadata_bytes()]
        for item in template:
            if isinstance(item, bytes):
                parts.append(item)
            else:
                body, extra = item[0], fills[item[1]]
                parts += [_VarintBytes(len(body) + len(extra)), body, extra]
        assert (tmp_path / f"workload.{rank}.et").read_bytes() == b"".join(parts), rank


@pytest.mark.parametrize("par,symmetric", [
    (dict(tp=2, cp=4, dp=2, pp=2, global_batch=4), True),     # the ring inside a node
    (dict(tp=8, cp=4, global_batch=1), True),                 # the ring across nodes, every hop alike
    (dict(tp=4, cp=4, dp=2, global_batch=2), False),          # half its hops in a node, half across
    (dict(tp=2, cp=4, pp=2, global_batch=4, cp_load_balance=False, zero=3), True),
])
def test_ring_traces_replay_one_rank_per_stage(par, symmetric, tmp_path, run_cli) -> None:
    """Read back, a ring trace set is simulated one rank per stage where that is exact (ranks
    of a stage differ only in their peers, every ring hop crossing the network alike), and gives
    the per-rank replay's step time and the direct simulation's; the text table has one row per
    stage either way."""
    from stage_cosim.adapters.roofline.traces import simulate_traces

    parallel = ParallelConfig(seq_len=S, micro_batch=B, **par)
    w = workload(**par)
    flags = [f"--{k.replace('_', '-')}={v}" if v is not False else f"--no-{k.replace('_', '-')}"
             for k, v in par.items()]
    code, _, _ = run_cli("synth", "--model", "llama3-8b", "--layers", "2", "--seq-len", str(S), *flags,
                         "--out", str(tmp_path / "t"), "--quiet")
    assert code == 0
    tmp_path = tmp_path / "t"
    cluster = resolve_cluster("dgx-h100", parallel.world_size)
    # the node-level replay of the synthesized workload, one rank per stage only where that is
    # exact (else the one-rank-per-stage run assumes every rank's ring hops are the
    # representative's: with causal attention's shorter kernels, the hops that cross the network
    # show, 0.1 % here)
    direct = simulate(w, cluster, symmetric=symmetric, exact=True).result.step_time_s
    one, _, programs = simulate_traces(tmp_path, cluster)
    every, _, _ = simulate_traces(tmp_path, cluster, symmetric=False)
    assert one.config["symmetric"] is symmetric
    assert len(programs) == (parallel.pp if symmetric else parallel.world_size)
    assert one.step_time_s == pytest.approx(every.step_time_s, rel=1e-12)
    assert one.step_time_s == pytest.approx(direct, rel=1e-9)
    code, out, _ = run_cli("simulate", "--traces", str(tmp_path), "--cluster", f"dgx-h100:{parallel.world_size}",
                           "--full")
    assert code == 0
    table = out[out.index("finish s"):].split("\n\n")[0].splitlines()[1:]
    assert [int(line.split()[0]) for line in table] == list(range(parallel.pp))


@pytest.mark.parametrize("variant", VARIANTS + [dict(cp_comm="p2p", cp_load_balance=False)],
                         ids=lambda v: v["cp_comm"] + ("" if v.get("cp_load_balance", True) else "-naive"))
@pytest.mark.parametrize("extra", [dict(), dict(zero=3, recompute="full"), dict(sp=True, zero=1, vp=2),
                                   dict(dtype="fp8", fp8_recipe="delayed", schedule="gpipe")],
                         ids=["plain", "zero3-full", "sp-zero1-interleaved", "fp8-delayed-gpipe"])
def test_traces_validate_and_astra_model_runs(variant, extra, tmp_path) -> None:
    from stage_cosim.adapters.astra_sim.export import export
    from stage_cosim.adapters.astra_sim.analytical import simulate_run_dir
    from stage_cosim.trace.validate import load_trace_set, validate_trace_set

    model = get_preset("llama3-8b").with_overrides(layers=4)
    par = ParallelConfig(tp=2, cp=4, pp=2, seq_len=S, global_batch=4, **variant, **extra)
    w = synthesize(model, par)
    cluster = resolve_cluster("dgx-h100:16")
    out = tmp_path / "run"
    export(w, cluster, out, mode="replay")
    ranks, groups = load_trace_set(out / "traces", out / "comm_groups.json")
    assert validate_trace_set(ranks, groups) == []
    result = simulate_run_dir(out)
    assert len(result.finished_ns) == 16


@pytest.mark.skipif(not os.environ.get("ASTRA_SIM_BIN"), reason="needs ASTRA_SIM_BIN (a real ASTRA-sim build)")
@pytest.mark.parametrize("variant", VARIANTS + [dict(cp_comm="p2p", cp_load_balance=False, zero=3)],
                         ids=lambda v: v["cp_comm"] + ("" if v.get("cp_load_balance", True) else "-naive"))
def test_real_astra_sim_finishes_every_rank_as_the_model_says(variant, tmp_path) -> None:
    from stage_cosim.adapters.astra_sim.export import export
    from stage_cosim.adapters.astra_sim.run import run
    from stage_cosim.adapters.astra_sim.analytical import simulate_run_dir

    model = get_preset("llama3-8b").with_overrides(layers=4)
    par = ParallelConfig(tp=2, cp=4, pp=2, seq_len=S, global_batch=4, **variant)
    out = tmp_path / "run"
    export(synthesize(model, par), resolve_cluster("dgx-h100:16"), out, mode="replay")
    real = run(os.environ["ASTRA_SIM_BIN"], out, 16)      # raises unless every rank finished
    predicted = simulate_run_dir(out)
    assert real.output.finished_ns == predicted.finished_ns    # to the nanosecond, rank by rank


# -- search ----------------------------------------------------------------------------------------

def test_cp_is_a_search_dimension_with_clear_rules() -> None:
    from stage_cosim.search.space import canonical, check, default_space

    cluster = resolve_cluster("dgx-h100:16")
    space = default_space(MODEL, cluster, 16, 131072)
    dims = {d.name: d.choices for d in space.dimensions}
    assert dims["cp"] == (1, 2, 4, 8, 16) and dims["cp_comm"] == ("p2p", "all-gather", "a2a", "a2a+p2p")
    assert dims["cp_a2a_size"] == (2, 4, 8)            # all-to-all groups within a DGX's 8 GPUs
    # at 8K a rank keeps at least 4K tokens: cp 1 or 2
    assert {d.name: d.choices for d in default_space(MODEL, cluster, 16, 8192).dimensions}["cp"] == (1, 2)
    point = {d.name: d.choices[0] for d in space.dimensions}
    assert canonical(space, point | {"cp": 1, "cp_comm": "a2a"})["cp_comm"] == "p2p"   # meaningless at cp 1
    par, why = check(space, point | {"cp": 8, "cp_comm": "p2p"}, cluster)
    assert why is None and par.cp == 8 and par.dp == 2
    # hierarchical: all-to-alls in pairs, the ring over 4 pairs; the group size means nothing
    # for the other exchanges, and groups of 1 or of every cp rank are the plain ring and a2a
    par, why = check(space, canonical(space, point | {"cp": 8, "cp_comm": "a2a+p2p", "cp_a2a_size": 2}), cluster)
    assert why is None and (par.cp_comm, par.cp_a2a_size) == ("a2a+p2p", 2)
    assert canonical(space, point | {"cp": 8, "cp_comm": "all-gather", "cp_a2a_size": 4})["cp_a2a_size"] is None
    assert canonical(space, point | {"cp": 4, "cp_comm": "a2a+p2p", "cp_a2a_size": 4})["cp_comm"] == "a2a"
    _, why = check(space, point | {"tp": 4, "cp": 4, "cp_comm": "a2a+p2p", "cp_a2a_size": 4}, cluster)
    assert why.startswith("cp-comm: a2a+p2p shards attention heads")     # 8 kv heads over tp*4 = 16
    _, why = check(space, point | {"cp": 16, "cp_comm": "a2a"}, cluster)
    assert why.startswith("cp-comm: a2a shards attention heads")
    odd = default_space(MODEL, cluster, 16, 131072 - 16)
    _, why = check(odd, point | {"cp": 16}, cluster)
    assert why.startswith("seq-len: must be divisible by 2*cp")


def test_search_picks_context_parallelism_for_a_long_sequence() -> None:
    from stage_cosim.search.space import default_space

    cluster = resolve_cluster("dgx-h100:8")
    model = get_preset("llama3-8b").with_overrides(layers=4)
    space = default_space(model, cluster, 1, 131072, overrides={
        "pp": (1,), "vp": (1,), "micro_batch": (1,), "zero": (0,), "recompute": ("none",), "sp": (False, True)})
    r = optimize(space, cluster, OptimizeSettings())
    assert r.proven_optimal
    best = r.best.result["config"]["parallel"]
    # one sequence of 131K tokens on 8 GPUs: tensor parallelism alone leaves each GPU the whole
    # sequence's attention with small heads; the answer shards the sequence
    assert best["cp"] > 1
    no_cp = min(e.score for e in r.evaluated if e.feasible and e.parallel["cp"] == 1)
    assert r.best.score < no_cp


# -- mesh and groups -----------------------------------------------------------------------------

def test_sub_axes_and_the_data_parallel_group() -> None:
    from stage_cosim.parallel.axes import resolve_group
    from stage_cosim.parallel.mesh import DeviceMesh

    # rank = tp + 2 cp + 8 dp, cp (4) split into all-to-all pairs
    m = DeviceMesh.build({"tp": 2, "cp": 4, "dp": 2}, ("tp", "cp", "dp"), (("cp_a2a", "cp", 2),))
    assert m.groups("cp_a2a") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert m.groups("cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert m.group_members(13, ("cp", "dp")) == [1, 3, 5, 7, 9, 11, 13, 15]
    for axes in ("cp_a2a", "cp", ("tp", "cp_a2a"), ("cp", "dp")):
        groups = m.groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(16))
        assert all(m.group_index(r, axes) == i and m.group_members(r, axes) == g
                   for i, g in enumerate(groups) for r in g)
    # gradients: the data-parallel group whatever is of degree 1
    assert resolve_group(("cp", "dp"), {"cp": 1, "dp": 4}) == "dp"
    assert resolve_group(("cp", "dp"), {"cp": 4, "dp": 1}) == "dp_cp"
    assert resolve_group(("cp", "dp"), {"cp": 4, "dp": 2}) == "dp_cp"
    assert resolve_group(("cp",), {"cp": 4}) == "cp"
    # delayed FP8's amax reduction: every rank of a stage, cp included
    assert resolve_group(("tp", "cp", "dp"), {"tp": 2, "cp": 2, "dp": 2}) == "tp_cp_dp"
    assert resolve_group(("tp", "cp", "dp"), {"tp": 2, "cp": 1, "dp": 2}) == "tp_dp"
    assert resolve_group(("tp", "cp", "dp"), {"tp": 2, "cp": 2, "dp": 1}) == "tp_cp_dp"


# -- with experts: Megatron-Core folds cp into the expert mesh's data parallelism ---------------

def test_expert_mesh_folds_cp_into_edp() -> None:
    from stage_cosim.model import ModelConfig

    tiny = ModelConfig.build("tiny-moe", "llama", layers=2, hidden=256, ffn=512, heads=8, kv_heads=4,
                             vocab=1024, max_seq=8192, num_experts=8, moe_router_topk=2)
    seq = 4096
    par = ParallelConfig(tp=1, cp=4, dp=2, ep=4, micro_batch=1, global_batch=2, seq_len=seq)
    assert par.edp == 2                                  # tp*cp*dp / (expert_tp*ep) = 8 / 4
    w = synthesize(tiny, par)
    step = [n for n in w.role(0).nodes if n.phase == "step" and n.type == COLL and "grad" in n.name]
    assert {n.group for n in step} == {"dp_cp", "edp"}  # dense weights over dp*cp, experts over edp
    assert len(w.group_members(0, "edp")) == 2 and len(w.group_members(0, "dp_cp")) == 8
    # the expert mesh re-factors the same 8 ranks: ep groups of consecutive ranks (tp, cp inner)
    assert w.group_members(0, "ep") == [0, 1, 2, 3]
    # dispatch moves each rank's own tokens, s/cp of its sequence: as many as 8 data-parallel
    # ranks with sequences of s/cp
    ref = synthesize(tiny, ParallelConfig(dp=8, ep=4, micro_batch=1, global_batch=8, seq_len=seq // 4))
    a2a = lambda w: sorted(n.comm_bytes for n in w.role(0).nodes  # noqa: E731
                           if n.type == COLL and n.group == "ep" and n.micro_batch == 0)
    assert a2a(w) == a2a(ref) and a2a(w)
    # and the ring runs beside it
    assert sum(n.type == SEND for n in w.role(0).nodes if n.block == "layer0" and n.micro_batch == 0) == 3 + 4


def test_moe_with_cp_exports_finish(tmp_path) -> None:
    """Experts beside the cp ring: the export validates, the astra model runs it, and with
    ASTRA_SIM_BIN the real binary finishes every rank at the model's times."""
    from stage_cosim.adapters.astra_sim.export import export
    from stage_cosim.adapters.astra_sim.analytical import simulate_run_dir
    from stage_cosim.model import ModelConfig
    from stage_cosim.trace.validate import load_trace_set, validate_trace_set

    tiny = ModelConfig.build("tiny-moe", "llama", layers=2, hidden=256, ffn=512, heads=8, kv_heads=4,
                             vocab=1024, max_seq=8192, num_experts=8, moe_router_topk=2)
    par = ParallelConfig(tp=2, cp=2, dp=2, pp=2, ep=4, sp=True, zero=1, micro_batch=1, global_batch=4, seq_len=4096)
    out = tmp_path / "run"
    export(synthesize(tiny, par), resolve_cluster("dgx-h100:16"), out, mode="replay")
    ranks, groups = load_trace_set(out / "traces", out / "comm_groups.json")
    assert validate_trace_set(ranks, groups) == []
    predicted = simulate_run_dir(out)
    assert len(predicted.finished_ns) == 16
    if os.environ.get("ASTRA_SIM_BIN"):
        from stage_cosim.adapters.astra_sim.run import run

        assert run(os.environ["ASTRA_SIM_BIN"], out, 16).output.finished_ns == predicted.finished_ns


def test_decode_steps_refuse_cp(run_cli) -> None:
    """A prefill's prompt is sharded over cp (tests/test_inference.py); a decode step's one new
    token per request is not."""
    code, _, err = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", "--phase", "decode", "--cp", "2",
                           "--context-len", "8192", "--cluster", "dgx-h100:2")
    assert code == 2 and err.strip().startswith("error: cp: context parallelism shards a prefill's prompts")
    assert len(err.strip().splitlines()) == 1
