"""FP8 training against closed forms and rules the calibration and the search must respect: the
shipped FP8 GEMM curve against the BF16 one, FP8 parameter gathers under ZeRO-3, the delayed-
scaling update kernel, the FP8 weight cache in the search's memory check, and the one-line
refusals of a precision the GPU (or the options) cannot run."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.hardware import resolve_cluster
from stage_cosim.hardware.gpu import HAND_SET, get_gpu, gpu_records
from stage_cosim.model import ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.schedule.nodes import COLL, COMP
from stage_cosim.workload import synthesize
from template_rows import Row, template_rows

H100 = get_gpu("H100-SXM")
FP32 = 4


@pytest.fixture
def llama_tiny() -> ModelConfig:
    return ModelConfig.build("llama-tiny", "llama", layers=2, hidden=1024, ffn=2816, heads=16, kv_heads=4,
                             vocab=32000, max_seq=4096)


def _layer_params(m: ModelConfig) -> tuple[int, int]:
    """(GEMM weights, norm weights) of one Llama layer, from its dimensions."""
    qkv = m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim
    proj = m.heads * m.head_dim * m.hidden
    mlp = m.hidden * 2 * m.ffn + m.ffn * m.hidden
    return qkv + proj + mlp, 2 * m.hidden


# -- the shipped calibration ---------------------------------------------------------------------

@pytest.mark.parametrize("gpu", ["H100-SXM", "H800", "H200"])
def test_fp8_gemms_reach_less_of_their_peak_than_bf16_and_fall_off_later(gpu: str) -> None:
    """Transformer Engine's FP8 GEMMs run at a lower fraction of the (twice as high) FP8 peak
    than BF16 GEMMs of the same shape reach of theirs, and need more work per kernel before
    that fraction saturates. Checked on the parameters the calibration fitted to the published
    runs, over GEMMs from 10 MFLOP to 10 PFLOP."""
    g = get_gpu(gpu)
    source = gpu_records()[gpu]["efficiencies"]["default"]["fp8_matmul_efficiency"]["source"]
    assert not source.startswith(HAND_SET), "the H100 family's FP8 curve is fitted"
    cm = ComputeModel(g)
    for flops in np.logspace(7, 16, 37):
        bf16 = cm.matmul_rate(flops, "bf16") / (g.bf16_tflops * 1e12)
        fp8 = cm.matmul_rate(flops, "fp8") / (g.fp8_tflops * 1e12)
        assert fp8 < bf16
    assert g.fp8_matmul_half_flops > g.matmul_half_flops
    assert g.fp8_matmul_efficiency < g.matmul_efficiency


def test_default_fp8_curve_is_the_calibration_files() -> None:
    """A GPU built without a record (a hypothetical one) gets the same FP8 defaults the records
    hand-set where no fit pins them (the A100 family, without FP8 tensor cores)."""
    from stage_cosim.hardware.gpu import GPU

    d = {k: v["value"] for k, v in gpu_records()["A100-80GB"]["efficiencies"]["default"].items()
         if v["source"].startswith(HAND_SET)}
    bare = GPU(name="x", bf16_tflops=1000, fp8_tflops=2000, hbm_GiB=80, hbm_GBps=3000, nvlink_GBps=450,
               scaleout_GBps=50, matmul_efficiency=0.7, matmul_half_flops=1e9, attention_efficiency=0.5,
               memory_efficiency=0.8, kernel_overhead_us=3, scale_up_efficiency=0.8, scale_out_efficiency=0.8)
    assert bare.fp8_matmul_efficiency == d["fp8_matmul_efficiency"]
    assert bare.fp8_matmul_half_flops == d["fp8_matmul_half_flops"]


def test_template_rows_read_as_the_nodes_they_become(llama_tiny) -> None:
    """The tests read pass templates through template_rows.Row: each field is the attribute of
    the Node the row becomes when a later micro-batch's pass is placed."""
    par = ParallelConfig(tp=2, micro_batch=1, global_batch=2, seq_len=512, dtype="fp8")
    role = synthesize(llama_tiny, par, H100).role(0)
    for phase in ("fwd", "bwd"):
        rows = template_rows(role, (0, phase))
        placed = [n for n in role.nodes if n.micro_batch == 1 and n.chunk == 0 and n.phase in (phase, "recompute")
                  and n.name in {r.name for r in rows}]
        assert [n.name for n in placed] == [r.name for r in rows]
        for r, n in zip(rows, placed):
            same = set(Row._fields) - {"deps", "tag"}          # ids and tags are placed relative to the pass
            assert {f: getattr(r, f) for f in same} == {f: getattr(n, f) for f in same}, r.name


# -- FP8 parameter gathers under ZeRO-3 --------------------------------------------------------------

def test_fp8_param_gather_halves_the_zero3_gathers(llama_tiny) -> None:
    """ZeRO-3 all-gathers each layer's parameters before its forward and again before its
    backward; with FP8 parameters the GEMM weights travel as one byte each, the norms stay
    BF16. Each rank contributes its 1/dp shard."""
    dp = 4
    gemm, norms = _layer_params(llama_tiny)

    def gathers(fp8_param_gather: bool) -> dict[str, int]:
        par = ParallelConfig(dp=dp, zero=3, micro_batch=2, global_batch=8, seq_len=512, dtype="fp8",
                             fp8_param_gather=fp8_param_gather)
        role = synthesize(llama_tiny, par, H100).role(0)
        rows = [r for key in role.templates for r in template_rows(role, key)]
        return {r.name: r.comm_bytes for r in rows if r.type == COLL and r.block == "layer0" and "zero3_gather" in r.name}

    bf16, fp8 = gathers(False), gathers(True)
    assert set(bf16) == set(fp8) == {"layer0.fwd.zero3_gather", "layer0.bwd.zero3_gather"}
    for name in bf16:
        assert bf16[name] == 2 * (gemm + norms) // dp
        assert fp8[name] == (gemm + 2 * norms) // dp
    assert fp8["layer0.fwd.zero3_gather"] < 0.501 * bf16["layer0.fwd.zero3_gather"]


# -- delayed scaling's update kernel -----------------------------------------------------------------

@pytest.mark.parametrize("history", [1, 16, 1024])
def test_scale_update_kernel_bytes(llama_tiny, history: int) -> None:
    """After each pass Transformer Engine updates delayed scaling's state in one kernel: for every
    FP8 tensor of the pass (input, weight and output forward; output gradient and input gradient
    backward, for each of a layer's four GEMMs) it reads the tensor's amax history and its newly
    reduced amax and writes the rolled history, the scale and the inverse scale, all fp32."""
    m = llama_tiny.with_overrides(layers=3)
    par = ParallelConfig(micro_batch=1, global_batch=2, seq_len=512, dtype="fp8", fp8_amax_history_len=history)
    role = synthesize(m, par, H100).role(0)
    tensors = {"fwd": 3, "bwd": 2}
    seen = set()
    for key in role.templates:
        for r in template_rows(role, key):
            if r.type == COMP and r.name.endswith("fp8_scale_update"):
                entries = 4 * m.layers * tensors[r.phase]
                assert r.mem_bytes == FP32 * entries * (history + 1 + history + 2)
                seen.add(r.phase)
    assert seen == {"fwd", "bwd"}


# -- the search counts the FP8 weight cache ------------------------------------------------------------

def test_search_rejects_fp8_configuration_whose_weight_cache_does_not_fit(llama_tiny) -> None:
    """A GPU whose memory holds everything of an FP8 configuration but its cached FP8 weight
    copies: the search's evaluation refuses it for memory, and accepts it on a GPU with room for
    the cache."""
    from stage_cosim.search.evaluate import MEMORY_REASON, Objective, evaluate

    m = llama_tiny.with_overrides(layers=8)
    par = ParallelConfig(micro_batch=1, global_batch=4, seq_len=512, dtype="fp8")
    base = resolve_cluster("dgx-h100:1")
    mem = synthesize(m, par, H100).memory(0, base)       # with the process's runtime memory
    assert mem.fp8_weight_cache == 2 * _layer_params(m)[0] * m.layers     # FP8 copy + transpose

    def on(capacity_bytes: float):
        cluster = replace(base, gpu=base.gpu.with_overrides(hbm_GiB=capacity_bytes / 2**30))
        return evaluate(m, cluster, par, {}, Objective(), headroom=0.0)

    short = on(mem.total - mem.fp8_weight_cache / 2)
    assert not short.feasible and short.reason == MEMORY_REASON
    assert on(mem.total + 2**20).feasible


# -- a precision the GPU or the options cannot run: one line, before any search --------------------------

OPTIMIZE = ("optimize", "--model", "llama3-8b", "--layers", "2", "--cluster", "dgx-h100:8", "--global-batch", "8",
            "--seq-len", "2048", "--budget", "2", "--quiet")


@pytest.mark.parametrize("flags,message", [
    (("--fp8-recipe", "delayed"), "error: fp8-recipe: needs --dtype fp8"),
    (("--fp8-attention",), "error: fp8-attention: needs --dtype fp8"),
    (("--dtype", "fp8", "--fp8-recipe", "mxfp8"), "error: fp8-recipe: mxfp8 needs block-scaled (MXFP8) tensor cores, "
                                                  "which H100-SXM does not have"),
])
def test_optimize_refuses_a_precision_it_cannot_search(run_cli, flags, message) -> None:
    code, out, err = run_cli(*OPTIMIZE, *flags)
    assert code == 2 and out == ""
    assert err.startswith(message) and len(err.strip().splitlines()) == 1


def test_optimize_fixed_fp8_on_a_gpu_without_fp8(run_cli) -> None:
    code, _, err = run_cli(*OPTIMIZE[:5], "--cluster", "dgx-a100:8", *OPTIMIZE[7:], "--dtype", "fp8")
    assert code == 2 and err.strip() == "error: dtype: fp8 needs FP8 tensor cores; A100-80GB has none " \
                                        "(its gpu.fp8_tflops is not set)"


@pytest.mark.parametrize("spec,message", [
    (dict(baseline="dgx-h100:16", dtype="fp8", fp8_recipe="mxfp8"), "fp8-recipe: mxfp8 needs block-scaled"),
    (dict(baseline="dgx-a100:16", dtype="fp8"), "dtype: fp8 needs FP8 tensor cores; A100-80GB has none"),
    (dict(baseline="dgx-h100:16", fp8_recipe="delayed"), "fp8-recipe: needs --dtype fp8"),
])
def test_explore_says_what_the_baseline_gpu_cannot_run(spec, message) -> None:
    from stage_cosim.errors import UserError
    from stage_cosim.search.explore_spec import spec_from_dict

    doc = dict(model="llama3-8b", global_batch=32, seq_len=1024, variables={"gpu.hbm_GBps": {"min": 2000, "max": 4000}},
               cost={"base": 10000}) | spec
    with pytest.raises(UserError) as e:
        spec_from_dict(doc)
    assert f"{e.value.parameter}: {e.value.rule}".startswith(message)
