"""Synthesized workloads against closed forms derived independently of the code."""

from __future__ import annotations

from collections import Counter

import pytest

from stage_cosim.errors import UserError
from stage_cosim.parallel import ParallelConfig
from stage_cosim.schedule.nodes import COLL, COMP
from stage_cosim.workload import synthesize

FACTORIZATIONS = [(1, 1, 1, 1), (2, 2, 2, 1), (1, 4, 2, 2), (2, 1, 4, 2), (4, 2, 1, 1), (1, 2, 4, 1)]


def gpt_flops(B: int, s: int, l: int, h: int, V: int, *, full_recompute: bool) -> float:
    """Narayanan et al. / Korthikanti et al.: matmul FLOPs of one step, whole model."""
    if full_recompute:
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


@pytest.mark.parametrize("dp,tp,pp,vp", FACTORIZATIONS)
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_matmul_flops_closed_form(gpt_small, dp, tp, pp, vp, recompute) -> None:
    B, s = 16, 1024
    par = ParallelConfig(dp=dp, tp=tp, pp=pp, vp=vp, global_batch=B, seq_len=s, recompute=recompute)
    w = synthesize(gpt_small, par)
    V = par.padded_vocab(gpt_small.vocab)
    expected = gpt_flops(B, s, gpt_small.layers, gpt_small.hidden, V, full_recompute=recompute == "full")
    assert w.total_matmul_flops() == pytest.approx(expected, rel=1e-9)
    # Model FLOPs never count recomputation.
    assert w.total_model_flops() == pytest.approx(gpt_flops(B, s, gpt_small.layers, gpt_small.hidden, V,
                                                            full_recompute=False), rel=1e-9)


def test_flops_identical_across_factorizations(llama_small) -> None:
    # A vocabulary that needs no padding at any tp, so the model is the same everywhere.
    model = llama_small.with_overrides(vocab=32768)
    totals = {synthesize(model, ParallelConfig(dp=dp, tp=tp, pp=pp, vp=vp, global_batch=16,
                                                     seq_len=512)).total_matmul_flops()
              for dp, tp, pp, vp in FACTORIZATIONS}
    assert len(totals) == 1


def test_fused_attention_flops(llama_small) -> None:
    """Flash attention's backward recomputes QK^T: 2.5x the forward executed, 2x counted.
    (The kernel run over the full s x s score matrix: causal block skipping off.)"""
    b, s, m = 1, 512, llama_small.with_overrides(causal_flops=False)
    w = synthesize(m, ParallelConfig(seq_len=s))
    fwd = [n for n in w.roles[0].nodes if n.name == "layer0.attention"]
    bwd = [n for n in w.roles[0].nodes if n.name == "layer0.attention.grad"]
    core = 4 * b * s * s * m.heads * m.head_dim
    assert fwd[0].flops == core and bwd[0].flops == core * 5 // 2 and bwd[0].model_flops == 2 * core


def test_fused_attention_flops_skip_the_causal_mask_by_default(llama_small) -> None:
    """The default: a flash kernel skips the masked blocks of the causal score matrix, so it
    executes about s^2/2 of the s^2 scores, half the full matrix (1 - w/(2s) with window w = s).
    Model FLOPs still count the whole matrix, as the published MFU formulas do."""
    b, s, m = 1, 512, llama_small
    assert m.causal_flops
    w = synthesize(m, ParallelConfig(seq_len=s))
    fwd = [n for n in w.roles[0].nodes if n.name == "layer0.attention"]
    bwd = [n for n in w.roles[0].nodes if n.name == "layer0.attention.grad"]
    core = 4 * b * s * s * m.heads * m.head_dim       # QK^T and PV over the full s x s
    assert fwd[0].flops == core // 2 and bwd[0].flops == core * 5 // 4
    assert fwd[0].model_flops == core and bwd[0].model_flops == 2 * core


def _layer_tp_collectives(w, phase: str) -> Counter:
    nodes = [n for n in w.roles[0].nodes if n.block == "layer1" and n.micro_batch == 0 and n.type == COLL
             and n.group == "tp" and n.phase == phase]
    return Counter((n.coll.short, n.comm_bytes) for n in nodes)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_allreduce_per_layer(gpt_small, tp) -> None:
    """Megatron without sp: two all-reduces of the b*s*h activation forward, two backward."""
    b, s, h = 2, 1024, gpt_small.hidden
    w = synthesize(gpt_small, ParallelConfig(tp=tp, sp=False, micro_batch=b, seq_len=s))
    act = 2 * b * s * h
    assert _layer_tp_collectives(w, "fwd") == Counter({("AR", act): 2})
    assert _layer_tp_collectives(w, "bwd") == Counter({("AR", act): 2})


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sequence_parallel_collectives_per_layer(gpt_small, tp) -> None:
    """Korthikanti et al. sec. 4.2.2: forward g/g-bar become all-gather + reduce-scatter; the
    backward conjugates them and re-gathers the sequence-sharded inputs of the two
    column-parallel GEMMs for their weight gradients. (The collectives not pipelined with their
    GEMMs: tp_comm_overlap off, which would split each into chunks.)"""
    b, s, h = 2, 1024, gpt_small.hidden
    w = synthesize(gpt_small, ParallelConfig(tp=tp, sp=True, tp_comm_overlap=False, micro_batch=b, seq_len=s))
    act = 2 * b * s * h
    # all-gather comm_size is the input shard, reduce-scatter's the full input (Chakra's convention)
    assert _layer_tp_collectives(w, "fwd") == Counter({("AG", act // tp): 2, ("RS", act): 2})
    assert _layer_tp_collectives(w, "bwd") == Counter({("AG", act // tp): 4, ("RS", act): 2})


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_default_tp_comm_overlap_pipelines_the_sp_collectives(gpt_small, tp) -> None:
    """The defaults (software profile megatron-core-0.8): sequence parallelism with tp > 1, and its
    collectives pipelined with their GEMMs (--tp-comm-overlap): each all-gather and
    reduce-scatter above is cut with its GEMM into tp chunks, the same bytes in all."""
    b, s, h = 2, 1024, gpt_small.hidden
    par = ParallelConfig(tp=tp, micro_batch=b, seq_len=s)
    assert par.sp and par.tp_comm_overlap and {"sp", "tp_comm_overlap"} <= set(par.assumed)
    w = synthesize(gpt_small, par)
    act = 2 * b * s * h
    assert _layer_tp_collectives(w, "fwd") == Counter({("AG", act // tp // tp): 2 * tp, ("RS", act // tp): 2 * tp})
    assert _layer_tp_collectives(w, "bwd") == Counter({("AG", act // tp // tp): 4 * tp, ("RS", act // tp): 2 * tp})


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_data_parallel_gradient_bytes(llama_small, zero) -> None:
    """Once per step, each rank reduces exactly its shard's gradients (fp32) over dp."""
    dp, tp, pp = 4, 2, 2
    par = ParallelConfig(dp=dp, tp=tp, pp=pp, global_batch=32, seq_len=256, zero=zero)
    w = synthesize(llama_small, par)
    m = llama_small
    V = par.padded_vocab(m.vocab)
    for stage, role in enumerate(w.roles):
        grad = [n for n in role.nodes if n.type == COLL and n.group == "dp" and n.phase == "step"
                and n.coll.short in ("AR", "RS")]
        # per rank: layers' parameters / tp (norm weights replicated), plus embedding or head
        layer = (m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.hidden
                 + 3 * m.hidden * m.ffn) // tp + 2 * m.hidden
        edge = V * m.hidden // tp + (m.hidden if stage == pp - 1 else 0)
        params = layer * (m.layers // pp) + edge
        assert sum(n.comm_bytes for n in grad) == 4 * params
        assert {n.coll.short for n in grad} == ({"AR"} if zero == 0 else {"RS"})
        # once per step: one bucket per block, whatever the number of micro-batches
        assert len(grad) == m.layers // pp + 1


def test_zero3_gathers_parameters_twice_per_microbatch(llama_small) -> None:
    dp, m = 4, llama_small
    par = ParallelConfig(dp=dp, global_batch=12, seq_len=256, zero=3)
    w = synthesize(m, par)
    role = w.roles[0]
    params = m.param_count() + (par.padded_vocab(m.vocab) - m.vocab) * m.hidden * 2
    gathers = [n for n in role.nodes if n.type == COLL and n.coll.short == "AG" and n.group == "dp"]
    per_mb = Counter()
    for n in gathers:
        per_mb[n.micro_batch] += n.comm_bytes
    assert set(per_mb) == set(range(par.num_microbatches))
    for total in per_mb.values():
        assert total == pytest.approx(2 * 2 * params / dp, rel=1e-6)   # bf16, forward + backward


@pytest.mark.parametrize("zero", [1, 3])
def test_a_blocks_first_kernel_waits_for_the_block_before(llama_small, zero) -> None:
    """Every layer's first forward kernel (its input norm) reads what the block before handed
    on, whatever else it waits for: with ZeRO-3 also its gathered weights, and then beside — not
    instead of — the previous block's exits."""
    w = synthesize(llama_small, ParallelConfig(dp=2, global_batch=2, seq_len=256, zero=zero))
    role = w.roles[0]
    by_id = {n.id: n for n in role.nodes}
    norms = [n for n in role.nodes if n.type == COMP and n.phase == "fwd" and n.name.endswith(".input_norm")]
    assert len(norms) == llama_small.layers
    for n in norms[1:]:
        previous = f"layer{int(n.block.removeprefix('layer')) - 1}."
        assert any(by_id[d].name.startswith(previous) for d in n.deps), (n.name, [by_id[d].name for d in n.deps])
        if zero == 3:
            assert any(by_id[d].type == COLL for d in n.deps)       # and its weights' gather


def test_tied_embedding_gradients_across_pipeline(gpt_small) -> None:
    w = synthesize(gpt_small, ParallelConfig(pp=2, tp=2, global_batch=4, seq_len=512))
    for role in (w.roles[0], w.roles[-1]):
        tied = [n for n in role.nodes if n.group == "embedding"]
        assert len(tied) == 1 and tied[0].coll.short == "AR"
    assert w.communicator_groups()[str(w.group_id(0, "embedding"))] == [0, 2]


def test_uneven_pipeline_split() -> None:
    """llama3.1-405b: 126 layers over 16 stages, the two end stages take one layer fewer."""
    par = ParallelConfig(pp=16, tp=8, seq_len=4096)
    assert par.layers_per_stage(126) == (7,) + (8,) * 14 + (7,)
    assert ParallelConfig(pp=4).layers_per_stage(10) == (2, 3, 3, 2)
    assert ParallelConfig(pp=4).layers_per_stage(8) == (2, 2, 2, 2)


def test_explicit_pp_layers(llama_small) -> None:
    w = synthesize(llama_small, ParallelConfig(pp=2, pp_layers=(3, 5), global_batch=2, seq_len=256))
    assert [len(r.layers) for r in w.roles] == [3, 5]


@pytest.mark.parametrize("kw, param", [
    (dict(tp=3), "tp"),
    (dict(pp=8, vp=2, global_batch=8), "pp"),
    (dict(pp=2, pp_layers=(3, 4)), "pp-layers"),
    (dict(dp=2, micro_batch=2, global_batch=6), "global-batch"),
    (dict(dp=0), "dp"),
    (dict(seq_len=-1), "seq-len"),
    (dict(zero=4), "zero"),
])
def test_bad_parallel_config(llama_small, kw, param) -> None:
    with pytest.raises(UserError) as exc:
        synthesize(llama_small, ParallelConfig(**kw))
    assert exc.value.parameter == param


def test_every_compute_node_has_costs(llama_small) -> None:
    w = synthesize(llama_small, ParallelConfig(tp=2, pp=2, dp=2, sp=True, zero=1, global_batch=8, seq_len=256))
    for role in w.roles:
        for n in role.nodes:
            if n.type == COMP:
                assert n.mem_bytes > 0, n
            if n.type == COLL:
                assert n.comm_bytes > 0, n


@pytest.mark.parametrize("impl,passes", [("fused", (1, 1)), ("unfused", (6, 2))])
def test_cross_entropy_bytes_closed_form(llama_small, impl, passes) -> None:
    """Per rank, the loss streams its vocabulary shard of the logits: bf16 logits in and fp32
    probabilities out (plus int64 labels and the fp32 loss) forward; fp32 probabilities in and
    bf16 gradient out backward. Megatron's unfused loss runs that traffic six times forward
    (cast, max, subtract, exp, sum, divide) and twice backward."""
    b, s, tp = 2, 256, 2
    model = llama_small.with_overrides(vocab=32768, cross_entropy=impl)
    w = synthesize(model, ParallelConfig(tp=tp, pp=2, micro_batch=b, global_batch=b, seq_len=s))
    last = w.role(w.role_of(w.mesh.rank(pp=1)))
    nodes = {n.name: n for n in last.nodes if n.type == COMP}
    tokens, v_local = b * s, model.vocab // tp
    forward = tokens * v_local * (2 + 4) + tokens * 8 + tokens * 4
    backward = tokens * v_local * (4 + 2) + tokens * 8 + tokens * 4   # dloss and labels in
    assert nodes["head.cross_entropy"].mem_bytes == passes[0] * forward
    assert nodes["head.cross_entropy.grad"].mem_bytes == passes[1] * backward


def test_role_nodes_created_on_demand_match_the_full_graph() -> None:
    """A pass's nodes created alone (``node(i)``) are those of the whole graph, and the FLOP
    totals taken from the pass templates equal the sum over the created nodes."""
    from stage_cosim.model import get_preset

    model = get_preset("llama3-8b").with_overrides(layers=4)
    par = ParallelConfig(dp=2, tp=2, pp=2, vp=2, global_batch=8, seq_len=512, sp=True, zero=1)
    lazy, full = synthesize(model, par), synthesize(model, par)
    for s in range(par.pp):
        role, ref = lazy.role(s), full.role(s).nodes
        totals = role.compute_totals()
        probe = [p.base + 3 for p in role.passes[::3]] + [role.num_nodes - 1, 0]
        for i in probe:
            a, b = role.node(i), ref[i]
            assert (a.id, a.name, a.type, a.deps, a.ctrl, a.flops, a.micro_batch) == \
                   (b.id, b.name, b.type, b.deps, b.ctrl, b.flops, b.micro_batch)
        comp = [n for n in ref if n.type == COMP]
        assert totals == (sum(n.flops for n in comp), sum(n.model_flops for n in comp),
                          sum(n.flops for n in comp if n.matmul))
        assert [(n.name, n.deps) for n in role.nodes] == [(n.name, n.deps) for n in ref]
