"""Prefix caching, client timeouts, per-request output, engine profiles and whole-prompt
scheduling of the serving engine, against hand-worked cases."""

from __future__ import annotations

import csv
import json
from importlib import resources

import numpy as np
import pytest
import yaml

from stage_cosim import api
from stage_cosim.hardware import resolve_cluster
from stage_cosim.inference import InferenceConfig
from stage_cosim.inference.config import BatchShape, Sequence
from stage_cosim.parallel import ParallelConfig
from stage_cosim.serving.config import SLO, ServingConfig
from stage_cosim.serving.engine import Cluster
from stage_cosim.serving.engines import engine_names, engine_profile
from stage_cosim.serving.instance import KVLayout
from stage_cosim.serving.prefix import block_keys
from stage_cosim.serving.requests import Requests, RequestStream, read_trace
from stage_cosim.serving.run import _windows, deploy, simulate_serving


@pytest.fixture(scope="module")
def llama():
    from stage_cosim.model import resolve_model

    return resolve_model("llama3-8b").with_overrides(layers=4)


def _deployment(llama, **serving):
    return deploy(llama, ParallelConfig(), InferenceConfig("decode"), resolve_cluster("dgx-h100", 1),
                  ServingConfig(step_resolution=0.0, **serving))


def _run(dep, reqs):
    return Cluster(dep.pools, dep.serving, dep.cluster, _windows(dep.model)).run(reqs)


def _apart(inputs, ids, outputs=None, gap=10.0) -> Requests:
    """Requests far enough apart that each finishes before the next arrives."""
    n = len(inputs)
    return Requests(np.arange(n) * gap, np.asarray(inputs), np.asarray(outputs or [2] * n), tuple(ids), 512)


# -- prefix caching ---------------------------------------------------------------------------------

def test_block_identities_follow_the_shared_tokens() -> None:
    """With 512-token hash ids and 16-token blocks, prompts whose first id agrees share exactly
    the 32 blocks it covers; tokens past the last id are nobody's but the prompt's."""
    a = block_keys((7, 8), 512, 1000, 16)
    b = block_keys((7, 9), 512, 1000, 16)
    assert len(a) == 1000 // 16 and a[:32] == b[:32] and a[32] != b[32]
    assert len(block_keys((7,), 512, 1000, 16)) == 32
    # a block straddling two ids (24-token blocks over 512-token ids) depends on both
    c, d = block_keys((7, 8), 512, 1000, 24), block_keys((7, 9), 512, 1000, 24)
    assert c[:21] == d[:21] and c[21] != d[21]          # block 21 holds tokens 504..527


def test_prefix_hits_hand_worked(llama) -> None:
    """A (600 tokens, id 1) fills the cache with the 32 blocks of its id; B (700, id 1) hits all
    512 tokens; C (520, id 2) hits none; D (exactly 512, id 1) hits 31 blocks, its last token is
    computed (vLLM's rule). B's first token is one prefill of its 188 new tokens over 512 cached."""
    dep = _deployment(llama, enable_prefix_caching=True)
    reqs = _apart([600, 700, 520, 512], [(1,), (1,), (2,), (1,)])
    log, trace = _run(dep, reqs)
    assert log.cached_tokens == [0, 512, 0, 496]
    assert trace.prefix_hit_tokens == 512 + 496
    assert trace.prefix_queried_tokens == 600 + 700 + 520 + 512
    step = dep.kind.timer(BatchShape.of([Sequence(188, 512)], frozenset(llama.layer_windows())))
    assert log.first_token[1] - log.arrival[1] == pytest.approx(step, rel=1e-9)
    report = simulate_serving(dep, reqs, SLO())
    assert report["prefix_cache"]["hit_rate"] == pytest.approx(1008 / 2332)
    # off: nothing hits and B prefills all its 700 tokens
    off, _ = _run(_deployment(llama), reqs)
    assert off.cached_tokens == [0, 0, 0, 0]
    full = dep.kind.timer(BatchShape.of([Sequence(700, 0)], frozenset(llama.layer_windows())))
    assert off.first_token[1] - off.arrival[1] == pytest.approx(full, rel=1e-9)


def test_generated_prefix_groups_share_their_prefix(llama) -> None:
    """Every request of one group after the group's first hits the whole shared prefix (the
    prefix is a multiple of the block size and shorter than the prompt)."""
    stream = RequestStream(rate=0.1, num_requests=12, input_len=100, output_len=2, lengths="fixed",
                           prefix_len=256, prefix_groups=3, seed=1)
    reqs = stream.generate()
    assert reqs.input_len.tolist() == [356] * 12
    log, _ = _run(_deployment(llama, enable_prefix_caching=True), reqs)
    groups = [ids[0] for ids in reqs.hash_ids]
    want = [0 if groups[i] not in groups[:i] else 256 for i in range(12)]
    assert log.cached_tokens == want


def test_eviction_under_a_tiny_cache(llama) -> None:
    """A cache of 50 blocks. A (600 tokens, id 1) leaves its 32 prefix blocks cached and free;
    B (700 tokens, id 2) needs 44 blocks, so 26 of A's are evicted — its tail first, as vLLM
    frees them — and C (600, id 1) still hits A's first 6 blocks: 96 tokens."""
    dep = _deployment(llama, enable_prefix_caching=True)
    kv = dep.kind.kv
    dep.kind.kv = KVLayout(16, kv.bytes_per_token, kv.usage_of(50 * 16))
    log, trace = _run(dep, _apart([600, 700, 600], [(1,), (2,), (1,)], [1, 1, 1]))
    assert log.cached_tokens == [0, 0, 96]
    # C needs 38 blocks less its 6 hits: 32 new ones, with 6 used and B's 32 cached and free
    # in 50, 20 of B's are evicted too
    assert trace.prefix_evicted_blocks == 26 + 20


def test_mooncake_trace_is_read_as_it_is(tmp_path) -> None:
    path = tmp_path / "mooncake.jsonl"
    path.write_text('{"timestamp": 1500, "input_length": 1030, "output_length": 7, "hash_ids": [0, 1, 2]}\n'
                    '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 5]}\n')
    reqs = read_trace(path)
    assert reqs.arrival_s.tolist() == [0.0, 1.5] and reqs.input_len.tolist() == [600, 1030]
    assert reqs.hash_ids == ((0, 5), (0, 1, 2)) and reqs.hash_block == 512
    csv_path = tmp_path / "t.csv"
    csv_path.write_text('arrival_s,input_len,output_len,hash_ids\n0,600,3,"[4, 5]"\n1,600,3,4 6\n')
    assert read_trace(csv_path).hash_ids == ((4, 5), (4, 6))


# -- client timeouts --------------------------------------------------------------------------------

def test_a_stream_past_capacity_drops_and_its_queue_stays_bounded(llama) -> None:
    """One request at a time, each of 10 steps of at least 0.1 s: capacity is under 1 request/s.
    At 3 requests/s with a 5 s timeout, requests are dropped, none completes late, and the
    requests in the system at any time arrived within the last timeout (plus one step)."""
    dep = _deployment(llama, max_num_seqs=1, chunk_tokens=64, step_overhead_s=0.1, request_timeout_s=5.0)
    reqs = RequestStream(rate=3.0, num_requests=300, input_len=16, output_len=10, lengths="fixed").generate()
    log, trace = _run(dep, reqs)
    arrival = np.asarray(log.arrival)
    finish, dropped = np.asarray(log.finish), np.asarray(log.dropped)
    done = ~np.isnan(finish) & ~dropped
    assert dropped.sum() > 150 and done.sum() + dropped.sum() == 300
    assert np.all(finish[done] - arrival[done] <= 5.0)
    longest = max(trace.step_time_s)
    for t, n in zip(trace.occupancy_t, trace.occupancy_n):
        recent = np.count_nonzero((arrival <= t) & (arrival > t - 5.0 - longest))
        assert n <= recent
    assert max(trace.occupancy_n) <= 3.0 * 5.0 * 2     # far from 300: the queue does not grow
    # finished requests came at most one per 10 steps of 0.1 s
    assert done.sum() <= (trace.end_s - arrival[0]) / 1.0 + 1
    report = simulate_serving(dep, reqs, SLO())
    assert report["requests"]["dropped"] == dropped.sum()
    assert report["littles_law"]["relative_error"] < 0.02


# -- per-request output -----------------------------------------------------------------------------

def test_requests_out_csv(tmp_path) -> None:
    out = tmp_path / "requests.csv"
    report = api.serve_sim({"model": "llama3-8b", "layers": 4, "rate": 2.0, "num_requests": 6, "input_len": 100,
                            "output_len": 4, "lengths": "fixed", "prefix_len": 512, "prefix_groups": 1,
                            "enable_prefix_caching": True, "requests_out": str(out)})
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == ["arrival_s", "first_token_s", "finish_s", "input_tokens", "cached_tokens",
                             "output_tokens", "dropped"]
    assert len(rows) == 6 and [r["input_tokens"] for r in rows] == ["612"] * 6
    assert rows[0]["cached_tokens"] == "0" and all(r["cached_tokens"] == "512" for r in rows[1:])
    assert all(float(r["arrival_s"]) < float(r["first_token_s"]) <= float(r["finish_s"]) for r in rows)
    assert [p.name for p in tmp_path.iterdir()] == ["requests.csv"]        # no temporary file left
    assert report["requests"]["completed"] == 6


# -- engine profiles and scheduling policies --------------------------------------------------------

def test_engine_profiles_are_their_files() -> None:
    assert {"vllm-0.5", "vllm-0.6", "vllm-v1", "sglang", "trtllm"} <= set(engine_names())
    for name in engine_names():
        doc = yaml.safe_load(resources.files("stage_cosim.serving").joinpath("data", f"{name}.yaml").read_text())
        p = engine_profile(name)
        over = doc.get("overheads", {})
        base, per = over.get("step_s", 0.0), over.get("step_per_tp_worker_s", 0.0)
        assert p.step_overhead(4) == pytest.approx(base + 3 * per)
        s = p.settings(4)
        assert s["max_num_seqs"] == doc["scheduler"]["max_num_seqs"]
        assert s["chunk_tokens"] == doc["scheduler"]["chunk_tokens"]
        assert s["enable_prefix_caching"] == doc["scheduler"]["enable_prefix_caching"]
        ServingConfig(**s)          # a valid configuration


def test_engine_settings_yield_to_the_request() -> None:
    cfg, _ = api.serving_of({"engine": "vllm-v1", "max_num_seqs": 64, "tp": 2})
    prof = engine_profile("vllm-v1")
    assert cfg.max_num_seqs == 64 and cfg.chunk_tokens == prof.chunk_tokens
    assert cfg.enable_prefix_caching is prof.enable_prefix_caching
    assert cfg.step_overhead_s == pytest.approx(prof.step_overhead(2))


def test_whole_prompt_steps_pause_the_decodes(llama) -> None:
    """Without chunked prefill, B's prompt arriving while A decodes gets a step of its own (no
    decode in it): two decode-free steps (A's and B's prompts) against one with chunking."""
    reqs = Requests(np.array([0.0, 0.01]), np.array([64, 64]), np.array([40, 5]))
    for chunked, want in ((False, 2), (True, 1)):
        _, trace = _run(_deployment(llama, enable_chunked_prefill=chunked), reqs)
        assert trace.step_decodes.count(0) == want


@pytest.mark.parametrize("args,message", [
    (["--engine", "vllm-9"], "engine"),
    (["--request-timeout", "-3"], "request-timeout"),
    (["--prefix-len", "-1"], "prefix-len"),
    (["--prefix-groups", "0"], "prefix-groups"),
    (["--requests-out", "out.txt"], "requests-out"),
])
def test_cli_errors(run_cli, args, message) -> None:
    code, out, err = run_cli("serve-sim", "--model", "llama3-8b", "--layers", "4", "--rate", "5", *args)
    assert code == 2 and err.startswith("error: ") and message in err.splitlines()[0] and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_cli_prints_drops_and_hits(run_cli, tmp_path) -> None:
    code, out, err = run_cli("serve-sim", "--model", "llama3-8b", "--layers", "4", "--rate", "5", "--num-requests",
                             "20", "--prefix-len", "512", "--enable-prefix-caching", "--engine", "vllm-v1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["engine"] == "vllm-v1" and doc["prefix_cache"]["hit_rate"] > 0
    assert doc["serving"]["request_timeout_s"] == 300
    code, out, err = run_cli("serve-sim", "--model", "llama3-8b", "--layers", "4", "--rate", "5", "--num-requests",
                             "20", "--prefix-len", "512", "--enable-prefix-caching")
    assert code == 0, err
    assert "prefix cache" in out and "dropped" in out


# -- what limits admission without a KV cache -------------------------------------------------------

def test_a_cache_without_tokens_counts_sequences() -> None:
    """A pure state-space model caches no tokens: its cache holds 10 GiB / 100 MiB = 102.4, so
    102 sequences' states, whatever their length, and no token count (it has none to give);
    a hybrid's cache still counts tokens: 10 GiB less one 100 MiB state over 4 KiB per token
    (whole 16-token blocks), 10,140 MiB / 4 KiB = 2,595,840 tokens of one sequence."""
    gib, mib = 1 << 30, 1 << 20
    ssm = KVLayout(16, (), 10 * gib, 100 * mib)
    assert ssm.tokens is None and ssm.sequences == 102
    hybrid = KVLayout(16, ((None, 4096.0),), 10 * gib, 100 * mib)
    assert hybrid.tokens == 2_595_840 and hybrid.sequences == 102
    assert KVLayout(16, ((None, 4096.0),), 10 * gib).sequences is None


def test_cli_says_the_state_limits_a_pure_ssm(run_cli) -> None:
    """serve-sim on Mamba-Codestral 7B (no attention layers) reports the sequences whose state
    fits, not a token capacity."""
    code, out, err = run_cli("serve-sim", "--model", "mamba-codestral-7b", "--layers", "4", "--rate", "5",
                             "--num-requests", "10", "--cluster", "dgx-h100:1", "--json")
    assert code == 0, err
    inst = json.loads(out)["deployment"]["instance"]
    assert inst["kv_capacity_tokens_per_rank"] is None
    assert inst["state_capacity_sequences_per_rank"] == int(inst["kv_capacity_bytes_per_gpu"]
                                                            // inst["state_bytes_per_sequence_per_gpu"])
    code, out, err = run_cli("serve-sim", "--model", "mamba-codestral-7b", "--layers", "4", "--rate", "5",
                             "--num-requests", "10", "--cluster", "dgx-h100:1")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("memory per GPU"))
    assert f"the state of {inst['state_capacity_sequences_per_rank']:,} sequences per attention rank" in line
    assert "tokens per attention rank" not in line
