"""CUDA-graph padding of decode steps (--cuda-graph-sizes), against hand-worked cases."""

from __future__ import annotations

import numpy as np
import pytest

from stage_cosim.errors import UserError
from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference import InferenceConfig
from stage_cosim.inference.config import BatchShape, Sequence
from stage_cosim.parallel import ParallelConfig
from stage_cosim.serving.config import ServingConfig
from stage_cosim.serving.engine import Cluster, _padded
from stage_cosim.serving.requests import Requests
from stage_cosim.serving.run import _windows, deploy


@pytest.fixture(scope="module")
def llama():
    from stage_cosim.model import resolve_model

    return resolve_model("llama3-8b").with_overrides(layers=4)


def _run(llama, n, **serving):
    dep = deploy(llama, ParallelConfig(), InferenceConfig("decode"), resolve_cluster("dgx-h100", 1),
                 ServingConfig(step_resolution=0.0, **serving))
    reqs = Requests(np.zeros(n), np.full(n, 64), np.full(n, 5))
    log, trace = Cluster(dep.pools, dep.serving, dep.cluster, _windows(dep.model)).run(reqs)
    return dep, log, trace


def test_three_decodes_run_as_four(llama) -> None:
    """Three 64-token prompts arriving at once: the first runs alone; the next step decodes it
    and prefills the other two (not padded: it has prompt chunks); the third decodes all three
    (over 65, 64 and 64 cached tokens, their new token included) and is replayed at the captured
    size 4: one dummy request decoding one token over its own."""
    windows = frozenset(llama.layer_windows())
    dep, log, trace = _run(llama, 3, cuda_graph_sizes=(1, 2, 4, 8))
    mixed = dep.kind.timer(BatchShape.of([Sequence(1, 64), Sequence(64, 0), Sequence(64, 0)], windows))
    decode = dep.kind.timer(BatchShape.of([Sequence(1, 65), Sequence(1, 64), Sequence(1, 64), Sequence(1, 0)],
                                          windows))
    assert trace.step_time_s[1] == mixed
    assert trace.step_time_s[2] == decode
    assert trace.step_decodes[2] == 3          # the dummy is no request
    # without padding the same step is the three requests' own
    _, _, plain = _run(llama, 3)
    own = dep.kind.timer(BatchShape.of([Sequence(1, 65), Sequence(1, 64), Sequence(1, 64)], windows))
    assert plain.step_time_s[2] == own < decode


def test_a_batch_on_or_past_the_sizes_runs_as_it_is(llama) -> None:
    shape = BatchShape.of([Sequence(1, 10)] * 4, frozenset(llama.layer_windows()))
    assert _padded(shape, (1, 2, 4)) is shape
    assert _padded(shape, (1, 2)) is shape
    assert _padded(shape, (8,)).sequences == 8 and _padded(shape, (8,)).tokens == 8


def test_sizes_are_read_and_checked() -> None:
    assert ServingConfig(cuda_graph_sizes="8, 1,2,2").cuda_graph_sizes == (1, 2, 8)
    assert ServingConfig(cuda_graph_sizes=[4, 2]).cuda_graph_sizes == (2, 4)
    for bad in ("0", "1,x", "", [], [1.5], [True]):
        with pytest.raises(UserError, match="cuda-graph-sizes"):
            ServingConfig(cuda_graph_sizes=bad)


def test_cli_error_is_one_line(run_cli) -> None:
    code, out, err = run_cli("serve-sim", "--model", "llama3-8b", "--layers", "4", "--rate", "5",
                             "--cuda-graph-sizes", "4,-1")
    assert code == 2 and err.startswith("error: ") and "cuda-graph-sizes" in err
    assert len(err.strip().splitlines()) == 1


def test_trtllm_bench_limits_hand_worked() -> None:
    """trtllm-bench's own batch limits (its tuning.py), as the serving validation sets them for
    NVIDIA's runs. Llama 3.1 405B FP8 on eight 80 GiB H100 at 2048/2048: its weights take P bytes
    of the 640 GiB, a token's FP8 KV cache 2 · 126 layers · max(8 ranks, 8 heads) · 128 B over
    the GPUs; 95 % of the rest holds 252.9 requests of 4,096 tokens: under 256, rounded up to a
    multiple of 32 (256); tokens 2 · 252.9, at least 2,048. Qwen3-235B-A22B at 1000/1000 counts
    8 KV heads a token (one per tensor-parallel rank; it has 4): 1,115.5 requests, rounded up to
    a multiple of 256 (1,280); 2,231 tokens, to a multiple of 256 (2,304)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from validate_serving import trtllm_bench_settings

    from stage_cosim.model import resolve_model

    def requests(name: str, layers: int, seq: int) -> float:
        weights = resolve_model(name).param_count() / 2**30
        return 0.95 * (8 * 80 - weights) / (2 * layers * 8 * 128 / 2**30 * seq)

    assert 224 < requests("llama3.1-405b", 126, 4096) <= 256
    row = dict(model="llama3.1-405b", tp="8", input_len="2048", output_len="2048", weight_dtype="fp8",
               kv_cache_dtype="fp8")
    assert trtllm_bench_settings(row, 80.0) == (256, 2048)
    n = requests("qwen3-235b-a22b", 94, 2000)
    assert 1024 < n <= 1280 and 2048 < 2 * n <= 2304
    qwen = dict(row, model="qwen3-235b-a22b", input_len="1000", output_len="1000")
    assert trtllm_bench_settings(qwen, 80.0) == (1280, 2304)
