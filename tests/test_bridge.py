"""The gRPC bridge: a real server on a loopback port (chosen by the OS), the real client over it.

Searches run as stand-ins (tests/bridge_standins.py) so the job plumbing is tested on its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from stage_cosim import api
from stage_cosim.bridge import BridgeError, Client, JobFailed
from stage_cosim.bridge.limits import Limits
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.server import ServerConfig, start_in_thread

TESTS = Path(__file__).resolve().parent
SMALL = dict(model="llama3-8b", layers=4, seq_len=256)
SMALL_FLAGS = ["--model", "llama3-8b", "--layers", "4", "--seq-len", "256"]
STANDINS = "bridge_standins:install"
STANDIN_CHECK = "test_bridge:check_standin_search"


def check_standin_search(kind: str, req: dict) -> None:
    """The submit check of a server whose workers run the stand-in searches: they take their own
    steering settings (sleep, fail, spawn_child, ...), so the real searches' checks do not apply."""


def config(**kw) -> ServerConfig:
    kw.setdefault("limits", Limits(workers=2, kill_grace_s=0.3))
    kw.setdefault("worker_init", STANDINS)
    kw.setdefault("search_check", STANDIN_CHECK if kw["worker_init"] == STANDINS else None)
    return ServerConfig(port=0, heartbeat_s=0.2, **kw)


@pytest.fixture(scope="module")
def server():
    with start_in_thread(config()) as s:
        yield s


@pytest.fixture
def client(server):
    with Client(server.address, retries=2, backoff_s=0.05) as c:
        yield c


def events_of(client: Client, job_id: str, after: int = 0) -> list[pb.JobEvent]:
    return list(client.watch(job_id, after_seq=after))


def process_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")     # a zombie is dead, only unreaped


# -- the protocol -----------------------------------------------------------------------------------------

def test_generated_code_is_current_and_speaks_the_api_vocabulary(tmp_path) -> None:
    from stage_cosim.bridge.proto import generate

    here = Path(generate.__file__).parent
    copy = tmp_path / "proto"
    shutil.copytree(here, copy, ignore=shutil.ignore_patterns("__pycache__"))
    generate.HERE = copy
    try:
        generate.generate()
    finally:
        generate.HERE = here
    for name in ("bridge_pb2.py", "bridge_pb2.pyi", "bridge_pb2_grpc.py"):
        assert (copy / "stagecosim/v1" / name).read_text() == (here / "stagecosim/v1" / name).read_text(), name
    fields = set(pb.Design.DESCRIPTOR.fields_by_name)
    assert api.REQUEST_KEYS <= fields, api.REQUEST_KEYS - fields
    assert pb.DESCRIPTOR.package == "stagecosim.v1"


# -- jobs --------------------------------------------------------------------------------------------------

def test_simulate_equals_api_and_repeats_come_from_the_cache(client) -> None:
    req = dict(SMALL, tp=2, dp=2, global_batch=4, zero=1, sp=True)
    assert client.simulate(req) == api.simulate(req)
    again = client.submit("simulate", dict(req, axis_order=["tp", "dp", "pp"]))   # the default, spelled out
    assert again.cached and again.state == pb.SUCCEEDED and json.loads(again.result_json) == api.simulate(req)
    assert client.submit("simulate", req, no_cache=True).cached is False


def test_watch_polling_and_resume_after_a_dropped_stream(client) -> None:
    job = client.submit("optimize", SMALL, settings={"budget": 5, "sleep": 0.05})
    stream = client.stub.WatchJob(pb.WatchJobRequest(job_id=job.id))
    first = []
    for event in stream:                    # read a little, then drop the stream
        if not event.HasField("heartbeat"):
            first.append(event)
        if len(first) == 3:
            break
    stream.cancel()
    rest = events_of(client, job.id, after=first[-1].seq)
    seqs = [e.seq for e in first + rest]
    assert seqs == list(range(1, len(seqs) + 1))               # nothing lost, nothing repeated
    assert rest[-1].state.state == pb.SUCCEEDED
    kinds = {e.WhichOneof("body") for e in first + rest}
    assert {"state", "progress", "log"} <= kinds
    polled = client.job(job.id)                                 # polling sees the same end
    assert polled.state == pb.SUCCEEDED and polled.last_seq == seqs[-1]
    assert any(e.HasField("heartbeat") for e in client.watch(job.id, heartbeats=True)) is False  # final: no waiting


def test_client_resumes_through_a_flaky_network(server) -> None:
    from bridge_proxy import DroppingProxy

    proxy = DroppingProxy(server.port)
    try:
        with Client(proxy.address, retries=10, backoff_s=0.05) as c:
            job = c.submit("optimize", SMALL, settings={"budget": 6, "sleep": 0.1})
            seen = []
            for event in c.watch(job.id):
                seen.append(event)
                if len(seen) in (2, 5):
                    proxy.drop_all()        # cut the connection under the open stream
        assert proxy.drops == 2
        seqs = [e.seq for e in seen]
        assert seqs == list(range(1, len(seqs) + 1)) and seen[-1].state.state == pb.SUCCEEDED
    finally:
        proxy.close()


def test_optimize_progress_carries_best_so_far(client) -> None:
    job = client.submit("optimize", SMALL, cluster="dgx-h100:8", global_batch=8, seq_len=512,
                        settings={"budget": 4, "objective": "step-time"})
    progress = [e.progress for e in events_of(client, job.id) if e.HasField("progress")]
    assert [p.done for p in progress] == [1, 2, 3, 4] and all(p.total == 4 for p in progress)
    bests = [json.loads(p.best_json)["step_time_s"] for p in progress]
    assert bests == sorted(bests, reverse=True) and bests[-1] == pytest.approx(1 / 8 + 0.08)
    result = client.result(job.id)
    assert result["best"]["config"]["parallel"]["tp"] == 8 and result["evaluations"] == 4
    # design fields and settings arrive as one request, in the api vocabulary
    assert result["request"]["global_batch"] == 8 and result["request"]["objective"] == "step-time"
    explored = client.explore(SMALL, space={"gpu.hbm_bandwidth": [2, 4]}, budget=2)
    assert explored["space"] == {"gpu.hbm_bandwidth": [2, 4]} and explored["evaluations"] == 2


def test_cancel_kills_the_running_job_and_its_child_process(client) -> None:
    job = client.submit("optimize", SMALL, settings={"budget": 1000, "sleep": 0.05, "spawn_child": True})
    pid = None
    for event in client.watch(job.id):
        if event.HasField("log") and event.log.line.startswith("child pid "):
            pid = int(event.log.line.split()[-1])
            break
    assert pid is not None and not process_gone(pid)
    assert client.cancel(job.id).state in (pb.CANCELLING, pb.CANCELLED)
    final = client.wait(job.id)
    assert final.state == pb.CANCELLED
    deadline = time.time() + 10
    while not process_gone(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert process_gone(pid)
    assert client.cancel(job.id).state == pb.CANCELLED           # cancelling again is harmless
    done = client.submit("simulate", SMALL)
    client.wait(done.id)
    with pytest.raises(BridgeError) as err:
        client.cancel(done.id)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_dropped_watcher_never_cancels(client) -> None:
    job = client.submit("optimize", SMALL, settings={"budget": 3, "sleep": 0.1})
    stream = client.stub.WatchJob(pb.WatchJobRequest(job_id=job.id))
    next(iter(stream))
    stream.cancel()
    assert client.wait(job.id).state == pb.SUCCEEDED


def test_idempotent_resubmit(client) -> None:
    first = client.submit("simulate", dict(SMALL, tp=2), request_id="sweep-point-17")
    again = client.submit("simulate", dict(SMALL, tp=2), request_id="sweep-point-17")
    assert again.id == first.id
    with pytest.raises(BridgeError) as err:
        client.submit("simulate", dict(SMALL, tp=4), request_id="sweep-point-17")
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and err.value.field == "request_id"
    assert sum(1 for j in client.jobs() if j.request_id == "sweep-point-17") == 1


def test_failures_are_job_data(client) -> None:
    job = client.submit("simulate", dict(SMALL, tp=3))          # passes the checks at submit, fails in synthesis
    final = client.wait(job.id)
    assert final.state == pb.FAILED and final.error_parameter == "tp" and final.error.startswith("tp: ")
    with pytest.raises(JobFailed) as err:
        client.result(job.id)
    assert err.value.parameter == "tp"
    crash = client.wait(client.submit("optimize", SMALL, settings={"fail": True}).id)
    assert crash.state == pb.FAILED and crash.error == "RuntimeError: stand-in search failed on purpose"
    assert any("Traceback" in line for line in crash.log_excerpt)
    slow = client.wait(client.submit("optimize", SMALL, settings={"budget": 100, "sleep": 0.1}, timeout_s=0.5).id)
    assert slow.state == pb.FAILED and slow.error.startswith("timeout:")


@pytest.mark.parametrize("kind, request_, field, code", [
    ("simulate", dict(SMALL, zero=9), "zero", grpc.StatusCode.INVALID_ARGUMENT),
    ("simulate", dict(SMALL, bogus=1), "bogus", None),                     # refused by the client already
    ("simulate", {"model": "../../etc/hosts.json"}, "model", None),        # the client reads its own files
    ("simulate", dict(SMALL, cluster="/etc/hostname"), "cluster", None),
    ("simulate", dict(SMALL, network_model="magic"), "network-model", grpc.StatusCode.INVALID_ARGUMENT),
    ("optimize", dict(SMALL, space="/etc/shadow"), "space", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_input_is_invalid_argument_naming_the_field(client, kind, request_, field, code) -> None:
    from stage_cosim.errors import UserError

    with pytest.raises((BridgeError, UserError)) as err:
        client.submit(kind, request_)
    if code is None:
        assert isinstance(err.value, UserError) and err.value.parameter == field
    else:
        assert err.value.code == code and err.value.field == field and str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize("design", [dict(model="/etc/passwd"), dict(model="../config.json"),
                                    dict(cluster="/etc/hostname"), dict(cluster="../../c.yaml")])
def test_the_server_reads_no_client_paths(client, design) -> None:
    from stage_cosim.bridge.codec import design_from_request

    request = pb.SubmitJobRequest(simulate=pb.SimulateJob(design=design_from_request(design)))
    with pytest.raises(grpc.RpcError) as err:          # straight to the server, past the client's file reading
        client.stub.SubmitJob(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{next(iter(design))}: unknown preset")


def test_rpc_errors_use_canonical_codes(client) -> None:
    def code(call) -> grpc.StatusCode:
        with pytest.raises(BridgeError) as err:
            call()
        return err.value.code

    assert code(lambda: client.job("j-nope")) == grpc.StatusCode.NOT_FOUND
    running = client.submit("optimize", SMALL, settings={"budget": 50, "sleep": 0.1})
    assert code(lambda: client.artifacts(running.id)) == grpc.StatusCode.FAILED_PRECONDITION
    client.cancel(running.id)
    with pytest.raises(grpc.RpcError) as raw:
        client.stub.SubmitJob(pb.SubmitJobRequest())
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kind" in raw.value.details()


def test_queue_full_is_resource_exhausted() -> None:
    with start_in_thread(config(limits=Limits(workers=1, max_queue=1, kill_grace_s=0.2))) as s, \
            Client(s.address, retries=0) as c:
        running = c.submit("optimize", SMALL, settings={"budget": 100, "sleep": 0.1})
        while c.job(running.id).state != pb.RUNNING:
            time.sleep(0.02)
        queued = c.submit("optimize", SMALL, settings={"budget": 1})
        with pytest.raises(BridgeError) as err:
            c.submit("optimize", SMALL, settings={"budget": 2})
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "QUEUE_FULL"
        assert err.value.retry_after_s > 0
        assert c.cancel(queued.id).state == pb.CANCELLED          # a queued job never starts
        assert not any(e.HasField("progress") for e in c.watch(queued.id))
        c.cancel(running.id)


@pytest.mark.slow
def test_many_watchers_do_not_starve_other_calls(client) -> None:
    # long enough (10 s) to be still running after the watchers and the calls, on a busy machine too
    job = client.submit("optimize", SMALL, settings={"budget": 200, "sleep": 0.05})
    deadline = time.monotonic() + 30      # a cold worker first imports the package
    while client.job(job.id).state != pb.RUNNING and time.monotonic() < deadline:
        time.sleep(0.02)
    streams = [client.stub.WatchJob(pb.WatchJobRequest(job_id=job.id)) for _ in range(200)]
    try:
        time.sleep(0.3)
        for _ in range(20):            # answered while 200 watches are open (how fast: benchmarks/bridge_load.py)
            client.server_info()
        assert client.server_info().running >= 1
    finally:
        for s in streams:
            s.cancel()
    assert client.wait(job.id).state == pb.SUCCEEDED


def test_large_results_travel_in_chunks(client) -> None:
    job = client.wait(client.submit("optimize", SMALL, settings={"budget": 1, "big_mib": 5}).id)
    assert job.state == pb.SUCCEEDED and job.result_json == "" and job.result_size > 5 << 20
    assert len(client.result(job)["padding"]) == 5 << 20


SERVE = dict(model="llama3-8b", layers=2, rate=20.0, num_requests=30, input_len=64, output_len=8)
SERVE_FLAGS = ["--model", "llama3-8b", "--layers", "2", "--rate", "20", "--num-requests", "30", "--input-len", "64",
               "--output-len", "8"]
TRACE_CSV = "arrival_s,input_len,output_len\n0.0,120,6\n0.25,40,9\n0.1,300,3\n1.5,64,12\n"


@pytest.mark.slow
def test_serve_sim_equals_api_with_progress_inline_requests_and_client_read_traces(client, tmp_path) -> None:
    assert "serve_sim" in client.server_info().job_kinds
    job = client.submit("serve_sim", SERVE)
    progress = [e.progress for e in events_of(client, job.id) if e.HasField("progress")]
    assert progress and progress[-1].done == progress[-1].total == 30
    assert [p.done for p in progress] == sorted(p.done for p in progress)
    assert client.result(job.id) == api.serve_sim(SERVE)
    rows = [{"arrival_s": 0.1 * i, "input_len": 50 + i, "output_len": 4} for i in range(12)]
    inline = dict(model="llama3-8b", layers=2, requests=rows)
    assert client.serve_sim(inline) == api.serve_sim(inline)
    trace = tmp_path / "requests.csv"
    trace.write_text(TRACE_CSV)
    local = api.serve_sim(dict(model="llama3-8b", layers=2, trace=str(trace)))
    assert client.serve_sim(model="llama3-8b", layers=2, trace=trace) == local     # read here, sent inline
    # the same request, sent as a trace file name, is refused: the server reads no files
    code_text = None
    try:
        client.stub.SubmitJob(pb.SubmitJobRequest(serve_sim=pb.ServeSimJob(
            design=pb.Design(model="llama3-8b"), settings_json=json.dumps({"trace": str(trace)}))))
    except grpc.RpcError as exc:
        code_text = (exc.code(), exc.details())
    assert code_text is not None and code_text[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert code_text[1].startswith("trace: names a file, and the server reads no files")


def test_remote_serve_sim_matches_local(run_cli, server, tmp_path) -> None:
    addr = ["--server", server.address]
    local = run_cli("serve-sim", *SERVE_FLAGS, "--json")
    assert local[0] == 0 and run_cli("remote", "serve-sim", *SERVE_FLAGS, "--json", *addr) == local
    assert run_cli("remote", "serve-sim", *SERVE_FLAGS, *addr) == run_cli("serve-sim", *SERVE_FLAGS)
    trace = tmp_path / "requests.csv"
    trace.write_text(TRACE_CSV)
    flags = ["--model", "llama3-8b", "--layers", "2", "--trace", str(trace), "--slo-ttft", "0.05"]
    local = run_cli("serve-sim", *flags, "--json")
    assert local[0] == 0 and run_cli("remote", "serve-sim", *flags, "--json", *addr) == local
    for bad in (["--max-num-seqs", "0"], ["--rate", "-1"], ["--trace", str(tmp_path / "missing.csv")],
                ["--prefill-gpus", "4"], ["--rates", "1,2"]):
        base = [f for f in SERVE_FLAGS if bad[0] != "--trace" or f not in ("--rate", "20")]
        local = run_cli("serve-sim", *base, *bad)
        remote = run_cli("remote", "serve-sim", *base, *bad, *addr)
        assert local[0] == 2 and remote[0] == 2 and remote[2].count("\n") == 1, (bad, remote)
        assert remote[2] == local[2], (bad, remote[2], local[2])


# -- data --------------------------------------------------------------------------------------------------

def test_synthesize_gives_the_same_traces_as_local_synth(client, tmp_path) -> None:
    req = dict(SMALL, tp=2, pp=2, global_batch=4)
    manifest = client.synthesize(req, out=tmp_path / "remote")
    local = api.synth(req, tmp_path / "local")
    assert manifest == local
    names = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "remote").iterdir())
    for name in names:
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "remote" / name).read_bytes()


@pytest.mark.slow
def test_upload_and_download_64_mib_resumable(client, tmp_path) -> None:
    src = tmp_path / "set"
    (src / "sub").mkdir(parents=True)
    big = os.urandom(64 << 20)
    (src / "big.bin").write_bytes(big)
    (src / "sub" / "small.txt").write_text("hello")
    (src / "empty").write_bytes(b"")
    up = client.upload(src)
    assert up.total_bytes == (64 << 20) + 5 and len(up.files) == 3
    assert client.upload(src).upload_id == up.upload_id                   # content-addressed
    # a download interrupted after 10 MiB resumes from there
    dest = tmp_path / "back"
    dest.mkdir()
    (dest / "big.bin.part").write_bytes(big[: 10 << 20])
    chunks = []
    real = client._download_stream

    def spy(owner, path, offset):
        for chunk in real(owner, path, offset):
            chunks.append((chunk.offset, len(chunk.data)))
            yield chunk

    client._download_stream = spy
    try:
        client.download("", dest, upload_id=up.upload_id)
    finally:
        client._download_stream = real
    assert hashlib.sha256((dest / "big.bin").read_bytes()).digest() == hashlib.sha256(big).digest()
    assert (dest / "sub" / "small.txt").read_text() == "hello" and (dest / "empty").read_bytes() == b""
    big_chunks = [c for c in chunks if c[1]]
    assert big_chunks[0][0] == 10 << 20 and max(n for _, n in chunks) <= 1 << 20


def test_upload_is_checked_and_all_or_nothing(server, client) -> None:
    uploads = server.server.manager.uploads_root
    before = sorted(uploads.iterdir())

    def send(*messages: pb.UploadTracesRequest) -> BridgeError:
        with pytest.raises(BridgeError) as err:
            client._retry(lambda: client.stub.UploadTraces(iter(messages)))
        return err.value

    good = hashlib.sha256(b"abc").hexdigest()
    header = lambda path, size=3, sha=good: pb.UploadTracesRequest(  # noqa: E731
        header=pb.UploadHeader(files=[pb.FileSpec(path=path, size=size, sha256=sha)]))
    chunk = lambda path, data=b"abc": pb.UploadTracesRequest(chunk=pb.FileChunk(path=path, data=data))  # noqa: E731
    assert send(header("a.et", sha="0" * 64), chunk("a.et")).code == grpc.StatusCode.DATA_LOSS
    for bad in ("../a.et", "/etc/a.et", "a/../../b.et", "a\\b.et", "./a.et", ""):
        err = send(header(bad), chunk(bad))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.field == "files[0].path", bad
    assert send(chunk("a.et")).field == "header"
    assert send(header("a.et"), chunk("a.et", b"abcd")).code == grpc.StatusCode.INVALID_ARGUMENT
    with start_in_thread(config(max_upload_bytes=1000)) as small, Client(small.address) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.stub.UploadTraces(iter([header("a.et", size=2000)]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert sorted(uploads.iterdir()) == before                            # nothing half-written


def test_download_paths_stay_inside_the_job(server, client, tmp_path) -> None:
    job = client.wait(client.submit("simulate", dict(SMALL, dp=2)).id)
    artifacts = server.server.manager.artifacts_dir(server.server.manager.get(job.id))
    (artifacts / "escape").symlink_to("/etc/hostname")
    def refused(path: str, offset: int = 0) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Download(pb.DownloadRequest(job_id=job.id, path=path, offset=offset)))
        return err.value.code()

    for path in ("../request.json", "/etc/hostname", "result.json/../../job.json", "a//b", ""):
        assert refused(path) == grpc.StatusCode.INVALID_ARGUMENT, path
    assert refused("escape") == grpc.StatusCode.INVALID_ARGUMENT        # the symlink leads out
    assert refused("job.json") == grpc.StatusCode.NOT_FOUND             # beside the artifacts, not among them
    assert refused("result.json", 10 ** 9) == grpc.StatusCode.OUT_OF_RANGE
    assert [f.path for f in client.artifacts(job.id)] == ["result.json"]


# -- server ------------------------------------------------------------------------------------------------

def test_health_reflection_and_token(tmp_path) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with start_in_thread(config(token="s3cret")) as s:
        with Client(s.address, retries=0) as anonymous:
            assert anonymous.health() == "SERVING" and anonymous.health("stagecosim.v1.Bridge") == "SERVING"
            with pytest.raises(BridgeError) as err:
                anonymous.server_info()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(s.address, token="wrong", retries=0) as wrong, pytest.raises(BridgeError) as err:
            list(wrong.watch("j-x"))
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(s.address, token="s3cret") as c:
            services = set(ProtoReflectionDescriptorDatabase(c.channel).get_services())
            assert {"stagecosim.v1.Bridge", "grpc.health.v1.Health"} <= services
            assert c.server_info().version


def test_tls() -> None:
    # a self-signed test-only certificate for 127.0.0.1 and localhost, valid 2000-2100, committed so
    # that the test needs no openssl (made with `openssl ca -selfsign`; its key protects nothing)
    cert, key = TESTS / "data" / "tls" / "localhost.crt", TESTS / "data" / "tls" / "localhost.key"
    with start_in_thread(config(tls_cert=cert, tls_key=key)) as s:
        with Client(s.address, tls_ca=cert) as c:
            assert c.simulate(SMALL) == api.simulate(SMALL)
        with Client(s.address, retries=0) as plain, pytest.raises(BridgeError):
            plain.server_info()


def test_restarted_server_keeps_jobs_and_memory_stays_bounded(tmp_path) -> None:
    data = tmp_path / "data"
    limits = Limits(workers=1, max_jobs_in_memory=2)
    with start_in_thread(config(data_dir=data, limits=limits)) as s, Client(s.address) as c:
        job = c.submit("simulate", SMALL, request_id="keep-me")
        result = c.result(job.id)
        for dp in (2, 4, 8):
            c.result(c.submit("simulate", dict(SMALL, dp=dp)).id)
        deadline = time.time() + 5          # the last job is saved (then forgotten) just after it ends
        while len(s.server.manager.jobs) > 2 and time.time() < deadline:
            time.sleep(0.01)
        assert len(s.server.manager.jobs) <= 2 and job.id not in s.server.manager.jobs
        assert c.job(job.id).state == pb.SUCCEEDED                        # read back from disk
    with start_in_thread(config(data_dir=data)) as s, Client(s.address) as c:
        assert c.submit("simulate", SMALL, request_id="keep-me").id == job.id
        assert c.result(job.id) == result
        assert [e.seq for e in c.watch(job.id)] == list(range(1, c.job(job.id).last_seq + 1))
        assert c.submit("simulate", SMALL).cached
        assert c.submit("simulate", dict(SMALL, dp=2)).cached


@pytest.mark.slow
def test_sigterm_drains(tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    proc = subprocess.Popen([sys.executable, "-m", "stage_cosim", "serve", "--port", "0", "--workers", "1",
                             "--drain-timeout", "1", "--heartbeat", "0.2", "--worker-init", STANDINS,
                             "--search-check", STANDIN_CHECK],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        port = int(line.split(" serving on ")[1].split()[0].rsplit(":", 1)[1])
        with Client(f"127.0.0.1:{port}", retries=0) as c:
            job = c.submit("optimize", SMALL, settings={"budget": 1000, "sleep": 0.05})
            while c.job(job.id).state != pb.RUNNING:
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            deadline = time.time() + 5
            while c.health() != "NOT_SERVING" and time.time() < deadline:
                time.sleep(0.02)
            assert c.health() == "NOT_SERVING"
            with pytest.raises(BridgeError) as err:
                c.submit("simulate", SMALL)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.reason == "DRAINING"
            final = c.wait(job.id)
            assert final.state == pb.CANCELLED
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the command line --------------------------------------------------------------------------------------

PARITY_CASES = [
    ["--tp", "2", "--dp", "2", "--global-batch", "8", "--sp", "--zero", "1", "--recompute", "selective"],
    ["--pp", "2", "--pp-layers", "1,3", "--axis-order", "dp,tp,pp", "--dp", "2", "--global-batch", "4",
     "--vp", "1", "--schedule", "gpipe"],
    ["--tp", "2", "--pp", "2", "--global-batch", "4", "--full", "--cluster", "dgx-a100:4"],
]


@pytest.mark.parametrize("flags", PARITY_CASES)
def test_remote_simulate_json_is_byte_for_byte_local(run_cli, server, flags) -> None:
    local = run_cli("simulate", *SMALL_FLAGS, *flags, "--json")
    remote = run_cli("remote", "simulate", *SMALL_FLAGS, *flags, "--json", "--server", server.address)
    assert local[0] == 0 and remote == local, remote[2]


def test_remote_simulate_files_and_custom_models(run_cli, server, tmp_path) -> None:
    cfg_dir = tmp_path / "my-model"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 512, "n_head": 8,
                                                         "vocab_size": 5000}))
    cluster = tmp_path / "cl.yaml"
    cluster.write_text("gpu: H100-SXM\nscale_up: {gpus_per_domain: 4, bandwidth_GBps: 300, latency_ns: 700}\n"
                       "scale_out: {bandwidth_GBps: 25, latency_ns: 2000}\n")
    traces = tmp_path / "traces"
    assert run_cli("synth", *SMALL_FLAGS, "--tp", "2", "--out", str(traces))[0] == 0
    cases = [
        ["--model", str(cfg_dir), "--tp", "2", "--cluster", str(cluster), "--seq-len", "512"],
        ["--arch", "llama", "--layers", "2", "--hidden", "512", "--ffn", "1024", "--heads", "8", "--kv-heads", "2",
         "--vocab", "5000"],
        ["--arch", "gpt", "--layers", "2", "--hidden", "512", "--heads", "8", "--vocab", "5000", "--attention", "unfused",
         "--seq-len", "512"],
        ["--traces", str(traces), "--cluster", "dgx-h100:2"],
    ]
    for flags in cases:
        local = run_cli("simulate", *flags, "--json")
        assert local[0] == 0, local
        assert run_cli("remote", "simulate", *flags, "--json", "--server", server.address) == local, flags
    summary = run_cli("simulate", *SMALL_FLAGS, "--tp", "2")
    assert run_cli("remote", "simulate", *SMALL_FLAGS, "--tp", "2", "--server", server.address) == summary
    tl_local, tl_remote = tmp_path / "local.json", tmp_path / "remote.json"
    local = run_cli("simulate", *SMALL_FLAGS, "--dp", "2", "--timeline", str(tl_local), "--json")
    remote = run_cli("remote", "simulate", *SMALL_FLAGS, "--dp", "2", "--timeline", str(tl_remote), "--json",
                     "--server", server.address)
    assert remote == local and tl_remote.read_bytes() == tl_local.read_bytes()


@pytest.mark.parametrize("flags", [["--tp", "3"], ["--zero", "5"], ["--model", "nope"], ["--cluster", "dgx-h100:16", "--dp", "1"],
                                   ["--network-model", "magic"], ["--pp", "2", "--pp-layers", "a,b"]])
def test_remote_simulate_errors_match_local(run_cli, server, flags) -> None:
    local = run_cli("simulate", *SMALL_FLAGS, *flags)
    remote = run_cli("remote", "simulate", *SMALL_FLAGS, *flags, "--server", server.address)
    assert local[0] == 2 and remote[0] == 2 and remote[2].count("\n") == 1
    assert remote[2].split(" (see")[0] == local[2].split(" (see")[0]


def test_remote_cli_one_line_errors(run_cli, tmp_path) -> None:
    import socket

    with socket.socket() as s:                       # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = run_cli("remote", "status", "--server", f"127.0.0.1:{port}")
    assert code == 2 and err.startswith("error: server: ") and err.count("\n") == 1
    code, _, err = run_cli("serve", "--port", "70000")
    assert code == 2 and err.startswith("error: port:")
    code, _, err = run_cli("serve", "--tls-cert", str(tmp_path / "c.pem"))
    assert code == 2 and err.startswith("error: tls-key:")


def test_remote_synth_matches_local(run_cli, server, tmp_path) -> None:
    flags = [*SMALL_FLAGS, "--tp", "2", "--pp", "2", "--global-batch", "4"]
    code, local_out, _ = run_cli("synth", *flags, "--out", str(tmp_path / "a"))
    code2, remote_out, err = run_cli("remote", "synth", *flags, "--out", str(tmp_path / "b"), "--server", server.address)
    assert code == code2 == 0, err
    strip = lambda text: [line.split(" to ")[0] for line in text.splitlines()]  # noqa: E731 (paths and times differ)
    assert strip(remote_out) == strip(local_out)
    for f in sorted((tmp_path / "a").iterdir()):
        assert (tmp_path / "b" / f.name).read_bytes() == f.read_bytes()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep").write_text("x")
    code, _, err = run_cli("remote", "synth", *flags, "--out", str(tmp_path / "c"), "--server", server.address)
    assert code == 2 and "--force" in err and (tmp_path / "c" / "keep").exists()
    code, _, err = run_cli("remote", "synth", *SMALL_FLAGS, "--tp", "3", "--out", str(tmp_path / "d"),
                           "--server", server.address)
    assert code == 2 and err.startswith("error: tp:") and not (tmp_path / "d").exists()


def test_remote_job_commands(run_cli, server, tmp_path) -> None:
    addr = ["--server", server.address]
    code, out, _ = run_cli("remote", "simulate", *SMALL_FLAGS, "--dp", "2", "--detach", "--request-id", "cli-1", *addr)
    job_id = out.strip()
    assert code == 0 and job_id.startswith("j-")
    assert run_cli("remote", "simulate", *SMALL_FLAGS, "--dp", "2", "--detach", "--request-id", "cli-1", *addr)[1] \
        == out
    code, out, _ = run_cli("remote", "result", job_id, *addr)
    assert code == 0 and json.loads(out) == api.simulate(dict(SMALL, dp=2))
    code, out, _ = run_cli("remote", "watch", job_id, *addr)
    assert code == 0 and "state succeeded" in out.splitlines()[-1]
    code, out, _ = run_cli("remote", "status", job_id, *addr)
    assert code == 0 and job_id in out and "succeeded" in out
    code, out, _ = run_cli("remote", "status", *addr)
    assert code == 0 and "SERVING" in out and job_id in out
    code, out, _ = run_cli("remote", "download", job_id, "--out", str(tmp_path / "dl"), *addr)
    assert code == 0 and json.loads((tmp_path / "dl" / "result.json").read_text()) == api.simulate(dict(SMALL, dp=2))
    code, out, _ = run_cli("remote", "optimize", *SMALL_FLAGS, "--cluster", "dgx-h100:8", "--global-batch", "8",
                           "--budget", "3", "--detach", *addr)
    slow = out.strip()
    code, out, _ = run_cli("remote", "result", slow, *addr)
    doc = json.loads(out)
    assert doc["evaluations"] == 3 and doc["request"]["top"] == 5 and doc["request"]["seq_len"] == 256
    code, out, _ = run_cli("remote", "optimize", *SMALL_FLAGS, "--cluster", "dgx-h100:8", "--global-batch", "8",
                           "--budget", "3", "--json", *addr)
    assert code == 0 and json.loads(out) == doc                       # the cached result, printed alike
    code, out, _ = run_cli("remote", "upload", str(tmp_path / "dl"), *addr)
    assert code == 0 and out.startswith("u-")
    long = run_cli("remote", "optimize", *SMALL_FLAGS, "--cluster", "dgx-h100:8", "--global-batch", "8",
                   "--budget", "500", "--seed", "7", "--detach", *addr)[1].strip()
    code, out, _ = run_cli("remote", "cancel", long, *addr)
    assert code == 0 and ("cancelling" in out or "cancelled" in out)
    code, _, err = run_cli("remote", "status", "j-missing", *addr)
    assert code == 2 and err.startswith("error: job-id: ")


def test_concurrent_clients_lose_nothing(server) -> None:
    """A small version of benchmarks/bridge_load.py: every job ends once, with the right result."""
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with Client(server.address) as c:
                for k in range(5):
                    req = dict(SMALL, layers=1 + (i * 5 + k) % 6, dp=2, global_batch=2 * (1 + k % 2))
                    rid = f"load-{i}-{k}"
                    job = c.submit("simulate", req, request_id=rid)
                    assert c.submit("simulate", req, request_id=rid).id == job.id
                    results[rid] = json.dumps(c.result(job.id))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 40


@pytest.mark.slow
def test_real_optimize_and_explore_spec_through_the_cli(run_cli, server, tmp_path) -> None:
    flags = [*SMALL_FLAGS[:4], "--cluster", "dgx-h100:8", "--global-batch", "8", "--seq-len", "256"]
    with start_in_thread(ServerConfig(port=0)) as real:                 # the real api.optimize
        local = run_cli("optimize", *flags, "--json")
        remote = run_cli("remote", "optimize", *flags, "--json", "--server", real.address)
        assert local[0] == 0 and remote == local
        code, out, err = run_cli("remote", "optimize", *flags, "--server", real.address)   # from the cache
        assert code == 0 and out.startswith("best: ") and "proven optimum" in out, err
    spec = TESTS.parent / "examples" / "explore_h100.yaml"
    code, out, err = run_cli("remote", "explore", str(spec), "--json", "--server", server.address)
    assert code == 0, err
    assert json.loads(out)["evaluations"] == 4                          # the stand-in ran on the spec's content
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: llama3-8b\n")
    code, _, err = run_cli("remote", "explore", str(bad), "--server", server.address)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
