"""Mixture of Experts and expert parallelism: FLOPs, all-to-all bytes, gradient bytes and memory
against closed forms worked out here, for many factorizations of the same ranks."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from stage_cosim.errors import UserError
from stage_cosim.model import PRESETS, ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.schedule.nodes import COLL, COMP
from stage_cosim.workload import synthesize

# A small Mixtral-like model: 8 experts, top-2, GQA; the vocabulary a multiple of 128 * 2 so
# padding it for tp <= 2 changes nothing.
TINY = ModelConfig.build("tiny-moe", "llama", layers=4, hidden=256, ffn=512, heads=8, kv_heads=4,
                         vocab=1024, max_seq=4096, num_experts=8, moe_router_topk=2)
# A small DeepSeek-like model: latent attention, a dense first layer, shared expert, MTP.
TINY_MLA = ModelConfig.build("tiny-mla", "llama", layers=3, hidden=256, ffn=768, heads=8, head_dim=32,
                             vocab=1024, max_seq=4096, multi_latent_attention=True, q_lora_rank=96,
                             kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32,
                             num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
                             moe_shared_expert_intermediate_size=128, moe_layer_freq=(0, 1, 1), mtp_num_layers=1)
SEQ = 512


def _gemm_params_per_token(m: ModelConfig) -> int:
    """Weights every token multiplies once (GEMMs only: no norms, biases or lookups): attention
    projections, the dense MLP or the router, top-k routed experts and the shared experts;
    the output layer; for MTP modules their projection, layer and the output layer again."""
    h = m.hidden

    def mlp(f: int) -> int:
        return 3 * h * f                       # SwiGLU: gate and up, down

    if m.multi_latent_attention:
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        attention = (h * m.q_lora_rank + m.q_lora_rank * m.heads * qk
                     + h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
                     + m.kv_lora_rank * m.heads * (m.qk_head_dim + m.v_head_dim) + m.heads * m.v_head_dim * h)
    else:
        attention = h * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * h

    def layer(i: int) -> int:
        if not m.is_moe_layer(i):
            return attention + mlp(m.ffn)
        shared = mlp(m.moe_shared_expert_intermediate_size) if m.moe_shared_expert_intermediate_size else 0
        return attention + h * m.num_experts + m.moe_router_topk * mlp(m.expert_ffn) + shared

    total = sum(layer(i) for i in range(m.layers)) + m.vocab * h
    return total + m.mtp_num_layers * (2 * h * h + layer(m.layers - 1) + m.vocab * h)


def _attention_flops(m: ModelConfig, batch: int) -> int:
    """QK^T and PV over the full s x s scores, forward + backward (3x): 12 b s^2 heads d per layer."""
    d_qk = m.qk_head_dim + m.qk_pos_emb_head_dim if m.multi_latent_attention else m.head_dim
    d_v = m.v_head_dim if m.multi_latent_attention else m.head_dim
    per_layer = 3 * 2 * batch * SEQ * SEQ * m.heads * (d_qk + d_v)
    return (m.layers + m.mtp_num_layers) * per_layer


FACTORIZATIONS = [  # dp, tp, pp, ep, expert_tp, sp
    (8, 1, 1, 1, 1, False), (8, 1, 1, 8, 1, False), (4, 2, 1, 4, 1, True), (4, 2, 1, 2, 2, True),
    (2, 2, 2, 4, 1, True), (2, 1, 4, 2, 1, False), (4, 2, 1, 8, 1, True), (4, 2, 1, 1, 2, False),
]


@pytest.mark.parametrize("dp, tp, pp, ep, etp, sp", FACTORIZATIONS)
def test_moe_model_flops_are_six_active_params_per_token(dp, tp, pp, ep, etp, sp) -> None:
    """Summed over ranks, model FLOPs = 6 * (active GEMM weights) * tokens + attention, however
    the experts are spread (the imbalance of the busiest rank is time, not model FLOPs)."""
    for m in (TINY, TINY_MLA):
        gb = 16
        if pp > m.layers:
            continue
        par = ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep, expert_tp=etp, sp=sp, micro_batch=1, global_batch=gb,
                             seq_len=SEQ, moe_imbalance=1.5 if ep > 1 else 1.0)   # (one expert rank: balanced)
        w = synthesize(m, par)
        expect = 6 * _gemm_params_per_token(m) * gb * SEQ + _attention_flops(m, gb)
        assert w.total_model_flops() == pytest.approx(expect, rel=1e-9), m.name


def _nodes(w, stage: int = 0):
    return w.role(stage).nodes


@pytest.mark.parametrize("dp, tp, ep, etp", [(8, 1, 8, 1), (8, 1, 4, 1), (4, 2, 4, 1), (4, 2, 2, 2), (2, 2, 4, 1)])
def test_all_to_all_bytes_per_layer(dp, tp, ep, etp) -> None:
    """Per MoE layer and micro-batch, dispatch and combine move 2 * tokens_local * topk * h * 2 B
    * (ep - 1) / ep off each rank in the forward, and as much in the backward."""
    m = TINY.with_overrides(layers=1)
    par = ParallelConfig(dp=dp, tp=tp, ep=ep, expert_tp=etp, sp=tp > 1, micro_batch=2, global_batch=2 * dp,
                         seq_len=SEQ)
    w = synthesize(m, par)
    tokens_local = 2 * SEQ // tp            # sequence parallelism: each tp rank its own tokens
    closed = 2 * tokens_local * m.moe_router_topk * m.hidden * 2 * (ep - 1) / ep
    for phase in ("fwd", "bwd"):
        a2a = [n for n in _nodes(w) if n.type == COLL and n.coll.value == "ALL_TO_ALL" and n.phase == phase]
        assert all(n.group == "ep" for n in a2a)
        assert len(a2a) == (2 if ep > 1 else 0)
        assert sum(n.comm_bytes for n in a2a) * (ep - 1) / ep == pytest.approx(closed)


def test_imbalance_scales_the_busiest_ranks_exchange_and_gemms() -> None:
    m = TINY.with_overrides(layers=1)
    base = dict(dp=8, ep=8, micro_batch=1, global_batch=8, seq_len=SEQ)
    even, skew = (synthesize(m, ParallelConfig(**base, moe_imbalance=f)) for f in (1.0, 2.0))

    def a2a_bytes(w) -> int:
        return sum(n.comm_bytes for n in _nodes(w) if n.type == COLL and n.group == "ep")

    def expert_gemm_flops(w) -> float:
        return sum(n.flops for n in _nodes(w) if n.type == COMP and n.name.startswith("layer0.experts.") and n.matmul)

    assert a2a_bytes(skew) == 2 * a2a_bytes(even)
    assert expert_gemm_flops(skew) == pytest.approx(2 * expert_gemm_flops(even))
    assert skew.total_model_flops() == even.total_model_flops()
    capped = ParallelConfig(**base, moe_imbalance=2.0, moe_capacity_factor=1.25)
    assert (capped.moe_load, capped.moe_dropped_fraction) == (1.25, pytest.approx(0.375))
    padded = ParallelConfig(**base, moe_capacity_factor=1.25, moe_pad_to_capacity=True)
    assert padded.moe_load == 1.25 and padded.moe_dropped_fraction == 0.0


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_expert_gradients_reduce_the_ranks_expert_shard_once_per_step(zero) -> None:
    """Expert weights' gradients reduce over edp, once per step, as many fp32 bytes as the rank
    holds expert parameters; dense weights' over dp."""
    m = TINY.with_overrides(layers=2)
    par = ParallelConfig(dp=8, tp=1, ep=4, zero=zero, micro_batch=1, global_batch=32, seq_len=SEQ)
    w = synthesize(m, par)
    assert par.edp == 2
    expert_params = m.layers * m.num_experts * 3 * m.hidden * m.expert_ffn // par.ep
    edp = [n for n in _nodes(w) if n.type == COLL and n.group == "edp" and n.phase == "step" and "grad" in n.name]
    assert sum(n.comm_bytes for n in edp) == 4 * expert_params
    assert {n.coll.value for n in edp} == {"ALL_REDUCE" if zero == 0 else "REDUCE_SCATTER"}
    dense = [n for n in _nodes(w) if n.type == COLL and n.group == "dp" and n.phase == "step" and "grad" in n.name]
    assert sum(n.comm_bytes for n in dense) == 4 * (m.param_count() - m.layers * m.num_experts * 3 * m.hidden * m.expert_ffn)


def test_model_states_and_routed_activations_of_a_small_case() -> None:
    """Worked by hand: one MoE layer, ep 2, dp 4 (edp 2), ZeRO 1. Dense weights are replicated
    over dp (optimizer states over 4), experts split over ep (optimizer states over edp 2).
    The routed tokens' activations: per token, top-k copies of the tokens (in expert order, and
    the experts' outputs back), the SwiGLU input (2i) and output (i), routing weights and map."""
    m = TINY.with_overrides(layers=1)
    par = ParallelConfig(dp=4, ep=2, zero=1, micro_batch=1, global_batch=4, seq_len=SEQ)
    w = synthesize(m, par)
    h, f, k, e = m.hidden, m.expert_ffn, m.moe_router_topk, m.num_experts
    experts = e * 3 * h * f // 2                                   # per rank
    dense = m.param_count() - e * 3 * h * f
    mem = w.memory(0)
    assert mem.weights == 2 * (dense + experts)
    assert mem.gradients == 4 * (dense + experts)
    assert mem.optimizer == pytest.approx(12 * dense / 4 + 12 * experts / 2, abs=1)
    # the layer's activations, against the same layer with a dense MLP of size f
    moe_layer, dense_layer = (synthesize(x, ParallelConfig(dp=4, ep=par.ep if x.is_moe else 1, micro_batch=1,
                                                           global_batch=4, seq_len=SEQ))
                              for x in (m, replace(m, num_experts=None, ffn=f)))
    saved = [x._role_args["blocks"].layers[0][1].saved_bytes for x in (moe_layer, dense_layer)]
    t = SEQ
    routed = t * k * (2 * h + 2 * h + 2 * 2 * f + 2 * f) + t * k * (4 + 4)   # bf16 copies; fp32 weights, i32 map
    assert saved[0] - saved[1] == routed - t * (2 * 2 * f + 2 * f)            # minus the dense MLP's own
    # the all-to-all send buffer, transient: the tokens' top-k copies
    assert moe_layer._role_args["blocks"].layers[0][1].workspace_bytes == t * k * h * 2
    assert dense_layer._role_args["blocks"].layers[0][1].workspace_bytes == 0


@pytest.mark.parametrize("kw, parameter, needle", [
    (dict(dp=8, ep=3), "ep", "must divide"),                     # 3 does not divide tp*cp*dp = 8
    (dict(dp=4, ep=16), "ep", "must divide tp*cp*dp"),
    (dict(dp=16, ep=16), "ep", "must divide num-experts (8)"),
    (dict(dp=4, tp=2, ep=2, sp=False), "sp", "sequence parallelism is required"),   # (sp is on by default)
    (dict(dp=4, tp=2, ep=4, expert_tp=4, sp=True), "ep", "must divide tp*cp*dp"),
    # expert-tp alone cannot divide tp*cp*dp = 4: it is the flag to blame
    (dict(dp=2, tp=2, expert_tp=3, sp=True), "expert-tp", "expert-tp*ep = 3*1 must divide tp*cp*dp = 2*1*2"),
    (dict(dp=2, tp=2, ep=2, expert_tp=8, sp=True), "expert-tp", "must divide tp*cp*dp"),
    (dict(dp=2, cp=2, ep=8), "ep", "expert-tp*ep = 1*8 must divide tp*cp*dp = 1*2*2"),
])
def test_expert_layout_errors(kw, parameter, needle) -> None:
    with pytest.raises(UserError) as exc:
        synthesize(TINY, ParallelConfig(micro_batch=1, seq_len=SEQ, **kw))
    assert exc.value.parameter == parameter and needle in exc.value.rule


def test_dense_model_refuses_expert_parallelism() -> None:
    with pytest.raises(UserError, match="needs a Mixture-of-Experts model"):
        synthesize(PRESETS["llama3-8b"].with_overrides(layers=2), ParallelConfig(dp=4, ep=2, seq_len=SEQ))


def test_allgather_dispatcher_gathers_tokens_over_ep() -> None:
    """Megatron's allgather dispatcher: the tokens (not their top-k copies) are all-gathered
    over ep and the combined outputs reduce-scattered back; no all-to-all."""
    m = TINY.with_overrides(layers=1)
    par = ParallelConfig(dp=8, ep=4, micro_batch=1, global_batch=8, seq_len=SEQ, moe_token_dispatcher="allgather")
    nodes = [n for n in _nodes(synthesize(m, par)) if n.type == COLL and n.group == "ep"]
    fwd = [n for n in nodes if n.phase == "fwd"]
    assert {n.coll.value for n in nodes} == {"ALL_GATHER", "REDUCE_SCATTER"}
    gathers = [n for n in fwd if n.coll.value == "ALL_GATHER"]
    assert [n.comm_bytes for n in gathers if n.name == "layer0.mlp_norm@expert.ag_ep"] == [SEQ * m.hidden * 2]
    rs = [n for n in fwd if n.coll.value == "REDUCE_SCATTER"]
    assert [n.comm_bytes for n in rs] == [4 * SEQ * m.hidden * 2]      # the gathered tokens' sums


def test_shared_experts_wait_for_the_routed_ones_unless_overlapped() -> None:
    m = TINY_MLA.with_overrides(mtp_num_layers=0)
    par = ParallelConfig(dp=4, ep=4, micro_batch=1, global_batch=4, seq_len=SEQ)
    for overlap in (False, True):
        role = synthesize(m.with_overrides(moe_shared_expert_overlap=overlap), par).role(0)
        by_name = {n.name: n for n in role.nodes if n.micro_batch == 0 and n.phase == "fwd"}
        fc1 = by_name["layer1.shared_experts.fc1"]
        combine = by_name["layer1.combine"]
        assert (combine.id in fc1.deps) != overlap


@pytest.mark.skipif(not os.environ.get("ASTRA_SIM_BIN"), reason="needs the ASTRA-sim binary (ASTRA_SIM_BIN)")
def test_real_astra_sim_runs_moe_exports(tmp_path: Path) -> None:
    """All-to-all collectives on the ep groups validate, every rank of the real binary finishes,
    and the built-in astra model agrees with it."""
    from stage_cosim.adapters.astra_sim.backend import simulate_astra_sim
    from stage_cosim.adapters.simulate import simulate
    from stage_cosim.hardware.cluster import resolve_cluster

    m = TINY.with_overrides(layers=2)
    par = ParallelConfig(dp=4, tp=2, pp=2, ep=4, sp=True, micro_batch=1, global_batch=8, seq_len=SEQ, zero=1)
    w = synthesize(m, par)
    cluster = resolve_cluster("dgx-h100:16")
    real = simulate_astra_sim(w, cluster, binary=os.environ["ASTRA_SIM_BIN"], keep=tmp_path / "run")
    ours = simulate(w, cluster, "astra").result
    assert len(real.config["astra_sim"]["per_rank_finished_ns"]) == 16
    assert ours.step_time_s == pytest.approx(real.step_time_s, rel=0.01)


# -- load imbalance: what routing can do ------------------------------------------------------

def _busiest_rank_bound(num_experts: int, topk: int, ep: int) -> float:
    """By enumeration: a token picks topk distinct experts; the most copies of it one expert
    rank (experts [0, E/ep)) can receive, over its mean share topk/ep. Every token routing
    that way is the worst case for the whole batch."""
    local = set(range(num_experts // ep))
    most = max(len(local & set(c)) for c in itertools.combinations(range(num_experts), topk))
    return most / (topk / ep)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_imbalance_is_bounded_by_what_routing_can_do(ep) -> None:
    """--moe-imbalance is at most ep * min(topk, E/ep) / topk (1 with one expert rank): the
    bound is accepted, anything above it refused in one line that states it."""
    for m in (TINY, TINY.with_overrides(num_experts=16, moe_router_topk=6)):
        bound = _busiest_rank_bound(m.num_experts, m.moe_router_topk, ep)
        base = dict(dp=8, ep=ep, micro_batch=1, global_batch=8, seq_len=SEQ)
        ParallelConfig(**base, moe_imbalance=bound).check_against(m)
        with pytest.raises(UserError) as exc:
            ParallelConfig(**base, moe_imbalance=bound * 1.01).check_against(m)
        assert exc.value.parameter == "moe-imbalance"
        assert f"ep*min(topk, num-experts/ep)/topk = {ep}*min(" in exc.value.rule and f"= {bound:g} " in exc.value.rule
        assert ("with ep 1" in exc.value.rule) == (ep == 1)
    assert TINY.moe_router_topk == 2 and _busiest_rank_bound(8, 2, 8) == 4     # one expert per rank: 8 * 1/2


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.5, True])
def test_imbalance_must_be_a_finite_number_of_at_least_one(value) -> None:
    with pytest.raises(UserError) as exc:
        ParallelConfig(dp=8, ep=8, moe_imbalance=value)
    assert exc.value.parameter == "moe-imbalance" and "finite number >= 1" in exc.value.rule


def test_dense_model_refuses_an_imbalance() -> None:
    with pytest.raises(UserError) as exc:
        synthesize(PRESETS["llama3-8b"].with_overrides(layers=2), ParallelConfig(dp=4, moe_imbalance=1.5, seq_len=SEQ))
    assert exc.value.parameter == "moe-imbalance" and "needs a Mixture-of-Experts model" in exc.value.rule


@pytest.mark.parametrize("args, parameter", [
    (("--moe-imbalance", "inf", "--ep", "2", "--dp", "2"), "moe-imbalance"),
    (("--moe-imbalance", "1e300", "--ep", "2", "--dp", "2"), "moe-imbalance"),     # above the bound (2)
    (("--moe-imbalance", "9", "--ep", "2", "--dp", "2"), "moe-imbalance"),
    (("--moe-imbalance", "1.5", "--dp", "2"), "moe-imbalance"),                    # ep 1
    (("--moe-capacity-factor", "inf", "--moe-pad-to-capacity", "--ep", "2", "--dp", "2"), "moe-capacity-factor"),
    (("--expert-tp", "3", "--tp", "2", "--dp", "2", "--sp"), "expert-tp"),
])
def test_cli_refuses_impossible_expert_settings_in_one_line(run_cli, args, parameter) -> None:
    code, out, err = run_cli("simulate", "--model", "mixtral-8x7b", "--layers", "2", "--seq-len", "512",
                             "--cluster", "dgx-h100:2", *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith(f"error: {parameter}: ")


# -- costs: grouped GEMMs, all-to-all, the shared experts' overlap ------------------------------

def _fwd_node(w, name: str, micro_batch: int = 0):
    return next(n for n in _nodes(w) if n.name == name and n.phase == "fwd" and n.micro_batch == micro_batch)


def _replayed(w, cluster):
    """Every node's (start, end) on stage 0 in the exact replay."""
    from stage_cosim.adapters.roofline.simulate import simulate

    _, rep, _ = simulate(w, cluster, exact=True)
    return {i: (rep.start[0][i], rep.end[0][i]) for i in range(len(rep.start[0]))}


def test_grouped_gemm_efficiency_falls_off_for_small_experts() -> None:
    """The experts' fc1 is one grouped GEMM of the rank's E/ep experts, each a GEMM of
    (tokens per expert) x h x 2f; it runs at the efficiency of that per-expert shape:
    t = max(FLOPs / (peak * eff * Fe / (Fe + half)), bytes / (HBM * mem_eff)) + overhead.
    Cutting the same expert FLOPs into 4x as many 4x smaller experts (topk 4x, f / 4) is slower
    by the curve's ratio."""
    from stage_cosim.hardware import resolve_cluster

    cluster = resolve_cluster("dgx-h100:4")
    g = cluster.gpu
    h, seq, ep = 1024, 1024, 4
    times = {}
    for e, k, f in ((8, 2, 1024), (32, 8, 256)):
        m = ModelConfig.build("grouped", "llama", layers=1, hidden=h, ffn=4096, heads=8, kv_heads=8, vocab=1024,
                              max_seq=4096, num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=f)
        w = synthesize(m, ParallelConfig(dp=4, ep=ep, micro_batch=1, global_batch=4, seq_len=seq))
        fc1 = _fwd_node(w, "layer0.experts.fc1")
        local, copies = e // ep, seq * k                  # balanced: the rank receives seq * k copies
        per_expert = copies // local
        fe = 2 * per_expert * h * 2 * f                   # gate and up projections of one expert
        assert (fc1.groups, fc1.flops) == (local, local * fe)
        nbytes = 2 * (copies * h + local * h * 2 * f + copies * 2 * f)     # bf16 tokens in, weights, out
        t_flops = local * fe / (g.bf16_tflops * 1e12 * g.matmul_efficiency * fe / (fe + g.matmul_half_flops))
        t_mem = nbytes / (g.hbm_GBps * 1e9 * g.memory_efficiency)
        assert t_flops > t_mem                            # compute-bound: the curve sets the time
        start, end = _replayed(w, cluster)[fc1.id]
        assert end - start == pytest.approx(t_flops + g.kernel_overhead_us * 1e-6, rel=1e-9)
        times[e] = (end - start, fe)
    (coarse, fe_c), (fine, fe_f) = times[8], times[32]
    curve = (fe_f + g.matmul_half_flops) / fe_f * fe_c / (fe_c + g.matmul_half_flops)
    overhead = g.kernel_overhead_us * 1e-6
    assert fine > coarse and (fine - overhead) / (coarse - overhead) == pytest.approx(curve, rel=1e-9)


@pytest.mark.parametrize("gpus, ep", [(8, 8), (16, 16), (16, 4)])
def test_all_to_all_costs_nvlink_inside_a_node_and_the_nic_across(gpus, ep) -> None:
    """NCCL's all-to-all: each rank sends 1/n of its buffer to every peer; the m - 1 peers in
    its node over NVLink, the n - m others over the NIC, the slower side sets the time:
    max((m - 1) (B/n / bw_nvlink + lat_nvlink), (n - m) B/n / bw_nic + lat_nic [if it spans nodes]).
    B: the rank's routed copies at the busiest rank's load (here 1.5)."""
    from stage_cosim.hardware import resolve_cluster

    cluster = resolve_cluster(f"dgx-h100:{gpus}")
    g, up, out = cluster.gpu, cluster.scale_up, cluster.scale_out
    m = TINY.with_overrides(layers=1, num_experts=16)
    # ep innermost over dp: with 16 GPUs and ep 4 the groups stay in a node; ep 16 spans two
    w = synthesize(m, ParallelConfig(dp=gpus, ep=ep, micro_batch=1, global_batch=gpus, seq_len=SEQ,
                                     moe_imbalance=1.5))
    a2a = _fwd_node(w, "layer0.dispatch.a2a_ep")
    nbytes = 1.5 * SEQ * m.moe_router_topk * m.hidden * 2
    assert a2a.comm_bytes == nbytes
    per_node = min(ep, 8)
    nvlink = (per_node - 1) * (nbytes / ep / (up.bandwidth_GBps * 1e9 * g.scale_up_efficiency) + up.latency_ns * 1e-9)
    nic = 0.0
    if ep > per_node:
        bw_nic = out.bandwidth_GBps / out.oversubscription * 1e9 * g.scale_out_efficiency
        nic = (ep - per_node) * nbytes / ep / bw_nic + out.latency_ns * 1e-9
    start, end = _replayed(w, cluster)[a2a.id]
    assert end - start == pytest.approx(max(nvlink, nic), rel=1e-12)
    assert ep <= per_node or nic > nvlink           # across nodes the NIC is the bottleneck


def test_shared_experts_compute_while_the_dispatch_is_in_flight() -> None:
    """--moe-shared-expert-overlap: in the replayed timeline the shared experts' three kernels
    run inside the dispatch all-to-all (here longer than them: it crosses two nodes), and the
    step is shorter by exactly their time, once per MoE layer and micro-batch."""
    from stage_cosim.adapters.roofline.compute import ComputeModel
    from stage_cosim.adapters.roofline.simulate import simulate
    from stage_cosim.hardware import resolve_cluster

    cluster = resolve_cluster("dgx-h100:16")
    par = ParallelConfig(dp=16, ep=16, micro_batch=8, global_batch=256, seq_len=SEQ)     # 2 micro-batches
    steps, kernels = {}, None
    for overlap in (False, True):
        m = TINY_MLA.with_overrides(mtp_num_layers=0, num_experts=16, moe_shared_expert_overlap=overlap)
        w = synthesize(m, par)
        times = _replayed(w, cluster)
        steps[overlap] = (simulate(w, cluster, exact=True).result.step_time_s, simulate(w, cluster).result.step_time_s)
        shared = [_fwd_node(w, f"layer1.shared_experts.{k}") for k in ("fc1", "swiglu", "fc2")]
        a2a = times[_fwd_node(w, "layer1.dispatch.a2a_ep").id]
        inside = a2a[0] <= times[shared[0].id][0] and times[shared[-1].id][1] <= a2a[1]
        assert inside == overlap
        kernels = sum(ComputeModel(cluster.gpu).node_duration_s(n) for n in shared)
        assert kernels < a2a[1] - a2a[0]
    moe_layers, micro_batches = sum(TINY_MLA.moe_layers()), par.num_microbatches
    for exact in (0, 1):          # the full replay and the fast path agree
        saved = steps[False][exact] - steps[True][exact]
        assert saved == pytest.approx(moe_layers * micro_batches * kernels, rel=1e-9)


@pytest.mark.parametrize("precision", [{}, dict(dtype="fp8", fp8_recipe="blockwise", fp8_dispatch=True)])
def test_fast_path_shortcuts_leave_the_result_unchanged(monkeypatch, precision) -> None:
    """The fast path times each kind of block once for all the stages whose groups lie alike,
    and builds each stage's first forward (beside the step-start parameter gathers) from those
    block runs: the result is the one with every stage timing its own blocks and the first
    forward replayed node by node with the gathers (to rounding)."""
    from stage_cosim.adapters.roofline import fast, network
    from stage_cosim.adapters.roofline.simulate import simulate
    from stage_cosim.hardware import resolve_cluster

    cluster = resolve_cluster("dgx-h100:16")
    m = TINY_MLA.with_overrides(layers=5, moe_layer_freq=(0, 1, 1, 1, 1), mtp_num_layers=0)
    par = ParallelConfig(dp=8, ep=4, pp=2, micro_batch=1, global_batch=32, seq_len=SEQ, zero=1, **precision)
    w = synthesize(m, par, cluster.gpu)
    composed = []
    first_forward = fast._first_forward_composed
    monkeypatch.setattr(fast, "_first_forward_composed", lambda *a, **k: composed.append(first_forward(*a, **k))
                        or composed[-1])
    quick = simulate(w, cluster).result
    assert len(composed) == par.pp and all(run is not None for run in composed)
    monkeypatch.setattr(fast, "_first_forward_composed", lambda *a, **k: None)
    monkeypatch.delattr(network.CalibratedNetwork, "placement_key")
    slow = simulate(w, cluster).result
    assert quick.step_time_s == pytest.approx(slow.step_time_s, rel=1e-12)
    for a, b in zip(quick.roles, slow.roles):
        assert a.finish_s == pytest.approx(b.finish_s, rel=1e-12)
        assert a.breakdown == pytest.approx(b.breakdown, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("experts, topk, groups, group_topk, domains", [
    (8, 2, 4, 2, 2), (8, 2, 4, 2, 4), (8, 2, 4, 2, 8), (8, 3, 8, 3, 4), (12, 3, 6, 2, 3), (16, 4, 4, 2, 8),
])
def test_domains_a_token_reaches_by_exhaustive_enumeration(experts, topk, groups, group_topk, domains) -> None:
    """The expected number of domains a token's experts lie in, against every equally likely
    choice enumerated: group_topk of the groups, then topk experts among theirs (experts in
    order on the domains)."""
    from fractions import Fraction
    from itertools import combinations

    from stage_cosim.adapters.roofline.routing import TokenRouting

    per_group, per_domain = experts // groups, experts // domains
    total, count = Fraction(0), 0
    for chosen in combinations(range(groups), group_topk):
        pool = [e for g in chosen for e in range(g * per_group, (g + 1) * per_group)]
        for picked in combinations(pool, topk):
            total += len({e // per_domain for e in picked})
            count += 1
    routing = TokenRouting(experts, topk, groups, group_topk)
    assert routing.domains_reached(domains) == pytest.approx(float(total / count), rel=1e-12)
    assert routing.remote_domains(domains) == pytest.approx(float(total / count) * (domains - 1) / domains, rel=1e-12)


def test_deepseek_v3_routing_reaches_fewer_nodes_than_its_experts() -> None:
    """DeepSeek-V3 on EP64 over 8 nodes (one expert group per node): a token's 8 experts lie in
    at most 4 nodes (its 4 best groups), 3.63 on average; deduplicated, 3.18 copies cross the
    network instead of the 7 of one copy per expert (7/8 of them remote)."""
    from stage_cosim.adapters.roofline.routing import TokenRouting
    from stage_cosim.model import get_preset
    from stage_cosim.parallel import ParallelConfig

    model = get_preset("deepseek-v3")
    assert TokenRouting.of(model, ParallelConfig(ep=64, dp=64)) is None      # alltoall: every copy
    routing = TokenRouting.of(model, ParallelConfig(ep=64, dp=64, moe_token_dispatcher="flex"))
    assert routing == TokenRouting(256, 8, 8, 4)
    assert 3.5 < routing.domains_reached(8) < 4 and routing.remote_domains(8) < 7 * 8 / 8 / 2


def test_flex_dispatch_sends_each_token_once_per_node(run_cli, tmp_path) -> None:
    """The flex dispatcher's all-to-all, worked by hand on DeepSeek-V3's routing across 8 DGX
    H100 nodes (EP 64): a rank's 4,096 tokens of 7,168 FP8 elements cross its NIC 3.18 times
    each on average (the plain all-to-all: 7 of their 8 copies), so the time is those bytes at
    the NIC's achievable rate plus one latency (NVLink carries less). End to end, a model with
    experts over two nodes exposes less expert-parallel time with flex, and its traces replay to
    the same step."""
    from stage_cosim.adapters.roofline.network import CalibratedNetwork
    from stage_cosim.adapters.roofline.routing import TokenRouting
    from stage_cosim.hardware import resolve_cluster

    cluster = resolve_cluster("dgx-h100:64")
    routing = TokenRouting(256, 8, 8, 4)
    net = CalibratedNetwork(cluster, routing=routing)
    nbytes, members = 4096 * 8 * 7168, list(range(64))
    bw_out = cluster.scale_out.bandwidth_GBps / cluster.scale_out.oversubscription * 1e9 \
        * cluster.gpu.scale_out_efficiency
    expected = 4096 * 7168 * routing.remote_domains(8) / bw_out + cluster.scale_out.latency_ns * 1e-9
    assert net.routed_all_to_all(nbytes, members) == pytest.approx(expected, rel=1e-12)
    assert net.collective("ALL_TO_ALL", nbytes, members, [0.0] * 64, kind="ep")[0] == pytest.approx(expected)
    plain = CalibratedNetwork(cluster).duration("ALL_TO_ALL", nbytes, members)
    assert plain == pytest.approx(nbytes * 56 / 64 / bw_out + cluster.scale_out.latency_ns * 1e-9, rel=1e-12)
    assert net.collective("ALL_TO_ALL", nbytes, members, [0.0] * 64, kind="cp")[0] == plain   # only ep's

    args = ["--model", "qwen3-30b-a3b", "--layers", "4", "--ep", "16", "--global-batch", "16", "--seq-len", "1024"]
    runs = {}
    for dispatcher in ("alltoall", "flex"):
        code, out, err = run_cli("simulate", *args, "--cluster", "dgx-h100:16", "--moe-token-dispatcher", dispatcher,
                                 "--json")
        assert code == 0, err
        runs[dispatcher] = json.loads(out)
    assert runs["flex"]["breakdown"]["exposed_ep"] < runs["alltoall"]["breakdown"]["exposed_ep"]
    code, _, err = run_cli("synth", *args, "--dp", "16", "--moe-token-dispatcher", "flex", "--out", str(tmp_path / "t"))
    assert code == 0, err
    code, out, err = run_cli("simulate", "--traces", str(tmp_path / "t"), "--cluster", "dgx-h100:16", "--json")
    assert code == 0, err
    assert json.loads(out)["step_time_s"] == pytest.approx(runs["flex"]["step_time_s"], rel=1e-9)


def test_megatron_launch_names_the_flex_dispatcher_and_the_router_groups() -> None:
    from stage_cosim.launch import emit

    model = PRESETS["deepseek-v3"]
    args = emit("megatron", model, ParallelConfig(dp=64, ep=64, pp=1, zero=1, moe_token_dispatcher="flex",
                                                  global_batch=64)).arguments
    text = " ".join(args)
    assert "--moe-token-dispatcher-type flex --moe-enable-deepep" in text
    assert "--moe-router-num-groups 8 --moe-router-group-topk 4" in text
