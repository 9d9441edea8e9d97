"""The bridge against hostile or careless requests: a real server on a loopback port each time.

No request may read the server's files, choose its processes, stall it, or break it for other
clients; a killed server recovers, and its workers die with it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grpc
import pytest

from stage_cosim.bridge import Client
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.server import start_in_thread
from test_bridge import SMALL, config

SECRET = "7f3c-server-secret-9d1e"


def submit_raw(client: Client, kind: str, design: dict, settings: dict | None = None) -> tuple[str, str]:
    """Submit past the client's own checks and file reading; (status code name, message or job id)."""
    message = pb.SubmitJobRequest()
    body = getattr(message, kind)
    for key, value in design.items():
        field = pb.Design.DESCRIPTOR.fields_by_name[key]
        if field.is_repeated:
            getattr(body.design, key).extend(value if isinstance(value, list) else [value])
        else:
            setattr(body.design, key, value)
    if settings is not None:
        body.settings_json = json.dumps(settings)
    try:
        return "OK", client.stub.SubmitJob(message, timeout=60).id
    except grpc.RpcError as exc:
        return exc.code().name, exc.details()


# -- security: the server's files -------------------------------------------------------------------------

def test_no_request_field_reads_the_servers_files(tmp_path, monkeypatch) -> None:
    """Every field of every request kind, given names of files that exist in the server's working
    directory (and absolute paths to them): nothing there is opened, by the server or its workers,
    no reply carries their content, and an existing name is answered exactly like a missing one."""
    from bridge_standins import opens_under
    from stage_cosim.api import OPTIMIZE_KEYS
    from stage_cosim.search.explore import SPEC_KEYS

    cwd = tmp_path / "server-cwd"
    (cwd / "model-dir").mkdir(parents=True)
    (cwd / "secret.cfg").write_text(f"gpu: {SECRET}\n")
    (cwd / "model-dir" / "config.json").write_text(json.dumps(
        {"_name_or_path": SECRET, "n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 1000}))
    opened: list[str] = []
    recording = [True]            # off before the server removes its data (rmtree opens relative names)
    sys.addaudithook(opens_under(str(cwd), lambda path: recording[0] and opened.append(path)))
    log = tmp_path / "worker-opens.log"
    monkeypatch.setenv("BRIDGE_TEST_BAIT", str(cwd))
    monkeypatch.setenv("BRIDGE_TEST_OPEN_LOG", str(log))
    monkeypatch.chdir(cwd)                      # the server's (and its workers') working directory
    names = ["secret.cfg", "model-dir", str(cwd / "secret.cfg"), "missing.cfg"]

    text_fields = [f.name for f in pb.Design.DESCRIPTOR.fields if f.type == f.TYPE_STRING]
    optimize_base = dict(SMALL, cluster="dgx-h100:8", global_batch=8)
    explore_base = {"model": "llama3-8b", "baseline": "dgx-h100:8", "global_batch": 8, "seq_len": 256,
                    "variables": {"gpu.hbm_GBps": {"values": [3350, 4000]}}}
    cases = [("simulate", f, None) for f in text_fields]
    cases += [("optimize", f, None) for f in sorted(OPTIMIZE_KEYS)]
    cases += [("explore", f, None) for f in sorted(SPEC_KEYS)]
    replies: dict[tuple[str, str, str], str] = {}
    jobs: dict[tuple[str, str, str], str] = {}
    with start_in_thread(config(worker_init="bridge_standins:audit_opens")) as s, \
            Client(s.address, retries=2) as c:
        for kind, field, _ in cases:
            for name in names:
                if kind == "simulate":
                    code, text = submit_raw(c, kind, {**SMALL, field: name})
                elif kind == "optimize":          # the search settings (the design is simulate's)
                    code, text = submit_raw(c, kind, optimize_base, {"budget": 2, "exhaustive_limit": 1, field: name})
                else:
                    code, text = submit_raw(c, kind, {}, {**explore_base, field: name})
                if code == "OK":
                    jobs[(kind, field, name)] = text
                else:
                    replies[(kind, field, name)] = f"{code} {text}"
        for key, job_id in jobs.items():
            job = c.wait(job_id)
            assert job.state == pb.FAILED or key[1] in ("allow_cross_domain_tp",), (key, job.error)
            replies[key] = f"job {pb.JobState.Name(job.state)} {job.error} {job.result_json}"
            assert SECRET not in json.dumps(list(job.log_excerpt))
        listing = "".join(str(j) for j in c.jobs())
        recording[0] = False
    assert SECRET not in listing
    for (kind, field, name), reply in replies.items():
        assert SECRET not in reply, (kind, field, reply)
        if name == "secret.cfg":                # an existing file is answered like a missing one
            assert reply.replace("secret.cfg", "missing.cfg") == replies[(kind, field, "missing.cfg")], reply
    for field in ("model", "cluster"):          # the fields that name files are refused at submit
        assert all(replies[("simulate", field, n)].startswith(f"INVALID_ARGUMENT {field}: ") for n in names)
    assert all(replies[("explore", "baseline", n)].startswith("INVALID_ARGUMENT baseline: ") for n in names)
    assert opened == [] and (not log.exists() or log.read_text() == "")


# -- security: the server's processes ---------------------------------------------------------------------

def test_requests_cannot_choose_the_servers_processes(run_cli) -> None:
    """A Ray address or a worker count in a request is refused at submit, before any job exists
    (so no worker can dial out or start a Ray head); the operator's serve settings apply instead."""
    from stage_cosim.bridge.process import WorkerSettings

    search = dict(SMALL, cluster="dgx-h100:8", global_batch=8)
    with start_in_thread(config(worker=WorkerSettings(search_workers=3))) as s, Client(s.address, retries=0) as c:
        for settings in ({"ray": "10.255.255.1:6379"}, {"ray": "auto"}, {"workers": 10 ** 6}, {"workers": 1}):
            before = c.server_info().jobs
            code, text = submit_raw(c, "optimize", search, {"budget": 1, **settings})
            key = next(iter(settings))
            assert code == "INVALID_ARGUMENT" and text.startswith(f"{key}: is chosen by the server's operator"), text
            assert c.server_info().jobs == before                  # refused before a job existed
        result = c.result(c.submit("optimize", search, settings={"budget": 1}).id)
        assert result["request"]["workers"] == 3 and "ray" not in result["request"]
        code, _, err = run_cli("remote", "optimize", *["--model", "llama3-8b", "--layers", "4", "--seq-len", "256"],
                               "--cluster", "dgx-h100:8", "--global-batch", "8", "--workers", "4",
                               "--server", s.address)
        assert code == 2 and err.startswith("error: workers: is set by the server's operator (serve --search-workers)")


# -- availability: documents, records, resources ----------------------------------------------------------

BILLION_LAUGHS = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"]
                           + [f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")])


def test_oversized_and_hostile_documents_are_refused_without_stalling_the_server() -> None:
    """Each is INVALID_ARGUMENT naming its field, with a short message; health checks keep
    answering while they are parsed (off the event loop, within the document limits)."""
    import threading
    import time

    cluster = "gpu: H100-SXM\nscale_up: {gpus_per_domain: 8, bandwidth_GBps: 450, latency_ns: 700}\n" \
              "scale_out: {bandwidth_GBps: 50, latency_ns: 2000}\n"
    big = cluster + "".join(f"pad{i}: [{', '.join(['1'] * 40)}]\n" for i in range(28_000))   # ~3.4 MB
    cases = [
        ("simulate", {**SMALL, "cluster_description": big}, None, "cluster_description", "characters long"),
        ("simulate", {**SMALL, "cluster_description": BILLION_LAUGHS}, None, "cluster_description", "values"),
        ("simulate", {**SMALL, "cluster_description": "&a [*a]"}, None, "cluster_description", "recursive"),
        ("simulate", {**SMALL, "cluster_description": "a: " + "[" * 100 + "]" * 100}, None,
         "cluster_description", "levels"),
        ("simulate", {**SMALL, "model_config": "[" * 100_000 + "]" * 100_000}, None, "model_config", "levels"),
        ("optimize", SMALL, "[" * 100_000 + "]" * 100_000, "settings_json", "levels"),
        ("optimize", SMALL, json.dumps({"pad": "x" * (300 << 10)}), "settings_json", "bytes"),
        ("optimize", SMALL, json.dumps({"k": [0] * 60_000}, separators=(",", ":")), "settings_json", "values"),
        ("simulate", {**SMALL, "model": "m" * (3 << 20)}, None, "model", "characters long"),
        ("simulate", {**SMALL, "recompute": "x" * 5000}, None, "recompute", "characters long"),
    ]
    assert len(BILLION_LAUGHS) < 600 and len(big) > 3_300_000
    slowest = [0.0]
    stop = threading.Event()
    with start_in_thread(config()) as s, Client(s.address, retries=0) as c:
        def poll() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                c.health()
                slowest[0] = max(slowest[0], time.perf_counter() - t0)
                time.sleep(0.01)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            for kind, design, settings, field, rule in cases:
                message = pb.SubmitJobRequest()
                body = getattr(message, kind)
                for key, value in design.items():
                    setattr(body.design, key, value)
                if settings is not None:
                    body.settings_json = settings
                with pytest.raises(grpc.RpcError) as err:
                    c.stub.SubmitJob(message, timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details()[:200])
                details = err.value.details()
                assert details.startswith(f"{field}: ") and rule in details and len(details) <= 1000, details[:300]
            assert c.server_info().jobs == 0
            assert c.result(c.submit("simulate", SMALL).id) is not None        # the server still works
        finally:
            stop.set()
            poller.join()
    assert slowest[0] < 2.0, slowest          # generous: the figure is benchmarks/bridge_load.py's


def test_job_records_and_listings_stay_within_a_default_clients_message_limit(run_cli) -> None:
    """Twenty jobs with requests near the size limit make more than 4 MiB of records: listing
    pages by bytes, so the default client, ListJobs and `remote status` all keep working."""
    pad = "x" * (230 << 10)
    with start_in_thread(config()) as s, Client(s.address, retries=0) as c:
        ids = [c.submit("optimize", SMALL, settings={"budget": 1, "pad": pad, "n": i}).id for i in range(20)]
        for job_id in ids:
            job = c.wait(job_id)
            assert job.state == pb.SUCCEEDED and json.loads(c.job(job_id).request_json)["pad"] == pad
        listed = [j.id for j in c.jobs()]
        assert sorted(listed) == sorted(ids)
        first = c.stub.ListJobs(pb.ListJobsRequest(page_size=1000))
        assert 0 < len(first.jobs) < 20 and first.next_page_token and first.ByteSize() < 4 << 20
        with pytest.raises(grpc.RpcError) as err:
            c.stub.ListJobs(pb.ListJobsRequest(page_size=-1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("page_size:")
        code, out, err_text = run_cli("remote", "status", "--server", s.address)
        assert code == 0 and all(job_id in out for job_id in ids), err_text


def test_jobs_that_cannot_fit_are_refused_and_over_limit_jobs_fail_in_one_line() -> None:
    from stage_cosim.bridge.process import WorkerSettings

    limits = WorkerSettings(memory_bytes=1 << 30, cpu_s=1.0)
    with start_in_thread(config(worker=limits)) as s, Client(s.address, retries=0) as c:
        for design, field in (({**SMALL, "layers": 100_000}, "layers"),
                              ({**SMALL, "global_batch": 2 ** 31 - 1}, "global_batch"),
                              ({**SMALL, "dp": 2 ** 28, "global_batch": 2 ** 28, "cluster": "dgx-h100"}, "dp")):
            code, text = submit_raw(c, "simulate", design)
            assert code == "INVALID_ARGUMENT" and text.startswith(f"{field}: ") and "GiB of memory" in text, text
        code, text = submit_raw(c, "optimize", {**SMALL, "layers": 100_000, "cluster": "dgx-h100:8",
                                                "global_batch": 8})
        assert code == "INVALID_ARGUMENT" and text.startswith("layers: "), text
        assert c.server_info().jobs == 0
        memory = c.wait(c.submit("optimize", SMALL, settings={"allocate_mib": 2048}).id)
        assert memory.state == pb.FAILED and memory.error == "memory: the job needed more than this server's " \
                                                            "1,024 MiB per job" and not memory.error_parameter
        cpu = c.wait(c.submit("optimize", SMALL, settings={"spin_s": 60}).id)
        assert cpu.state == pb.FAILED and cpu.error.startswith("cpu: the job used more than its 1 s of CPU time")
        assert cpu.finished_at - cpu.started_at < 30
        assert c.result(c.submit("optimize", SMALL, settings={"budget": 2}).id)["evaluations"] == 2
