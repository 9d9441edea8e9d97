"""Per-rank memory against Korthikanti et al. (MLSys 2023), Figure 1 / Table 5 configurations."""

from __future__ import annotations

import pytest

from stage_cosim.model import get_preset
from stage_cosim.parallel import ParallelConfig
from stage_cosim.schedule.pipeline import interleaved, one_f_one_b, peak_in_flight
from stage_cosim.validation.published import korthikanti_memory, korthikanti_table5
from stage_cosim.workload import synthesize

GiB = 1 << 30
RUNS = {run.model.name.split("-")[1]: run for run in korthikanti_table5() if run.recompute == "full"}


def _first_stage(run, *, sp: bool, recompute: str):
    par = ParallelConfig(dp=run.dp, tp=run.tp, pp=run.pp, vp=run.vp, micro_batch=run.micro_batch,
                         global_batch=run.global_batch, seq_len=run.seq_len, sp=sp, recompute=recompute)
    return synthesize(run.model, par).memory(0)


@pytest.mark.parametrize("name", ["22B", "175B", "530B", "1T"])
def test_korthikanti_memory(name: str) -> None:
    run = RUNS[name]
    ref = korthikanti_memory()[name]
    plain = _first_stage(run, sp=False, recompute="none")
    selective = _first_stage(run, sp=True, recompute="selective")
    # The paper's model-state figure is 18 B/param of the transformer layers (12 l h^2 / (t p)).
    assert plain.states_layers / GiB == pytest.approx(ref["weights_grads_optimizer_GiB"], rel=0.03)
    assert plain.activations / GiB == pytest.approx(ref["activations_no_recompute_GiB"], rel=0.05)
    assert selective.activations / GiB == pytest.approx(ref["activations_selective_seqpar_GiB"], rel=0.05)


def test_activation_formula_one_layer(gpt_small) -> None:
    """sbh(34 + 5as/h) bytes per layer without parallelism (Korthikanti eq. 1), plus the two
    norms' fp32 statistics (16 B per token), for one layer and one micro-batch."""
    m = gpt_small.with_overrides(layers=1)
    s, b, h, a = 1024, 2, m.hidden, m.heads
    w = synthesize(m, ParallelConfig(micro_batch=b, seq_len=s))
    from stage_cosim.sharding.numeric import compiled_blocks
    from stage_cosim.sharding.steps import ShardingPolicy
    from stage_cosim.graph.dims import degree_symbol, model_values
    layer = compiled_blocks(m.switches(), ShardingPolicy()).layer
    values = model_values(m, b, s) | {degree_symbol(a): d for a, d in ParallelConfig().degrees().items()}
    saved = layer.evaluate(values).saved_bytes
    assert saved == s * b * h * (34 + 5 * a * s / h) + 16 * s * b
    assert w.memory(0).activations > saved  # plus the embedding and the loss


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_1f1b_in_flight(pp: int) -> None:
    """Stage i of p holds up to p - i micro-batches under 1F1B."""
    for stage in range(pp):
        assert peak_in_flight(one_f_one_b(pp, stage, 4 * pp)) == pp - stage


@pytest.mark.parametrize("pp,vp", [(2, 2), (4, 2), (8, 3)])
def test_interleaved_first_stage_in_flight(pp: int, vp: int) -> None:
    """Korthikanti sec. 4.2.3: interleaving stores L(1 + (p-1)/(p v)) layers' activations on
    the first stage, i.e. p v + p - 1 model chunks of L/(p v) layers."""
    order = interleaved(pp, 0, 4 * pp, vp)
    assert peak_in_flight(order) == pp * vp + pp - 1
    # every (micro-batch, chunk) runs forward and backward exactly once
    assert sorted((p.micro_batch, p.chunk) for p in order if p.phase == "fwd") == \
        sorted((p.micro_batch, p.chunk) for p in order if p.phase == "bwd") == \
        sorted((mb, c) for mb in range(4 * pp) for c in range(vp))


def test_zero_stages_shrink_model_states(llama_small) -> None:
    mems = [synthesize(llama_small, ParallelConfig(dp=4, global_batch=4, seq_len=256, zero=z)).memory(0)
            for z in range(4)]
    params = mems[0].weights / 2
    dp = 4
    assert mems[1].optimizer == pytest.approx(12 * params / dp, rel=1e-6)
    assert mems[1].gradients == mems[0].gradients
    assert mems[2].gradients == pytest.approx(4 * params / dp, rel=1e-6)
    assert mems[3].weights == pytest.approx(2 * params / dp, rel=1e-6)


# -- what a real run holds beside its tensors (runtime memory) -----------------------------------
# NCCL: one connection's buffers, NCCL's defaults (init.cc): SIMPLE 4 MiB, LL 8 lines x 512
# threads x 8 steps x 16 B, LL128 120 elements x 640 threads x 8 steps x 8 B.
CONNECTION = 4 * 2**20 + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8
MiB = 2**20


def _runtime(model, cluster_name: str, **kw):
    from stage_cosim.hardware import resolve_cluster

    par = ParallelConfig(**kw)
    cluster = resolve_cluster(cluster_name, par.world_size)
    w = synthesize(model, par, cluster.gpu)
    return w, cluster, [w.memory(s, cluster) for s in range(par.pp)]


def test_cuda_context_and_cublas_workspaces_per_gpu_generation() -> None:
    """The CUDA context is the line through two published bare contexts (555 MiB at 188 SMs,
    107 MiB at 34); cuBLAS: PyTorch's two handles' workspaces (:4096:8 = 32 MiB on Hopper,
    :4096:2:16:8 before) plus Transformer Engine's (32 MiB on Hopper and later, 4 MiB before)."""
    from types import SimpleNamespace

    from stage_cosim.hardware import get_gpu
    from stage_cosim.hardware.runtime import cublas_workspace_bytes, cuda_context_bytes

    per_sm = (555 - 107) / (188 - 34)
    for sms, mib in ((188, 555), (34, 107), (132, 107 + (132 - 34) * per_sm), (108, 107 + (108 - 34) * per_sm)):
        assert cuda_context_bytes(SimpleNamespace(sm_count=sms, arch="hopper")) == pytest.approx(mib * MiB, abs=1)
    assert 300 * 10**6 <= cuda_context_bytes(get_gpu("A100-80GB")) <= 400 * 10**6   # PyTorch's "~300-400 MB"
    assert cublas_workspace_bytes(get_gpu("H100-SXM")) == 2 * 4096 * 1024 * 8 + 32 * MiB
    assert cublas_workspace_bytes(get_gpu("A100-80GB")) == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8) + 4 * MiB


def test_nccl_buffers_quick_start_layout() -> None:
    """Llama 3 70B tp8 pp4 dp32 on DGX H100 (the quick start): the tp ring inside a node on 32
    channels (H100's 18 NVLinks, two channels each, NCCL's cap of 32); the dp ring one GPU per
    node, so 2 channels (two per NIC it uses there); pipeline receives from each neighbouring
    stage in another node on NCCL_NCHANNELS_PER_NET_PEER = 2 channels: the first and last stage
    have one neighbour, the middle ones two."""
    _, _, mems = _runtime(get_preset("llama3-70b"), "dgx-h100", tp=8, pp=4, dp=32, sp=True, zero=1,
                          global_batch=64, seq_len=4096)
    expect = [(32 + 2 + 2) * CONNECTION, (32 + 2 + 4) * CONNECTION, (32 + 2 + 4) * CONNECTION,
              (32 + 2 + 2) * CONNECTION]
    assert [m.runtime.nccl_buffers for m in mems] == expect


@pytest.mark.parametrize("cluster,channels", [("dgx-a100", 24), ("dgx-h800", 16), ("dgx-h100", 32)])
def test_nccl_channels_per_nvlink_count(llama_small, cluster: str, channels: int) -> None:
    """tp8 in one node: two channels per NVLink — HGX A100's 12 (NCCL logs 24 channels), H800's 8
    (16), H100's 18 capped at 32."""
    _, _, mems = _runtime(llama_small.with_overrides(kv_heads=16), cluster, tp=8, global_batch=1, seq_len=512)
    assert mems[0].runtime.nccl_buffers == channels * CONNECTION


def test_nccl_buffers_all_to_all_and_cp_ring(llama_small) -> None:
    """An all-to-all over ep reaches every other member point to point (inside a node: as many
    channels per peer as the ring); the cp ring of ring attention receives from one neighbour."""
    moe = get_preset("mixtral-8x7b").with_overrides(layers=2)
    _, _, mems = _runtime(moe, "dgx-h100", dp=8, ep=8, global_batch=8, seq_len=512)
    # dp ring (8 in a node) + 7 all-to-all peers; edp = 8 / 8 = 1: no expert gradient group
    assert mems[0].runtime.nccl_buffers == (32 + 7 * 32) * CONNECTION
    _, _, mems = _runtime(llama_small, "dgx-h100", tp=4, cp=2, global_batch=1, seq_len=1024)
    # tp ring, cp ring's one sender, the gradient group over cp (dp = 1)
    assert mems[0].runtime.nccl_buffers == (32 + 32 + 32) * CONNECTION


def test_fragmentation_and_runtime_are_counted(llama_small) -> None:
    """Fragmentation is the published 2.43 % (1.83 GiB beside 75.31 GiB allocated) of every byte
    of tensors; the runtime category adds into the total and the result's memory dict."""
    w, cluster, mems = _runtime(llama_small, "dgx-h100", dp=2, global_batch=4, micro_batch=2, seq_len=1024)
    m, base = mems[0], w.memory(0)
    assert base.runtime.total == 0
    assert m.runtime.fragmentation == pytest.approx(1.83 / 75.31 * base.total, abs=1)
    assert m.total == base.total + m.runtime.total
    d = m.to_dict()
    assert d["runtime"] == m.runtime.total == (d["runtime_cuda_context"] + d["runtime_cublas_workspace"]
                                               + d["runtime_nccl_buffers"] + d["runtime_fragmentation"])
    assert d["runtime_nccl_buffers"] == 32 * CONNECTION          # the dp ring of two in one node


def test_fits_in_memory_counts_the_runtime(llama_small) -> None:
    """On a GPU with room for the tensors but not for the process's own memory, the step does not
    fit (it did when the runtime counted 0)."""
    from dataclasses import replace

    from stage_cosim.adapters.roofline.simulate import simulate

    w, cluster, mems = _runtime(llama_small, "dgx-h100", global_batch=1, seq_len=1024)
    base = w.memory(0).total
    tight = replace(cluster, gpu=cluster.gpu.with_overrides(hbm_GiB=(base + mems[0].runtime.total / 2) / GiB))
    r, _, _ = simulate(w, tight)
    assert r.roles[0].memory["runtime"] == mems[0].runtime.total
    assert not r.fits_in_memory and r.peak_memory_bytes == mems[0].total


def test_inference_steps_count_the_runtime(llama_small) -> None:
    from stage_cosim.adapters.roofline.simulate import simulate
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.hardware.runtime import cublas_workspace_bytes, cuda_context_bytes
    from stage_cosim.inference import InferenceConfig

    cluster = resolve_cluster("dgx-h100", 2)
    w = synthesize(llama_small, ParallelConfig(tp=2), cluster.gpu,
                   inference=InferenceConfig("decode", batch=8, context_len=1024))
    r, _, _ = simulate(w, cluster)
    mem = r.roles[0].memory
    assert mem["runtime_cuda_context"] == cuda_context_bytes(cluster.gpu)
    assert mem["runtime_cublas_workspace"] == cublas_workspace_bytes(cluster.gpu)
    assert mem["runtime_nccl_buffers"] == 32 * CONNECTION             # the tp ring
    assert mem["total"] == sum(mem[k] for k in ("weights", "kv_cache", "workspace", "runtime"))


def test_search_default_headroom_keeps_the_runtime_free() -> None:
    """The configuration the quick-start search picked before runtime memory was counted (tp4
    pp1 dp256, micro-batch 1, sp, ZeRO-2: 76.8 GiB of tensors on an 80 GiB H100) is now refused
    for memory: its tensors fit in HBM, they and the runtime do not within HBM less the default
    margin. The configuration picked now fits with the runtime and the margin free."""
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.hardware.runtime import DEFAULT_HEADROOM
    from stage_cosim.search.evaluate import MEMORY_REASON, Objective, evaluate, workload_of
    from stage_cosim.search.optimize import OptimizeSettings

    assert OptimizeSettings().headroom == DEFAULT_HEADROOM > 0
    model, cluster = get_preset("llama3-70b"), resolve_cluster("dgx-h100:1024")
    hbm = cluster.gpu.memory_bytes
    old = ParallelConfig(tp=4, pp=1, dp=256, micro_batch=1, sp=True, zero=2, global_batch=1024, seq_len=8192)
    w = workload_of(model, old, cluster.gpu)
    assert w.memory(0).total <= hbm < (w.memory(0).total + w.memory(0, cluster).runtime.total) / (1 - DEFAULT_HEADROOM)
    e = evaluate(model, cluster, old, {}, Objective())
    assert not e.feasible and e.reason == MEMORY_REASON
    new = ParallelConfig(tp=4, cp=2, cp_comm="all-gather", pp=1, dp=128, micro_batch=1, sp=True, zero=2,
                         global_batch=1024, seq_len=8192)
    e = evaluate(model, cluster, new, {}, Objective())
    assert e.feasible
    runtime = max(role["memory"]["runtime"] for role in e.result["roles"])
    assert runtime > 2 * GiB
    assert e.result["peak_memory_bytes"] <= hbm * (1 - DEFAULT_HEADROOM)


def test_per_op_recomputation_replays_every_second_matmul() -> None:
    """torchtitan's per-op selective checkpointing (``op``), worked by hand on a dense Llama
    layer without tp: it keeps the QKV and fc1 outputs (the odd matmuls) and the attention
    kernel's, and replays the output projection and fc2, so the step's matmul FLOPs grow by
    exactly their forward, 2 * tokens * (h*h + ffn*h) per layer; and it holds less than no
    recomputation and more than full recomputation."""
    from stage_cosim.model import get_preset
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.workload import synthesize

    model = get_preset("llama3-8b").with_overrides(layers=2)
    h, ffn, tokens = model.hidden, model.ffn, 2 * 1024

    def run(recompute: str):
        par = ParallelConfig(dp=1, micro_batch=2, global_batch=2, seq_len=1024, recompute=recompute)
        return synthesize(model, par)

    none, op, full = run("none"), run("op"), run("full")
    assert op.total_matmul_flops() - none.total_matmul_flops() == 2 * 2 * tokens * (h * h + ffn * h)
    assert full.total_matmul_flops() > op.total_matmul_flops()
    peak = [w.memory(0).total for w in (none, op, full)]
    assert peak[0] > peak[1] > peak[2]
