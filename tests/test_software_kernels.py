"""A software profile's own kernels: the torchtitan profile's attention is PyTorch's
FlashAttention-2 backend (cuDNN's attention is opt-in in PyTorch at that release), not the cuDNN
fused attention Megatron-Core and NeMo run through Transformer Engine. The GPU records hold the
profile's own attention efficiencies (efficiencies.<profile>), which every training step run
with that profile is priced at."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from stage_cosim.adapters.roofline.compute import ComputeModel
from stage_cosim.adapters.roofline.simulate import simulate
from stage_cosim.hardware import resolve_cluster
from stage_cosim.hardware.gpu import get_gpu
from stage_cosim.model import get_preset
from stage_cosim.parallel import ParallelConfig
from stage_cosim.parallel.software import get_software
from stage_cosim.validation.published import GRAND_TETON_H100
from stage_cosim.workload import synthesize

TORCHTITAN = "torchtitan-2024.12"


def _fa2_h100() -> dict[tuple[str, bool, int], float]:
    """FlashAttention-2 on H100 (the FlashAttention-3 paper's bars): (pass, causal, seq) -> TFLOP/s."""
    with resources.files("stage_cosim.validation").joinpath("data", "attention_kernels_h100.csv").open() as f:
        return {(r["pass"], r["causal"] == "true", int(r["seqlen"])): float(r["tflops"])
                for r in csv.DictReader(f) if r["implementation"] == "flash_attn_2"}


def test_the_profiles_name_their_attention_kernels() -> None:
    assert get_software(TORCHTITAN).attention_kernel == "flash_attn_2"
    assert get_software("megatron-core-0.8").attention_kernel == "cudnn"
    assert get_software("nemo-24.07").attention_kernel == "cudnn"
    assert get_software("megatron-lm-2022").attention_kernel is None


def test_torchtitan_attention_on_h100_is_flash_attention_2_at_the_training_factor() -> None:
    """Hand-combined training rates of the measured kernel, causal: forward and backward at
    their FLOP ratio, 3.5 / (1/fwd + 2.5/bwd), the causal backward taken to lose what the causal
    forward loses against the unmasked one. The profile's attention, divided by the H100 fit's
    training factor (its BF16 GEMM efficiency over the MAMF search's best shape, 794.5 of
    989 TFLOP/s), reaches each within 4 %; and it is slower than the default (cuDNN) attention
    at every length."""
    sxm = get_gpu("H100-SXM")
    titan = sxm.for_software(TORCHTITAN)
    assert (titan.attention_efficiency, titan.attention_half_keys) != (sxm.attention_efficiency,
                                                                       sxm.attention_half_keys)
    factor = sxm.matmul_efficiency / (794.5 / 989)
    bars = _fa2_h100()
    for seq in (512, 1024, 2048, 4096, 8192, 16384):
        fwd = bars["fwd", True, seq]
        bwd = bars["bwd", False, seq] * fwd / bars["fwd", False, seq]
        measured = 3.5 / (1 / fwd + 2.5 / bwd)
        rows = -(-seq // 128) * 128 * (16384 // seq) * 16          # query tiles x batch x heads
        model = ComputeModel(titan).attention_rate("bf16", keys=seq, rows=rows) / 1e12 / factor
        assert model == pytest.approx(measured, rel=0.04), seq
        assert ComputeModel(sxm).attention_rate("bf16", keys=seq, rows=rows) > model * factor


def test_a_profile_without_a_set_and_a_value_set_by_hand_stay_as_they_are() -> None:
    sxm = get_gpu("H100-SXM")
    assert sxm.for_software("megatron-core-0.8") is sxm and sxm.for_software(None) is sxm
    mine = sxm.with_overrides(attention_efficiency=0.5)
    titan = mine.for_software(TORCHTITAN)
    assert titan.attention_efficiency == 0.5                                  # as set
    assert titan.attention_half_keys == sxm.for_software(TORCHTITAN).attention_half_keys
    hypothetical = sxm.with_overrides(record=None)
    assert hypothetical.for_software(TORCHTITAN) is hypothetical


def test_a_cluster_file_gpu_takes_its_base_records_sets() -> None:
    """Meta's Grand Teton H100 (a cluster file: the H100 SXM record with its memory and 500 W
    GEMM rates) runs torchtitan's attention at the H100 record's FlashAttention-2 values."""
    gpu = resolve_cluster(GRAND_TETON_H100, 8).gpu
    assert gpu.record == "H100-SXM" and gpu.name != "H100-SXM"
    want = get_gpu("H100-SXM").for_software(TORCHTITAN)
    got = gpu.for_software(TORCHTITAN)
    assert (got.attention_efficiency, got.attention_half_keys) == (want.attention_efficiency,
                                                                   want.attention_half_keys)


def test_a_step_with_the_profile_is_slower_by_its_attention_kernels_alone() -> None:
    """One H100, two layers: the same step under Megatron-Core's and torchtitan's profiles (no
    tp, no dp: no switch of theirs applies) differs by exactly what its fused attention
    kernels' times differ by."""
    model = get_preset("llama3-8b").with_overrides(layers=2)
    cluster = resolve_cluster("dgx-h100:1")
    steps, kernels = {}, {}
    for software in ("megatron-core-0.8", TORCHTITAN):
        w = synthesize(model, ParallelConfig(global_batch=1, seq_len=4096, software=software))
        steps[software] = simulate(w, cluster, exact=True).result.step_time_s
        cm = ComputeModel(cluster.gpu.for_software(software))
        kernels[software] = sum(cm.node_duration_s(n) for n in w.role(0).nodes if n.type == "COMP")
    assert steps[TORCHTITAN] > steps["megatron-core-0.8"]
    assert steps[TORCHTITAN] - steps["megatron-core-0.8"] == pytest.approx(
        kernels[TORCHTITAN] - kernels["megatron-core-0.8"], rel=1e-9)


def test_every_records_profile_sets_name_a_software_profile() -> None:
    """A record's own sets are keyed by software profile names (the hardware layer reads them
    without knowing the profiles, which sit above it)."""
    from stage_cosim.hardware.gpu import gpu_records
    from stage_cosim.parallel.software import software_names

    keys = {k for rec in gpu_records().values() for k in rec["efficiencies"]}
    assert TORCHTITAN in keys and keys <= {"default", *software_names()}


@pytest.mark.parametrize("record", ["nope", 5])
def test_a_cluster_file_naming_no_record_is_refused(tmp_path, run_cli, record) -> None:
    """The record a GPU's efficiencies come from must be a preset: one line, exit 2."""
    path = tmp_path / "x.yaml"
    path.write_text(f"name: x\ngpu: {{base: H100-SXM, record: {record}}}\nnum_gpus: 8\n"
                    "scale_up: {gpus_per_domain: 8, bandwidth_GBps: 450, latency_ns: 700}\n"
                    "scale_out: {bandwidth_GBps: 50, latency_ns: 2000}\n")
    code, out, err = run_cli("simulate", "--model", "llama3-8b", "--cluster", str(path), "--dp", "8",
                             "--global-batch", "8", "--seq-len", "2048")
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and "gpu.record" in err and "must name a GPU preset" in err

