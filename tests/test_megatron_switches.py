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
    """Megatron-LM overlaps sp's all-gathers and reduce-scatters with their GEMMs: without --sp
    there is nothing it overlaps, so the flag is refused rather than ignored."""
    _one_line_error(*run_cli("simulate", *TRAIN, "--tp-comm-overlap")[::2], "tp-comm-overlap")
    code, out, err = run_cli("simulate", *TRAIN, "--sp", "--tp-comm-overlap", "--json")
    assert code == 0, err
    assert json.loads(out)["config"]["parallel"]["tp_comm_overlap"] is True


def test_the_report_states_the_switches_it_assumed(run_cli) -> None:
    code, out, err = run_cli("simulate", *TRAIN)
    assert code == 0, err
    assert "switches         --no-tp-comm-overlap --overlap-param-gather --grad-reduce-in-fp32" in out
    code, out, err = run_cli("simulate", *TRAIN, "--zero", "1", "--sp", "--tp-comm-overlap",
                             "--no-overlap-param-gather", "--grad-reduce-in-bf16")
    assert code == 0, err
    assert "switches         --tp-comm-overlap --no-overlap-param-gather --grad-reduce-in-bf16" in out


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
