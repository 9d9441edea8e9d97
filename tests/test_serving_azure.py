"""TensorRT-LLM's admission that reserves a request's whole output (GUARANTEED_NO_EVICT), and the
settings the serving validation gives the Azure guide's runs, against hand-worked cases."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from stage_cosim.serving.config import ServingConfig
from stage_cosim.serving.engines import engine_profile
from stage_cosim.serving.instance import KVLayout
from stage_cosim.serving.requests import Requests
from stage_cosim.serving.scheduler import MIXED, Rank, RequestLog


def _drain(guaranteed_no_evict: bool) -> tuple[list[int], RequestLog]:
    """Four requests of 32 prompt and 32 output tokens queued at once on a rank whose cache is
    160 bytes (16-token blocks of 1 byte a token); returns the requests running in each step."""
    kv = KVLayout(16, ((None, 1.0),), 160.0)
    cfg = ServingConfig(chunk_tokens=1024, guaranteed_no_evict=guaranteed_no_evict)
    rank = Rank(kv, cfg, (None,), MIXED)
    log = RequestLog(Requests(np.zeros(4), np.full(4, 32), np.full(4, 32)))
    rank.waiting.extend(range(4))
    running, now = [], 0.0
    while (plan := rank.schedule(log, now)) is not None:
        running.append(plan.decodes + len(plan.chunks))
        now += 1.0
        rank.finish(now, 1.0, log)
    return running, log


def test_guaranteed_no_evict_reserves_the_whole_output() -> None:
    """Each request holds 64 tokens (4 blocks, 64 bytes) by its last one. Reserving them, two
    fit the 160 bytes (a third would need 192): they run alone for their 32 steps (the prompt's,
    then 31 decodes), then the other two, and nobody is preempted. Admitting on the prompt
    alone (2 blocks each) takes all four at once; at 48 tokens each they need 3 blocks, 192
    bytes: the cache overflows and requests are preempted and recomputed."""
    running, log = _drain(True)
    assert running == [2] * 32 + [2] * 32
    assert sum(log.preemptions) == 0 and all(g == 32 for g in log.generated)
    running, log = _drain(False)
    assert running[0] == 4 and sum(log.preemptions) > 0
    assert all(g == 32 for g in log.generated)


def test_guaranteed_no_evict_must_be_a_bool() -> None:
    from stage_cosim.errors import UserError

    with pytest.raises(UserError, match="guaranteed-no-evict"):
        ServingConfig(guaranteed_no_evict="yes")


def test_trtllm_profile_reserves_and_vllm_does_not() -> None:
    assert engine_profile("trtllm").guaranteed_no_evict is True
    assert engine_profile("trtllm").settings()["guaranteed_no_evict"] is True
    assert engine_profile("vllm-0.6").guaranteed_no_evict is False


def _validate_serving():  # noqa: ANN202 (the benchmark script as a module)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import validate_serving

    return validate_serving


def test_azure_trtllm_runs_use_the_engine_built_for_2048_2048() -> None:
    """The guide builds one engine per model from its longest dataset (2048/2048) and runs
    every length on it. Llama 3.1 8B FP8 on an 80 GiB H100: 95 % of the 80 GiB less its weights
    (8.03 GB) at 64 KiB of FP8 KV a token (2 · 32 layers · 8 heads · 128) holds 275.6 requests
    of 4,096 tokens: a batch limit of 384 (a multiple of 128 between 256 and 1,024) and 2,048
    tokens a step (2 · 275.6 = 551, at least 2,048), whatever the row's own lengths. The KV
    cache is 0.83 of what the weights leave: serve-sim's hbm_utilization
    0.83 + 0.17 · weights / HBM."""
    vs = _validate_serving()
    from stage_cosim.model import resolve_model

    rows = [r for r in vs.azure_rows() if r["gpu"].startswith("H100") and r["model"] == "llama3-8b"]
    assert {(r["build_input_len"], r["build_output_len"]) for r in rows} == {("2048", "2048")}
    weights = resolve_model("llama3-8b").param_count()
    requests = 0.95 * (80 - weights / 2**30) * 2**30 / (2 * 32 * 8 * 128 * 4096)
    assert 256 < requests <= 384 and 2 * requests < 2048
    short = next(r for r in rows if r["output_len"] == "128")
    s = vs.azure_settings(short)
    assert (s["max_num_seqs"], s["chunk_tokens"]) == (384, 2048)
    assert s["hbm_utilization"] == pytest.approx(0.83 + 0.17 * weights / (80 * 2**30))


def test_azure_vllm_runs_as_the_guide_ran_them() -> None:
    """MI300X: --max-num-batched-tokens 131072 with chunked prefill off, --max-num-seqs 3000,
    --gpu-memory-utilization 0.90, and vLLM V0's CUDA graphs (1, 2, 4, then every 8 to 256)."""
    vs = _validate_serving()
    row = next(r for r in vs.azure_rows() if r["engine"] == "vllm-0.6")
    s = vs.azure_settings(row)
    assert (s["max_num_seqs"], s["chunk_tokens"], s["enable_chunked_prefill"], s["hbm_utilization"]) == \
        (3000, 131072, False, 0.90)
    graphs = s["cuda_graph_sizes"]
    assert graphs[:4] == (1, 2, 4, 8) and graphs[-1] == 256 and len(graphs) == 35


def test_the_request_may_turn_the_engine_policy_off() -> None:
    """--engine trtllm reserves; --no-guaranteed-no-evict (the request's field) overrides it, as
    every engine setting yields to the request."""
    from stage_cosim import api

    assert api.serving_of({"engine": "trtllm"})[0].guaranteed_no_evict is True
    assert api.serving_of({"engine": "trtllm", "guaranteed_no_evict": False})[0].guaranteed_no_evict is False
    req = dict(model="llama3-8b", cluster="dgx-h100:1", rate=1e9, num_requests=4, input_len=64, output_len=4,
               lengths="fixed", engine="trtllm", guaranteed_no_evict=False)
    assert api.serve_sim(req)["requests"]["completed"] == 4
