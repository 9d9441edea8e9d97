"""FP8 training: Transformer Engine's kernels, bytes and memory per recipe, against closed forms
written from the mechanism (which tensors are cast, transposed, reduced; how many bytes each
element of a quantized tensor takes), and the step-time bounds an FP8 step must respect."""

from __future__ import annotations

from fractions import Fraction

import pytest

from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.errors import UserError
from stage_cosim.hardware import resolve_cluster
from stage_cosim.hardware.gpu import get_gpu
from stage_cosim.model import ModelConfig
from stage_cosim.parallel import ParallelConfig
from stage_cosim.schedule.nodes import COLL, COMP, FIRST_FWD
from stage_cosim.workload import synthesize
from template_rows import template_rows

H100, B200 = get_gpu("H100-SXM"), get_gpu("B200")
QUANT_KINDS = ("quantize", "transpose", "amax")
# bytes per element of quantized data with its scales
MX = Fraction(33, 32)            # MXFP8: one E8M0 scale per 32 elements
TILE = Fraction(33, 32)          # blockwise 1x128: one fp32 scale per 128 elements
BLOCK = 1 + Fraction(1, 4096)    # blockwise 128x128 weights


@pytest.fixture
def llama_tiny() -> ModelConfig:
    # h = 1024 = heads * head_dim, 4 kv groups: the QKV projection is (16 + 2 * 4) * 64 = 1536 wide
    return ModelConfig.build("llama-tiny", "llama", layers=2, hidden=1024, ffn=2816, heads=16, kv_heads=4,
                             vocab=32000, max_seq=4096)


def _par(**kw) -> ParallelConfig:
    base = dict(micro_batch=2, global_batch=4, seq_len=512, dtype="fp8")
    return ParallelConfig(**(base | kw))


def _rows(w, key, label="layer0", kinds=QUANT_KINDS):
    return [r for r in template_rows(w.role(0), key) if r.block == label and r.type == COMP and r.category in kinds]


def _quant_bytes(w, key) -> int:
    return sum(r.mem_bytes for r in _rows(w, key))


def _layer_shapes(m: ModelConfig, n: int) -> dict[str, int]:
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim
    return dict(x=n * m.hidden, ctx=n * m.heads * m.head_dim, act=n * m.ffn, up=n * 2 * m.ffn, qkv=n * qkv,
                weights=m.hidden * qkv + m.heads * m.head_dim * m.hidden + m.hidden * 2 * m.ffn + m.ffn * m.hidden,
                n_weights=4)


def _closed_form(recipe: str, transposes: bool, t: dict[str, int]) -> tuple[Fraction, Fraction, Fraction]:
    """Bytes the quantization kernels of one layer move per micro-batch: (forward, backward,
    the first micro-batch's weight casts), without sequence or tensor parallelism."""
    x, ctx, act, up, qkv = t["x"], t["ctx"], t["act"], t["up"], t["qkv"]
    grads = (x, up, x, qkv)          # output gradients of fc2, fc1, proj, qkv
    if recipe == "delayed" and transposes:
        # the norms write FP8 themselves and a transpose kernel makes the column-wise copy;
        # the attention output and the activation are cast and transposed in one kernel
        fwd = 2 * x + 4 * ctx + 2 * x + 4 * act
        return Fraction(fwd), Fraction(sum(4 * g for g in grads)), Fraction(4 * t["weights"])
    if recipe == "delayed":
        # Blackwell: FP8 GEMMs read either layout, nothing is transposed
        return Fraction(3 * ctx + 3 * act), Fraction(sum(3 * g for g in grads)), Fraction(3 * t["weights"])
    if recipe == "tensorwise":
        # the norms compute the amax themselves (4 B each), the others read the tensor once more
        fwd = (4 * x + 4) + (2 * ctx + 4) + (4 * ctx + 4) + (4 * x + 4) + (2 * act + 4) + (4 * act + 4)
        bwd = sum((2 * g + 4) + (4 * g + 4) for g in grads)
        return Fraction(fwd), Fraction(bwd), Fraction(6 * t["weights"] + 8 * t["n_weights"])
    # rowwise: FP8 data alone (one fp32 scale per row of thousands of elements is not counted)
    q, wq = {"mxfp8": (MX, MX), "rowwise": (1, 1)}.get(recipe, (TILE, BLOCK))
    # block and row scaling: one kernel reads the bf16 tensor and writes both quantized copies
    # (the weight's too: rowwise's per-row scales run along the other axis when transposed)
    fwd = sum((2 + 2 * q) * v for v in (x, ctx, x, act))
    bwd = sum((2 + 2 * q) * g for g in grads)
    return fwd, bwd, (2 + 2 * wq) * t["weights"]


@pytest.mark.parametrize("recipe,gpu", [("delayed", H100), ("delayed", B200), ("tensorwise", H100),
                                        ("mxfp8", B200), ("blockwise", H100), ("rowwise", H100)])
def test_quantization_bytes_per_layer_closed_form(llama_tiny, recipe, gpu) -> None:
    w = synthesize(llama_tiny, _par(fp8_recipe=recipe), gpu)
    fwd, bwd, weights = _closed_form(recipe, gpu.fp8_transposes, _layer_shapes(llama_tiny, 2 * 512))
    assert _quant_bytes(w, (0, "fwd")) == pytest.approx(float(fwd), abs=8)
    assert _quant_bytes(w, (0, "bwd")) == pytest.approx(float(bwd), abs=8)
    assert _quant_bytes(w, (0, FIRST_FWD)) - _quant_bytes(w, (0, "fwd")) == pytest.approx(float(weights), abs=16)


def test_fp8_gemms_read_quantized_operands(llama_tiny) -> None:
    """The four linear layers (forward, dgrad, wgrad) run at the FP8 format; attention, the
    output layer and everything else stay BF16; an FP8 GEMM moves one byte per operand element."""
    m = llama_tiny
    w = synthesize(m, _par(), H100)
    b16 = synthesize(m, _par(dtype="bf16"), H100)
    fmt = {r.name: r.matmul for key in ((0, "fwd"), (0, "bwd")) for r in template_rows(w.role(0), key) if r.matmul}
    fp8 = sorted(name for name, f in fmt.items() if f == "fp8")
    assert len(fp8) == 3 * 4 * m.layers
    assert all(name.split(".")[1] in ("qkv", "proj", "fc1", "fc2") for name in fp8)
    assert {fmt["layer0.attention"], fmt["layer0.attention.grad"], fmt["head.logits"]} == {"bf16"}
    n, h = 2 * 512, m.hidden
    mem = {r.name: r.mem_bytes for r in template_rows(w.role(0), (0, "fwd"))}
    mem16 = {r.name: r.mem_bytes for r in template_rows(b16.role(0), (0, "fwd"))}
    w_fc2 = m.ffn * h
    assert mem["layer0.fc2"] == n * m.ffn + w_fc2 + 2 * n * h            # fp8 in, bf16 out
    assert mem16["layer0.fc2"] == 2 * n * m.ffn + 2 * w_fc2 + 2 * n * h


def test_sequence_parallel_gathers_fp8_and_transposes_after_the_gather(llama_tiny) -> None:
    """Transformer Engine all-gathers the FP8 row-wise copy (half of BF16's bytes); the
    reductions of GEMM outputs stay BF16; per-tensor scaling transposes the gathered tensor in
    the backward, so the transposes see the whole sequence. (Each collective whole: without
    tp_comm_overlap, which would cut those feeding or fed by a GEMM into chunks.)"""
    tp = 4
    bf16 = synthesize(llama_tiny, _par(tp=tp, sp=True, tp_comm_overlap=False, dtype="bf16"), H100)
    fp8 = synthesize(llama_tiny, _par(tp=tp, sp=True, tp_comm_overlap=False), H100)

    def comm(w, key, coll):
        return sorted(r.comm_bytes for r in template_rows(w.role(0), key) if r.type == COLL and r.coll.value == coll
                      and r.block == "layer0")

    for key in ((0, "fwd"), (0, "bwd")):
        assert comm(fp8, key, "ALL_GATHER") == [b // 2 for b in comm(bf16, key, "ALL_GATHER")]
        assert comm(fp8, key, "REDUCE_SCATTER") == comm(bf16, key, "REDUCE_SCATTER")
    n, h = 2 * 512, llama_tiny.hidden
    transposes = [r for r in _rows(fp8, (0, "bwd"), kinds=("transpose",))]
    # the two norm outputs and the output gradients of proj and fc2: full sequence, 1 B in + 1 B out
    assert sorted(r.mem_bytes for r in transposes) == [2 * n * h] * 4
    assert not _rows(fp8, (0, "fwd"), kinds=("transpose",))


def test_current_scaling_reduces_the_amax_of_gathered_tensors_over_tp(llama_tiny) -> None:
    w = synthesize(llama_tiny, _par(tp=2, sp=True, fp8_recipe="tensorwise"), H100)
    amax = [r for key in ((0, "fwd"), (0, "bwd")) for r in template_rows(w.role(0), key)
            if r.type == COLL and ".amax.ar_" in r.name and r.block == "layer0"]
    # the inputs of qkv and fc1 in the forward, the output gradients of proj and fc2 in the backward
    assert len(amax) == 4 and {r.comm_bytes for r in amax} == {4} and {r.group for r in amax} == {"tp"}


def test_delayed_scaling_reduces_all_amaxes_once_per_pass(llama_tiny) -> None:
    m = llama_tiny.with_overrides(layers=4)
    w = synthesize(m, _par(dp=2, tp=2, pp=2, global_batch=8, zero=1), H100)
    for stage in range(2):
        role = w.role(stage)
        for chunk, phase in role.templates:
            ars = [r for r in template_rows(role, (chunk, phase)) if r.type == COLL and r.name.endswith("fp8_amax_ar")]
            per_module = 3 if phase != "bwd" else 2
            # two layers of four FP8 GEMMs on each stage; one fp32 amax per tensor
            assert [(r.group, r.comm_bytes) for r in ars] == [("tp_dp", 4 * per_module * 4 * 2)]
    assert "tp_dp" in w.group_kinds and len(w.group_members(0, "tp_dp")) == 4
    other = synthesize(m, _par(dp=2, tp=2, pp=2, global_batch=8, zero=1, fp8_recipe="blockwise"), H100)
    assert "tp_dp" not in other.group_kinds


@pytest.mark.parametrize("recipe,gpu,per_param", [("delayed", H100, 2), ("delayed", B200, 1),
                                                  ("tensorwise", H100, 2), ("mxfp8", B200, 2 * MX),
                                                  ("blockwise", H100, 2 * BLOCK)])
def test_fp8_weight_cache_closed_form(llama_tiny, recipe, gpu, per_param) -> None:
    """The FP8 copies of every layer's GEMM weights (and, where the GEMMs need it, the
    transposed or column-wise copy) are kept from the first micro-batch on."""
    tp = 2
    w = synthesize(llama_tiny, _par(tp=tp, fp8_recipe=recipe), gpu)
    params = _layer_shapes(llama_tiny, 1)["weights"] * llama_tiny.layers // tp
    mem = w.memory(0)
    assert mem.fp8_weight_cache == pytest.approx(float(per_param * params), abs=8)
    bf16 = synthesize(llama_tiny, _par(tp=tp, dtype="bf16"), gpu).memory(0)
    assert mem.weights == bf16.weights and bf16.fp8_weight_cache == 0
    if recipe == "delayed":
        # an amax history of 1024 plus scale and inverse scale, for 3 + 2 tensors of each GEMM
        assert mem.fp8_amax_history == 4 * 4 * llama_tiny.layers * 5 * (1024 + 2)
    else:
        assert mem.fp8_amax_history == 0


def test_fp8_param_gather_stores_and_gathers_fp8(llama_tiny) -> None:
    """Parameters kept in FP8: one byte per GEMM weight parameter stored, the distributed
    optimizer's parameter all-gather moves FP8 for them, and on Hopper only the transposed copy
    is cached."""
    dp, tp = 4, 2
    kw = dict(dp=dp, tp=tp, zero=1, global_batch=8)
    plain = synthesize(llama_tiny, _par(**kw), H100)
    fp8p = synthesize(llama_tiny, _par(**kw, fp8_param_gather=True), H100)
    gemm = _layer_shapes(llama_tiny, 1)["weights"] * llama_tiny.layers // tp
    assert plain.memory(0).weights - fp8p.memory(0).weights == pytest.approx(gemm, abs=8)
    assert fp8p.memory(0).fp8_weight_cache == pytest.approx(gemm, abs=8)

    def gather(w, label):
        return sum(n.comm_bytes for n in w.role(0).nodes if n.type == COLL and n.name.startswith(label + ".param_ag"))

    layer = _layer_shapes(llama_tiny, 1)["weights"] // tp
    norms = 2 * llama_tiny.hidden
    assert gather(plain, "layer0") == pytest.approx(2 * (layer + norms) / dp, abs=2)
    assert gather(fp8p, "layer0") == pytest.approx((layer + 2 * norms) / dp, abs=2)
    # no weight cast: only the (cached) transposes of the stored FP8 weights
    first = _rows(fp8p, (0, FIRST_FWD))
    assert {r.category for r in first} - {"quantize"} == {"transpose"}
    assert sum(r.mem_bytes for r in first if r.category == "transpose") - sum(
        r.mem_bytes for r in _rows(fp8p, (0, "fwd")) if r.category == "transpose") == pytest.approx(2 * layer, abs=8)


def test_zero3_casts_the_gathered_weights_every_micro_batch(llama_tiny) -> None:
    w = synthesize(llama_tiny, _par(dp=2, zero=3), H100)
    assert (0, FIRST_FWD) not in w.role(0).templates
    assert w.memory(0).fp8_weight_cache == 0
    casts = [r for r in _rows(w, (0, "fwd")) if r.name.endswith("weight.quantize")]
    recasts = [r for r in _rows(w, (0, "bwd")) if r.name.endswith("weight.quantize")]
    assert len(casts) == 4 and len(recasts) == 4


def test_full_recompute_recasts_activations_not_weights(llama_tiny) -> None:
    w = synthesize(llama_tiny, _par(recompute="full"), H100)
    rec = [r.name for r in template_rows(w.role(0), (0, "bwd")) if r.phase == "recompute" and r.block == "layer0"]
    assert "layer0.attention.quantize" in rec and "layer0.swiglu.quantize" in rec
    assert not [name for name in rec if name.endswith("weight.quantize")]


def test_fp8_attention_and_layernorm_mlp(llama_tiny) -> None:
    gpt = ModelConfig.build("gpt-tiny", "gpt", layers=2, hidden=1024, heads=16, vocab=50257, max_seq=2048)
    w = synthesize(gpt, _par(fp8_attention=True, te_layernorm_mlp=True), H100)
    fwd = {r.name: r for r in template_rows(w.role(0), (0, "fwd"))}
    bwd = {r.name: r for r in template_rows(w.role(0), (0, "bwd"))}
    assert fwd["layer0.attention"].matmul == "fp8" and bwd["layer0.attention.grad"].matmul == "fp8"
    assert {"layer0.q.quantize", "layer0.k.quantize", "layer0.v.quantize", "layer0.attention.dequantize"} <= set(fwd)
    n, f = 2 * 512, gpt.ffn
    # LayerNormMLP: GELU reads bf16 and writes FP8 (no cast of its own), its backward writes
    # FC1's quantized output gradient and its transpose and computes the bias gradient
    assert "layer0.gelu.quantize" not in fwd and fwd["layer0.gelu"].mem_bytes == 2 * n * f + n * f
    assert not [k for k in bwd if k.startswith("layer0.d(fc1") and k.endswith("quantize")]
    assert bwd["layer0.gelu.grad"].mem_bytes == 2 * n * f + 2 * n * f + n * f + n * f + 4 * f


def _linear_gemm_share(bf16, fp8) -> float:
    """The share of a one-GPU BF16 step spent in the GEMMs an FP8 recipe quantizes."""
    role16, role8 = bf16.role(0), fp8.role(0)
    names = {n.name for n in role8.nodes if n.type == COMP and n.matmul == "fp8"}
    compute = ComputeModel(H100)
    total = sum(compute.duration_s(n.flops, n.mem_bytes, n.matmul, n.category.startswith("attention"))
                for n in role16.nodes if n.type == COMP)
    gemms = sum(compute.duration_s(n.flops, n.mem_bytes, n.matmul) for n in role16.nodes
                if n.type == COMP and n.name in names)
    return gemms / total


def test_fp8_step_speedup_bounds() -> None:
    """A GEMM-bound model on one H100: FP8 is faster than BF16, and by less than Amdahl's law
    allows with the whole peak ratio on the quantized GEMMs (the casts only add time)."""
    m = ModelConfig.build("llama-big", "llama", layers=4, hidden=8192, ffn=28672, heads=64, kv_heads=8,
                          vocab=32000, max_seq=4096)
    cluster = resolve_cluster("dgx-h100:1")
    par = dict(micro_batch=1, global_batch=2, seq_len=4096)
    bf16 = synthesize(m, ParallelConfig(**par), cluster.gpu)
    fp8 = synthesize(m, ParallelConfig(**par, dtype="fp8"), cluster.gpu)
    t16 = simulate(bf16, cluster).result.step_time_s
    r8 = simulate(fp8, cluster).result
    f = _linear_gemm_share(bf16, fp8)
    assert f > 0.6      # GEMM-bound
    ratio = 1979 / 989      # H100 SXM dense peaks, NVIDIA's H100 datasheet: 1,979 TFLOP/s FP8, 989 BF16
    amdahl = 1 / ((1 - f) + f / ratio)
    assert 1 < t16 / r8.step_time_s < amdahl
    # MFU is counted against each peak, labelled
    assert r8.precision["dtype"] == "fp8" and r8.precision["recipe"] == "delayed"
    assert r8.mfu_fp8 == pytest.approx(r8.mfu / ratio)
    assert "of FP8 peak" in r8.mfu_label


def test_fp8_gemm_duration_uses_its_own_curve() -> None:
    g = H100.with_overrides(fp8_matmul_efficiency=0.7, fp8_matmul_half_flops=8e9)
    m = ComputeModel(g)
    F = 5e12
    expected = F / (g.fp8_tflops * 1e12 * 0.7 * F / (F + 8e9)) + g.kernel_overhead_us * 1e-6
    assert m.duration_s(F, 1e6, "fp8") == pytest.approx(expected)
    assert m.duration_s(F, 1e6, "bf16") == pytest.approx(m.duration_s(F, 1e6, True))
    b = ComputeModel(B200)
    assert b.duration_s(F, 1e6, "mxfp8") < b.duration_s(F, 1e6, "bf16")


def test_precision_errors(run_cli) -> None:
    for args, where in ((["--cluster", "dgx-a100:8", "--dp", "8", "--dtype", "fp8"], "error: dtype:"),
                        (["--cluster", "dgx-h100:8", "--dp", "8", "--dtype", "fp8", "--fp8-recipe", "mxfp8"],
                         "error: fp8-recipe:"),
                        (["--dp", "2", "--fp8-attention"], "error: fp8-attention:"),
                        (["--dp", "2", "--dtype", "fp8", "--fp8-param-gather"], "error: fp8-param-gather:"),
                        (["--dp", "2", "--dtype", "fp8", "--fp8-dispatch"], "error: fp8-dispatch:"),
                        (["--dp", "2", "--dtype", "fp8", "--fp8-attention", "--fp8-recipe", "blockwise"],
                         "error: fp8-attention:"),
                        (["--dp", "2", "--dtype", "fp8", "--fp8-attention", "--fp8-recipe", "rowwise"],
                         "error: fp8-attention:"),
                        (["--dp", "2", "--zero", "3", "--dtype", "fp8", "--fp8-param-gather", "--fp8-recipe",
                          "rowwise"], "error: fp8-param-gather:")):
        code, out, err = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", *args)
        assert code == 2 and err.startswith(where) and "Traceback" not in err, (args, err)
    with pytest.raises(UserError, match="synthesize it for this cluster"):
        w = synthesize(ModelConfig.build("t", "llama", layers=1, hidden=256, ffn=512, heads=4, vocab=1000, max_seq=512),
                       ParallelConfig(dtype="fp8", seq_len=256), H100)
        simulate(w, resolve_cluster("dgx-b200:1"))


def test_simulate_cli_labels_mfu(run_cli) -> None:
    code, out, _ = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", "--cluster", "dgx-b200:8", "--tp", "8",
                           "--dtype", "fp8", "--seq-len", "1024")
    assert code == 0
    assert "of BF16 peak" in out and "MFU (MXFP8 peak)" in out and "fp8 mxfp8 (hybrid, no transposes)" in out


def test_fp8_traces_read_back_time_fp8_gemms(run_cli, tmp_path) -> None:
    """The traces name each kernel's tensor-core format (op_kind matmul_fp8): simulated from
    disk they give the step of the workload they were written from."""
    import json

    args = ["--model", "llama3-8b", "--layers", "2", "--tp", "2", "--pp", "2", "--global-batch", "4",
            "--seq-len", "1024", "--dtype", "fp8"]
    out = tmp_path / "t"
    assert run_cli("synth", *args, "--out", str(out), "--cluster", "dgx-h100:4")[0] == 0
    code, stdout, err = run_cli("simulate", "--traces", str(out), "--cluster", "dgx-h100:4", "--json")
    assert code == 0, err
    code, direct, _ = run_cli("simulate", *args, "--cluster", "dgx-h100:4", "--json", "--full")
    assert json.loads(stdout)["step_time_s"] == pytest.approx(json.loads(direct)["step_time_s"], rel=1e-9)
    kinds = set()
    for f in out.glob("workload.*.et"):
        kinds |= {b"matmul_fp8" in f.read_bytes()}
    assert kinds == {True}


# -- precision as a search dimension -------------------------------------------------------------

SEARCH_MODEL = ModelConfig.build("llama-s", "llama", layers=8, hidden=4096, ffn=14336, heads=32, kv_heads=8,
                                 vocab=128256, max_seq=8192)
SEARCH_SPACE = dict(overrides={"vp": (1,), "zero": (1,), "recompute": ("none",), "micro_batch": (1, 2)})


def _best(dtype: str, cluster, **kw):
    from stage_cosim.search.optimize import OptimizeSettings, optimize
    from stage_cosim.search.space import default_space

    space = default_space(SEARCH_MODEL, cluster, 32, 2048, precision={"dtype": dtype}, **SEARCH_SPACE)
    return optimize(space, cluster, OptimizeSettings(**kw))


@pytest.mark.slow
def test_dtype_auto_reports_the_optimum_of_each_precision() -> None:
    """--dtype auto searches bf16 and fp8 together; each reported best is the proven optimum of
    the search with that precision fixed."""
    cluster = resolve_cluster("dgx-h100:16")
    auto = _best("auto", cluster)
    assert auto.proven_optimal
    doc = auto.to_dict()
    assert set(doc["best_by_dtype"]) == {"bf16", "fp8"}
    for dtype in ("bf16", "fp8"):
        alone = _best(dtype, cluster).to_dict()["best"]
        assert doc["best_by_dtype"][dtype]["step_time_s"] == pytest.approx(alone["step_time_s"])
        assert doc["best_by_dtype"][dtype]["config"]["parallel"]["dtype"] == dtype
    assert doc["best"]["config"]["parallel"]["dtype"] == "fp8"       # a GEMM-bound model on H100
    # too large to enumerate: each precision gets its own search and budget
    de = _best("auto", cluster, exhaustive_limit=0, budget=12, seed=1)
    assert de.method.endswith("per dtype") and set(de.to_dict()["best_by_dtype"]) == {"bf16", "fp8"}


def test_dtype_auto_on_a_gpu_without_fp8() -> None:
    r = _best("auto", resolve_cluster("dgx-a100:16"))
    assert set(r.to_dict()["best_by_dtype"]) == {"bf16"}
    assert any(reason.startswith("dtype: fp8 needs FP8 tensor cores") for reason in r.infeasible)


@pytest.mark.slow
def test_explore_fp8_peak_is_a_variable() -> None:
    """gpu.fp8_tflops is a hardware variable: FP8 training gets faster with it, BF16 training
    does not notice it."""
    from stage_cosim import api

    spec = dict(model="llama3-8b", baseline="dgx-h100:16", global_batch=32, seq_len=1024,
                variables={"gpu.fp8_tflops": {"values": [1000, 1979, 4000]}}, cost={"base": 10000, "gpu.fp8_tflops": 1},
                mode="budget", budget=20000, points=2, candidates=6, inner_budget=8, baseline_budget=8, reuse_top=3)
    fp8 = api.explore(spec | {"dtype": "fp8"})
    bf16 = api.explore(spec)
    el8 = fp8["sensitivity"][0]
    assert el8["variable"] == "gpu.fp8_tflops" and el8["elasticity"] < -0.1
    assert bf16["sensitivity"][0]["elasticity"] == pytest.approx(0, abs=1e-9)
    assert fp8["baseline"]["best"]["config"]["parallel"]["dtype"] == "fp8"


# -- Mixture of Experts ---------------------------------------------------------------------------

def _moe_model() -> ModelConfig:
    from stage_cosim.model import get_preset

    return get_preset("deepseek-v3").with_overrides(layers=2, moe_layer_freq=(0, 1), mtp_num_layers=0)


def test_moe_router_stays_high_precision_experts_run_fp8() -> None:
    w = synthesize(_moe_model(), ParallelConfig(dp=8, ep=8, micro_batch=1, global_batch=8, seq_len=1024,
                                                zero=1, dtype="fp8", fp8_recipe="blockwise"), H100)
    fmt = {r.name: r.matmul for r in template_rows(w.role(0), (0, "fwd")) if r.block == "layer1" and r.matmul}
    assert fmt["layer1.router"] == "bf16"
    for gemm in ("q_down", "q_up", "kv_down", "kv_up", "proj", "experts.fc1", "experts.fc2",
                 "shared_experts.fc1", "shared_experts.fc2"):
        assert fmt[f"layer1.{gemm}"] == "fp8", gemm


@pytest.mark.parametrize("recipe,per_element", [("delayed", 1), ("blockwise", TILE)])
def test_fp8_dispatch_sends_tokens_and_combine_gradients_in_fp8(recipe, per_element) -> None:
    """--fp8-dispatch (DeepSeek-V3): the tokens are quantized before the dispatch all-to-all and
    the experts' output gradient before the combine's backward all-to-all; the combine and the
    dispatch's backward stay BF16."""
    def a2a(dispatch: bool) -> dict[str, int]:
        par = ParallelConfig(dp=8, ep=8, micro_batch=1, global_batch=8, seq_len=1024, zero=1, dtype="fp8",
                             fp8_recipe=recipe, fp8_dispatch=dispatch)
        w = synthesize(_moe_model(), par, H100)
        return {r.name.replace(".fp8", ""): r.comm_bytes for key in ((0, "fwd"), (0, "bwd"))
                for r in template_rows(w.role(0), key) if r.block == "layer1" and r.type == COLL}

    bf16, fp8 = a2a(False), a2a(True)
    assert set(bf16) == set(fp8) == {"layer1.dispatch.a2a_ep", "layer1.experts.fc2.a2a_ep",
                                     "layer1.d(experts.fc2).a2a_ep", "layer1.d(dispatch).a2a_ep"}
    for name in ("layer1.dispatch.a2a_ep", "layer1.d(experts.fc2).a2a_ep"):
        assert fp8[name] == pytest.approx(float(bf16[name] * per_element / 2), abs=2)
    for name in ("layer1.experts.fc2.a2a_ep", "layer1.d(dispatch).a2a_ep"):
        assert fp8[name] == bf16[name]
