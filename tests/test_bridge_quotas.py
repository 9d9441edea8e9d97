"""The bridge under hostile clients: every client gets its share, and records stay bounded.

Each test sends what a hostile client sent to a real server on a loopback port: a
3 MB request_id, a YAML document of sexagesimal integers, a day-long timeout, a re-parsed
artifact index, a job that fills the disk, silent and crowded connections, and page tokens and
cluster names that broke the old checks.
"""

from __future__ import annotations

import json
import socket
import time

import grpc
import pytest

from stage_cosim.bridge import Client
from stage_cosim.bridge.artifacts import ArtifactIndex, PageCache
from stage_cosim.bridge.documents import DocumentLimits, load_yaml
from stage_cosim.bridge.fair import FairGate, FairQueue, ParseMeter
from stage_cosim.bridge.limits import Limits
from stage_cosim.bridge.paths import disk_usage
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.quotas import MIB, Quotas
from stage_cosim.bridge.server import start_in_thread
from stage_cosim.bridge.status import detail_of
from stage_cosim.errors import UserError
from test_bridge import SMALL, config
from test_bridge_hardening import submit_raw

SEXAGESIMAL = "num_gpus: " + ":".join(["1"] * 127_000) + "\n"       # 254 KB, as the hostile client sent


def wait_state(client: Client, job_id: str, states: set[int], limit_s: float = 60.0) -> pb.Job:
    """The job once it is in one of ``states`` (polled; ``limit_s`` only ends a hung test)."""
    end = time.monotonic() + limit_s
    while True:
        job = client.job(job_id)
        if job.state in states or time.monotonic() > end:
            return job
        time.sleep(0.05)


def until(condition, limit_s: float = 60.0) -> bool:
    """Poll ``condition`` until it holds (a job's final event precedes its record and the disk
    accounting by a moment); ``limit_s`` only ends a hung test."""
    end = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def persisted(manager, ids) -> bool:  # noqa: ANN001
    return all(i in manager._usage for i in ids)  # noqa: SLF001


# -- 1. every string field bounded; records bounded in memory ---------------------------------------------

def test_a_3_mb_request_id_is_refused_and_one_at_the_limit_accepted() -> None:
    limit = Quotas().max_field_chars
    with start_in_thread(config()) as s, Client(s.address, retries=0) as c:
        message = pb.SubmitJobRequest(simulate=pb.SimulateJob(design=pb.Design(**SMALL)), request_id="r" * (3 << 20))
        with pytest.raises(grpc.RpcError) as err:
            c.stub.SubmitJob(message, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == f"request_id: is {3 << 20:,} characters long: more than {limit:,} " \
                                      "characters (this server's limit)"
        assert detail_of(err.value).field == "request_id"
        assert c.server_info().jobs == 0                       # nothing kept, in memory or on disk
        assert not list((s.server.manager.jobs_root).iterdir())
        job = c.submit("simulate", SMALL, request_id="r" * limit)
        assert job.request_id == "r" * limit


@pytest.mark.parametrize("field, design", [("model", {"model": "m" * 2000}),
                                           ("axis_order", {"axis_order": ["tp", "d" * 2000]}),
                                           ("cluster", {"cluster": "dgx-h100:" + "8" * 2000})])
def test_every_text_field_that_is_not_a_document_is_bounded(field, design) -> None:
    limit = 1000
    with start_in_thread(config(quotas=Quotas(max_field_chars=limit))) as s, Client(s.address, retries=0) as c:
        message = pb.SubmitJobRequest(synthesize=pb.SynthJob(design=pb.Design(**{**SMALL, **design})))
        with pytest.raises(grpc.RpcError) as err:
            c.stub.SubmitJob(message, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        length = len(design[field]) if field != "axis_order" else 2000
        assert err.value.details() == f"{field}: is {length:,} characters long: more than 1,000 characters " \
                                      "(this server's limit)"
        # a field at the limit passes this check and meets the field's own rule
        doc = pb.SubmitJobRequest(synthesize=pb.SynthJob(format="x" * limit))
        with pytest.raises(grpc.RpcError) as err:
            c.stub.SubmitJob(doc, timeout=60)
        assert err.value.details().startswith("format: must be chakra or json")       # at the limit: checked on


def test_finished_records_in_memory_stay_within_the_operators_bound(tmp_path) -> None:
    """Six finished jobs; the bound holds the newest records whose bytes on disk (record and event
    log) and inline result fit it, oldest dropped first; GetJob and ListJobs still find them all."""
    one_job = 14_600                       # measured: a small simulation's record, events and result
    bound = int(2.5 * one_job)
    cfg = config(data_dir=tmp_path, quotas=Quotas(record_memory_bytes=bound), limits=Limits(workers=1))
    with start_in_thread(cfg) as s, Client(s.address, retries=0) as c:
        ids = [c.wait(c.submit("simulate", dict(SMALL, layers=n)).id).id for n in range(1, 7)]
        manager = s.server.manager
        assert until(lambda: persisted(manager, ids))
        in_memory = {i for i in ids if i in manager.jobs}
        # independently: the newest jobs whose files fit the bound
        weights = {}
        for i in ids:
            d = tmp_path / "jobs" / i
            result = (d / "artifacts" / "result.json").read_text()
            weights[i] = (d / "job.json").stat().st_size + (d / "events.jsonl").stat().st_size + len(result)
        expected, used = set(), 0
        for i in reversed(ids):
            if used + weights[i] > bound:
                break
            expected.add(i)
            used += weights[i]
        assert 1 <= len(expected) < len(ids)
        assert in_memory == expected and manager.record_bytes == used <= bound
        assert {j.id for j in c.jobs()} == set(ids)          # listed from the store
        assert all(c.job(i).state == pb.SUCCEEDED for i in ids)


# -- 2. YAML: 1.2 numbers, no sexagesimal; parsing metered and taken in turns --------------------------

def test_sexagesimal_scalars_are_text_and_numbers_follow_yaml_1_2() -> None:
    doc = load_yaml(SEXAGESIMAL, "cluster_description", DocumentLimits())
    assert doc["num_gpus"] == SEXAGESIMAL[len("num_gpus: "):-1]           # a string: no base-60 integer
    # YAML 1.2 core schema: leading zeros are decimal, 0o octal, 0x hex; an exponent makes a float
    values = load_yaml("a: 010\nb: 0o17\nc: 0x1F\nd: 1e3\ne: -2.5\nf: 1:30\ng: 190:20:30.15\n", "x", DocumentLimits())
    assert values == {"a": 10, "b": 15, "c": 31, "d": 1000.0, "e": -2.5, "f": "1:30", "g": "190:20:30.15"}


def test_a_sexagesimal_cluster_description_is_refused_naming_the_field() -> None:
    with start_in_thread(config()) as s, Client(s.address, retries=0) as c:
        code, details = submit_raw(c, "simulate", {**SMALL, "cluster_description": SEXAGESIMAL})
        assert code == "INVALID_ARGUMENT" and details.startswith("cluster"), details[:200]


def test_a_client_past_its_parsing_budget_is_refused_with_a_retry_delay() -> None:
    quotas = Quotas(parse_budget_s=1e-4, parse_refill=1e-3)
    with start_in_thread(config(quotas=quotas)) as s, Client(s.address, retries=0) as hostile, \
            Client(s.address, retries=0) as honest:
        first = submit_raw(hostile, "simulate", {**SMALL, "cluster_description": SEXAGESIMAL})
        assert first[0] == "INVALID_ARGUMENT"                    # parsed (and charged), then refused
        message = pb.SubmitJobRequest(simulate=pb.SimulateJob(design=pb.Design(**SMALL)))
        with pytest.raises(grpc.RpcError) as err:
            hostile.stub.SubmitJob(message, timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.details().startswith("parsing:")
        detail = detail_of(err.value)
        assert detail.reason == "PARSE_BUDGET" and detail.retry_after_s > 0
        assert honest.submit("simulate", SMALL).state in (pb.QUEUED, pb.RUNNING, pb.SUCCEEDED)   # its own budget


def test_parse_meter_is_a_token_bucket() -> None:
    now = [0.0]
    meter = ParseMeter(budget_s=2.0, refill=0.5, clock=lambda: now[0])
    assert meter.wait_s("a") == 0.0
    meter.charge("a", 3.0)                     # 2 - 3 = -1 s: empty for 1 / 0.5 = 2 s
    assert meter.wait_s("a") == pytest.approx(2.0, abs=0.01) and meter.wait_s("b") == 0.0
    now[0] = 1.0
    assert meter.wait_s("a") == pytest.approx(1.0, abs=0.01)
    now[0] = 2.1                               # -1 + 2.1 * 0.5 = 0.05 s left: may parse
    assert meter.wait_s("a") == 0.0


def test_fair_gate_takes_clients_in_turn() -> None:
    """Two permits, one per client: a client with four parses waiting gets one at a time, and a
    client arriving later is served before that client's second."""
    import asyncio

    async def scenario() -> list[str]:
        gate, order, release = FairGate(2), [], asyncio.Event()

        async def parse(client: str, n: int) -> None:
            async with gate.slot(client):
                order.append(f"{client}{n}")
                await release.wait()

        tasks = [asyncio.create_task(parse("a", n)) for n in range(4)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(parse("b", 0)))
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["a0", "b0", "a1", "a2", "a3"]


# -- 3. the operator's run time; a fair queue -------------------------------------------------------------

def test_a_day_long_timeout_is_clamped_to_the_operators_maximum() -> None:
    with start_in_thread(config()) as s, Client(s.address, retries=0) as c:
        job = c.submit("simulate", SMALL, timeout_s=86400)
        assert job.timeout_s == 3600.0                            # Quotas().max_run_s, the default
        assert c.server_info().max_timeout_s == 3600.0
    with start_in_thread(config(quotas=Quotas(max_run_s=30, max_cpu_s=20))) as s, Client(s.address) as c:
        job = c.submit("simulate", dict(SMALL, layers=3), timeout_s=86400)
        assert job.timeout_s == 30.0
        assert s.server.manager.cpu_s(s.server.manager.get(job.id)) == 20.0


def test_fair_queue_round_robin_with_a_per_client_cap() -> None:
    import asyncio

    async def scenario() -> list:
        q: FairQueue[str] = FairQueue(cap=1)
        for item in ("a1", "a2", "a3"):
            q.put_nowait("a", item)
        q.put_nowait("b", "b1")
        q.put_nowait("c", "c1")
        taken = [q.take_nowait() for _ in range(4)]       # a at its cap after a1: b1, c1, then nothing
        q.done("a")
        taken.append(q.take_nowait())
        return taken

    assert asyncio.run(scenario()) == [("a", "a1"), ("b", "b1"), ("c", "c1"), None, ("a", "a2")]


def test_one_clients_long_jobs_do_not_hold_every_worker() -> None:
    """Two workers, so one job per client: the long-job client's second job waits while another
    client's job runs and succeeds."""
    long = {"budget": 1000, "sleep": 0.05}
    with start_in_thread(config()) as s, Client(s.address, retries=0) as greedy, \
            Client(s.address, retries=0) as other:
        first = greedy.submit("optimize", SMALL, settings=long)
        second = greedy.submit("optimize", dict(SMALL, layers=3), settings=long)
        assert wait_state(greedy, first.id, {pb.RUNNING}).state == pb.RUNNING
        mine = other.wait(other.submit("simulate", SMALL).id)
        assert mine.state == pb.SUCCEEDED
        assert greedy.job(second.id).state == pb.QUEUED             # the greedy client's cap
        greedy.cancel(first.id)
        assert wait_state(greedy, second.id, {pb.RUNNING, pb.SUCCEEDED}).state in (pb.RUNNING, pb.SUCCEEDED)
        greedy.cancel(second.id)


# -- 4. artifacts indexed once, paged from the index ---------------------------------------------------------

def test_artifact_index_spans_prefixes_by_bisection() -> None:
    files = [{"path": p, "size": n, "sha256": "0" * 64} for n, p in
             enumerate(["traces/b.et", "manifest.json", "traces/a.et", "traces-x/c.et", "traces/sub/d.et"])]
    index = ArtifactIndex.of(files)
    lo, hi = index.span("traces/")
    assert [index.paths[i] for i in range(lo, hi)] == ["traces/a.et", "traces/b.et", "traces/sub/d.et"]
    assert index.find("traces/b.et") == files[0] and index.find("traces/") is None
    assert index.total_bytes == sum(range(5))


def test_page_cache_answers_only_for_its_index_within_its_bytes() -> None:
    one = ArtifactIndex.of([{"path": "a", "size": 1, "sha256": "0" * 64}])
    other = ArtifactIndex.of([{"path": "a", "size": 1, "sha256": "0" * 64}])     # equal, not the same
    cache = PageCache(max_bytes=100)
    cache.put("k1", one, "page 1", 60)
    assert cache.get("k1", one) == "page 1" and cache.get("k1", other) is None    # a reloaded index: rebuilt
    cache.put("k2", one, "page 2", 60)                # 120 bytes > 100: the least recently used goes
    assert cache.get("k1", one) is None and cache.get("k2", one) == "page 2"
    cache.put("k3", one, "too big", 101)              # larger than the whole cache: not kept
    assert cache.get("k3", one) is None and cache.get("k2", one) == "page 2"


def test_listing_and_download_page_from_the_index_read_once(tmp_path) -> None:
    """The index is read when the job ends: a damaged artifacts.json afterwards changes nothing
    (the old server parsed it again, on its loop, for every call), and pages by prefix add up."""
    with start_in_thread(config(data_dir=tmp_path)) as s, Client(s.address, retries=0) as c:
        job = c.wait(c.submit("synthesize", dict(SMALL, dp=4)).id)
        assert job.state == pb.SUCCEEDED
        index_file = tmp_path / "jobs" / job.id / "artifacts.json"
        expected = sorted(f["path"] for f in json.loads(index_file.read_text()))
        index_file.write_text("not json")
        listed = c.stub.ListArtifacts(pb.ListArtifactsRequest(job_id=job.id), timeout=30)
        assert [f.path for f in listed.files] == expected
        prefix = expected[-1].split("/")[0] + "/" if "/" in expected[-1] else expected[-1]
        pages, token = [], ""
        while True:
            page = c.stub.ListArtifacts(pb.ListArtifactsRequest(job_id=job.id, prefix=prefix, page_size=2,
                                                                page_token=token), timeout=30)
            pages += [f.path for f in page.files]
            token = page.next_page_token
            if not token:
                break
        assert pages == [p for p in expected if p.startswith(prefix)] and len(pages) >= 2
        written = c.download(job.id, tmp_path / "out")
        assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in written) == expected


# -- 5. disk quotas -----------------------------------------------------------------------------------------

def test_a_job_that_writes_past_its_disk_quota_fails_alone(tmp_path) -> None:
    quotas = Quotas(job_disk_bytes=2 * MIB, total_disk_bytes=64 * MIB)
    with start_in_thread(config(quotas=quotas)) as s, Client(s.address, retries=0) as c:
        big = c.wait(c.submit("optimize", SMALL, settings={"big_mib": 3}).id)
        assert big.state == pb.FAILED
        assert big.error == "disk: the job wrote more than this server's 2 MiB per job"
        small = c.wait(c.submit("optimize", SMALL, settings={"big_mib": 1}).id)
        assert small.state == pb.SUCCEEDED and small.result_size > MIB


def test_a_job_of_many_small_files_past_its_quota_fails_alone(tmp_path) -> None:
    """Each file under the quota (RLIMIT_FSIZE does not stop it): the manager's walk of the job's
    directory does."""
    with start_in_thread(config(data_dir=tmp_path)) as s, Client(s.address, retries=0) as c:
        probe = c.wait(c.submit("synthesize", dict(SMALL, dp=8), format="json").id)
        size = disk_usage(tmp_path / "jobs" / probe.id / "artifacts")
        largest = max(p.stat().st_size for p in (tmp_path / "jobs" / probe.id / "artifacts").rglob("*") if p.is_file())
    assert size > 2 * largest                   # a quota between the two: only the walk can see it
    quota = (size + largest) // 2
    with start_in_thread(config(quotas=Quotas(job_disk_bytes=quota))) as s, Client(s.address, retries=0) as c:
        job = c.wait(c.submit("synthesize", dict(SMALL, dp=8), format="json").id)
        assert job.state == pb.FAILED and job.error.startswith("disk: the job wrote more than")
        assert c.wait(c.submit("simulate", SMALL).id).state == pb.SUCCEEDED


def test_total_disk_quota_evicts_the_oldest_finished_jobs_artifacts_first(tmp_path) -> None:
    """One worker; three jobs of about 1 MiB each. Finished jobs may hold the total less one job
    quota (for the job that runs): 2.5 of them. The third job's end evicts the first one's
    artifacts; its record stays, the others download."""
    one = int(1.05 * MIB)
    quotas = Quotas(job_disk_bytes=2 * one, total_disk_bytes=int(4.5 * one))
    with start_in_thread(config(data_dir=tmp_path, quotas=quotas, limits=Limits(workers=1))) as s, \
            Client(s.address, retries=0) as c:
        ids = [c.wait(c.submit("optimize", dict(SMALL, layers=n), settings={"big_mib": 1}).id).id for n in (1, 2, 3)]
        assert [c.job(i).state for i in ids] == [pb.SUCCEEDED] * 3
        manager = s.server.manager
        assert until(lambda: persisted(manager, ids) and ids[0] not in manager._with_artifacts  # noqa: SLF001
                     and manager.disk_bytes == sum(disk_usage(tmp_path / "jobs" / i) for i in ids))
        with pytest.raises(grpc.RpcError) as err:
            c.stub.ListArtifacts(pb.ListArtifactsRequest(job_id=ids[0]), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "deleted" in err.value.details()
        assert not (tmp_path / "jobs" / ids[0] / "artifacts").exists()
        for i in ids[1:]:
            assert c.stub.ListArtifacts(pb.ListArtifactsRequest(job_id=i), timeout=30).files
        assert manager.disk_bytes <= quotas.total_disk_bytes - quotas.job_disk_bytes
        # a resubmit of the evicted job's request runs again rather than coming from the cache
        again = c.wait(c.submit("optimize", dict(SMALL, layers=1), settings={"big_mib": 1}).id)
        assert again.state == pb.SUCCEEDED and not again.cached


def test_a_total_disk_quota_that_cannot_keep_a_finished_job_is_refused() -> None:
    """Two workers each keep a job's 2 MiB free: finished jobs need 2 MiB more, 6 MiB in all."""
    import asyncio

    from stage_cosim.bridge.server import BridgeServer

    quotas = Quotas(job_disk_bytes=2 * MIB, total_disk_bytes=5 * MIB)
    with pytest.raises(UserError) as err:
        asyncio.run(BridgeServer(config(quotas=quotas, limits=Limits(workers=2))).start())
    assert str(err.value) == "total-disk-mib: must be at least 6: --job-disk-mib for each worker and for one " \
                             "finished job"


@pytest.mark.parametrize("flags, line", [
    (["--job-disk-mib", "0"], "error: job-disk-mib: must be positive, got 0"),
    (["--job-disk-mib", "100", "--total-disk-mib", "50"],
     "error: job-disk-mib: must not exceed --total-disk-mib (one job could never fit)"),
    (["--max-jobs-per-client", "-1"], "error: max-jobs-per-client: must not be negative, got -1"),
])
def test_serve_refuses_quotas_that_make_no_sense(run_cli, flags, line) -> None:
    code, _, err = run_cli("serve", "--port", "0", *flags)
    assert code == 2 and err.strip() == line


# -- 6. connections -----------------------------------------------------------------------------------------

def _closed_within(sock: socket.socket, limit_s: float) -> bool:
    """Read until the server closes the connection (True) or ``limit_s`` passes quietly (False)."""
    sock.settimeout(limit_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def test_a_silent_tcp_connection_is_closed() -> None:
    with start_in_thread(config(quotas=Quotas(handshake_timeout_s=1.0))) as s:
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            assert _closed_within(sock, 20.0)


def test_an_idle_http2_connection_is_closed() -> None:
    """A client that speaks HTTP/2 (preface and settings) and then makes no call."""
    with start_in_thread(config(quotas=Quotas(max_connection_idle_s=1.0))) as s:
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
            assert _closed_within(sock, 20.0)


def test_connections_per_peer_are_capped() -> None:
    """Two connections of one host may have calls in flight; a third connection is refused
    while they do, and served once one is done."""
    quotas = Quotas(max_connections_per_peer=2)
    with start_in_thread(config(quotas=quotas)) as s, Client(s.address, retries=0) as c:
        job = c.submit("optimize", SMALL, settings={"budget": 1000, "sleep": 0.05})
        channels = [grpc.insecure_channel(s.address, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(3)]
        try:
            from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2_grpc as pb_grpc

            stubs = [pb_grpc.BridgeStub(ch) for ch in channels]
            watches = [stubs[i].WatchJob(pb.WatchJobRequest(job_id=job.id, heartbeat_s=0.5)) for i in (0, 1)]
            for w in watches:
                next(w)                                    # both streams are open
            with pytest.raises(grpc.RpcError) as err:
                stubs[2].GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert detail_of(err.value).reason == "TOO_MANY_CONNECTIONS"
            assert stubs[0].GetServerInfo(pb.GetServerInfoRequest(), timeout=30).version   # an open one: served
            watches[1].cancel()
            end = time.monotonic() + 30
            while True:                                  # the cancel reaches the server shortly
                try:
                    assert stubs[2].GetServerInfo(pb.GetServerInfoRequest(), timeout=30).version
                    break
                except grpc.RpcError:
                    assert time.monotonic() < end
                    time.sleep(0.05)
            watches[0].cancel()
        finally:
            for ch in channels:
                ch.close()
            c.cancel(job.id)


# -- 7. page tokens, the listing, GPU counts ----------------------------------------------------------------

@pytest.mark.parametrize("token", ["²", "٣", "1" * 5000, "-1", " 1"])
def test_page_tokens_are_ascii_digits(token) -> None:
    with start_in_thread(config()) as s, Client(s.address, retries=0) as c:
        for call, message in ((c.stub.ListJobs, pb.ListJobsRequest(page_token=token)),):
            with pytest.raises(grpc.RpcError) as err:
                call(message, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "page_token: is not a token this server gave"


def test_list_jobs_lists_the_store_beyond_the_jobs_in_memory(tmp_path) -> None:
    with start_in_thread(config(limits=Limits(workers=2, max_jobs_in_memory=2))) as s, \
            Client(s.address, retries=0) as c:
        ids = [c.wait(c.submit("simulate", dict(SMALL, layers=n)).id).id for n in range(1, 6)]
        # the last job's record is written a moment after its final event: then the oldest go
        assert until(lambda: persisted(s.server.manager, ids) and len(s.server.manager.jobs) <= 2)
        listed, token = [], ""
        while True:
            page = c.stub.ListJobs(pb.ListJobsRequest(page_size=2, page_token=token), timeout=30)
            listed += [j.id for j in page.jobs]
            token = page.next_page_token
            if not token:
                break
        assert listed == list(reversed(ids))                       # newest first, each once


@pytest.mark.parametrize("cluster, count", [("dgx-h100:-8", "-8"), ("dgx-h100:²", "²"), ("dgx-h100:0", "0")])
def test_a_bad_gpu_count_of_a_known_preset_says_the_count_rule(cluster, count) -> None:
    from stage_cosim.bridge.resolve import check_no_server_paths

    with pytest.raises(UserError) as err:
        check_no_server_paths({"cluster": cluster})
    assert str(err.value) == f"cluster: GPU count after ':' must be a positive integer, got {count!r}"
