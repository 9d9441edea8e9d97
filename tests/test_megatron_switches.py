"""Megatron-Core's performance switches under Megatron-LM's flag names: what each sets, what it
refuses, and that the report states the settings a step assumed."""

from __future__ import annotations

import json
from pathlib import Path

from stage_cosim.trace.chakra import read_trace_dir

TRAIN = ["--model", "llama3-8b", "--cluster", "dgx-h100:8", "--tp", "2", "--pp", "2", "--dp", "2",
         "--global-batch", "8", "--seq-len", "1024"]


def _one_line_error(code: int, err: str, parameter: str) -> None:
    assert code == 2 and err.startswith(f"error: {parameter}: ") and err.count("\n") == 1, err


def test_use_distributed_optimizer_is_zero_1(run_cli) -> None:
    code, a, err = run_cli("simulate", *TRAIN, "--use-distributed-optimizer", "--json")
    assert code == 0, err
    code, b, err = run_cli("simulate", *TRAIN, "--zero", "1", "--json")
    assert code == 0, err
    assert json.loads(a) == json.loads(b)
    _one_line_error(*run_cli("simulate", *TRAIN, "--zero", "2", "--use-distributed-optimizer")[::2],
                    "use-distributed-optimizer")


def test_tp_comm_overlap_needs_sequence_parallelism(run_cli) -> None:
    """Megatron-LM overlaps sp's all-gathers and reduce-scatters with their GEMMs: without sp
    there is nothing it overlaps, so the flag is refused rather than ignored. With tp > 1, sp is
    the software profile's default, so --tp-comm-overlap alone is fine; --no-sp is refused."""
    _one_line_error(*run_cli("simulate", *TRAIN, "--no-sp", "--tp-comm-overlap")[::2], "tp-comm-overlap")
    for flags in (["--tp-comm-overlap"], ["--sp", "--tp-comm-overlap"]):
        code, out, err = run_cli("simulate", *TRAIN, *flags, "--json")
        assert code == 0, err
        par = json.loads(out)["config"]["parallel"]
        assert par["tp_comm_overlap"] is True and par["sp"] is True
        assert "tp_comm_overlap" not in par["assumed"]


SWITCHES = "switches         "


def _switches(out: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith(SWITCHES)]
    return line[len(SWITCHES):]


def test_the_report_states_the_switches_it_assumed(run_cli) -> None:
    """Every switch the request left unset is the software profile's, marked with a *: Megatron-Core
    0.8 turns on sp and the tp overlap with tp > 1, overlaps the gradient reduction and the
    parameter gather and reduces the gradients in fp32."""
    code, out, err = run_cli("simulate", *TRAIN)
    assert code == 0, err
    assert _switches(out) == ("--sp* --tp-comm-overlap* --overlap-grad-reduce* --overlap-param-gather* "
                              "--grad-reduce-in-fp32*  (* megatron-core-0.8 default); its attention kernel cudnn")
    # every switch set: no *, the profile named alone
    code, out, err = run_cli("simulate", *TRAIN, "--zero", "1", "--sp", "--tp-comm-overlap", "--overlap-grad-reduce",
                             "--no-overlap-param-gather", "--grad-reduce-in-bf16")
    assert code == 0, err
    assert _switches(out) == ("--sp --tp-comm-overlap --overlap-grad-reduce --no-overlap-param-gather "
                              "--grad-reduce-in-bf16  (megatron-core-0.8); its attention kernel cudnn")


def test_the_star_marks_only_the_switches_left_unset(run_cli) -> None:
    code, out, err = run_cli("simulate", *TRAIN, "--no-sp", "--no-overlap-grad-reduce")
    assert code == 0, err
    # tp_comm_overlap, unset, follows sp: off without it
    assert _switches(out) == ("--no-sp --no-tp-comm-overlap* --no-overlap-grad-reduce --overlap-param-gather* "
                              "--grad-reduce-in-fp32*  (* megatron-core-0.8 default); its attention kernel cudnn")
    code, out, err = run_cli("simulate", *TRAIN, "--software", "nemo-24.07", "--grad-reduce-in-fp32", "--json")
    assert code == 0, err
    par = json.loads(out)["config"]["parallel"]
    assert par["software"] == "nemo-24.07" and par["grad_reduce_dtype"] == "fp32"
    assert set(par["assumed"]) == {"sp", "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather"}
    code, out, err = run_cli("simulate", *TRAIN, "--software", "nemo-24.07")
    assert code == 0, err
    # NeMo 24.07's recipes reduce the gradients in bf16
    assert _switches(out).endswith("--grad-reduce-in-bf16*  (* nemo-24.07 default); its attention kernel cudnn")


def test_an_unknown_software_profile_is_refused(run_cli) -> None:
    _one_line_error(*run_cli("simulate", *TRAIN, "--software", "nosuch")[::2], "software")


def test_a_switch_the_framework_lacks_is_refused(run_cli) -> None:
    """FSDP2 always prefetches the next block's parameters: torchtitan has no setting to turn the
    overlapped parameter gather off."""
    _one_line_error(*run_cli("simulate", *TRAIN, "--software", "torchtitan-2024.12",
                             "--no-overlap-param-gather")[::2], "overlap-param-gather")
    code, _, err = run_cli("simulate", *TRAIN, "--software", "torchtitan-2024.12")
    assert code == 0, err


def test_cross_entropy_loss_fusion_is_cross_entropy_fused(run_cli) -> None:
    code, a, err = run_cli("simulate", *TRAIN, "--cross-entropy-loss-fusion", "--json")
    assert code == 0, err
    code, b, err = run_cli("simulate", *TRAIN, "--cross-entropy", "fused", "--json")
    assert code == 0, err
    assert json.loads(a) == json.loads(b)
    assert json.loads(a)["config"]["model"]["cross_entropy"] == "fused"
    _one_line_error(*run_cli("simulate", *TRAIN, "--cross-entropy-loss-fusion", "--cross-entropy", "unfused")[::2],
                    "cross-entropy-loss-fusion")


def _step_time(run_cli, *flags: str) -> float:
    code, out, err = run_cli("simulate", *flags, "--json")
    assert code == 0, err
    return json.loads(out)["step_time_s"]


def test_no_overlap_grad_reduce_is_no_faster(run_cli) -> None:
    """Without --overlap-grad-reduce every data-parallel gradient reduction waits for the end of
    the stage's backward: the step can only get longer, and with dp > 1 it does here."""
    overlapped = _step_time(run_cli, *TRAIN)
    after = _step_time(run_cli, *TRAIN, "--no-overlap-grad-reduce")
    assert after > overlapped
    # dp = 1: no data-parallel reduction to overlap
    one = ["--model", "llama3-8b", "--cluster", "dgx-h100:4", "--tp", "2", "--pp", "2", "--global-batch", "4",
           "--seq-len", "1024"]
    assert _step_time(run_cli, *one, "--no-overlap-grad-reduce") >= _step_time(run_cli, *one) * (1 - 1e-12)


def test_an_inference_step_runs_without_sequence_parallelism(run_cli) -> None:
    """sp and its tp overlap are training switches: an inference step with tp > 1 does not take
    the profile's default for them, and refuses them when set."""
    decode = ["--model", "llama3-8b", "--cluster", "dgx-h100:2", "--phase", "decode", "--tp", "2",
              "--batch", "8", "--context-len", "1024"]
    code, out, err = run_cli("simulate", *decode, "--json")
    assert code == 0, err
    par = json.loads(out)["config"]["parallel"]
    assert par["sp"] is False and par["tp_comm_overlap"] is False
    _one_line_error(*run_cli("simulate", *decode, "--sp")[::2], "sp")


def test_grad_reduce_in_bf16_halves_the_gradient_reduce_scatter(run_cli, tmp_path: Path) -> None:
    """Llama 3 8B cut to 2 layers, tp 2: a tensor-parallel rank holds, worked by hand,
    embedding + output head 2 x 128,256 x 4,096 / 2 = 525,336,576, per layer attention
    (q, o 4,096^2; k, v 4,096 x 1,024) 41,943,040 and MLP 3 x 4,096 x 14,336 = 176,160,768, halved:
    2 layers = 218,103,808, and the norms (2 per layer and a final one, replicated) 20,480;
    P = 743,460,864 parameters. The distributed optimizer reduce-scatters the whole gradient
    buffer over dp: 4 P bytes in fp32, 2 P in bf16."""
    p = 2 * 128_256 * 4_096 // 2 + 2 * (2 * 4_096 ** 2 + 2 * 4_096 * 1_024 + 3 * 4_096 * 14_336) // 2 + 5 * 4_096
    assert p == 743_460_864
    sizes = {}
    for dtype, flag in (("fp32", "--grad-reduce-in-fp32"), ("bf16", "--grad-reduce-in-bf16")):
        out = tmp_path / dtype
        code, _, err = run_cli("synth", "--model", "llama3-8b", "--layers", "2", "--tp", "2", "--dp", "2",
                               "--global-batch", "4", "--seq-len", "512", "--zero", "1", flag, "--out", str(out))
        assert code == 0, err
        ranks, _ = read_trace_dir(out)
        sizes[dtype] = sum(n.attrs["comm_size"] for n in ranks[0]
                           if n.attrs.get("comm_type") == 7 and n.name.endswith("grad_rs_dp"))   # REDUCE_SCATTER
    assert sizes == {"fp32": 4 * p, "bf16": 2 * p}
