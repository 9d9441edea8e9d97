"""The bridge against hostile or careless requests: a real server on a loopback port each time.

No request may read the server's files, choose its processes, stall it, or break it for other
clients; a killed server recovers, and its workers die with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from stage_cosim.bridge import Client
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.server import start_in_thread
from test_bridge import SMALL, STANDIN_CHECK, STANDINS, TESTS, config

SECRET = "7f3c-server-secret-9d1e"


def submit_raw(client: Client, kind: str, design: dict, settings: dict | str | None = None) -> tuple[str, str]:
    """Submit past the client's own checks and file reading; (status code name, message or job id).
    ``settings`` is a JSON object, or the text of one (sent as it is, malformed or not)."""
    message = pb.SubmitJobRequest()
    body = getattr(message, kind)
    for key, value in design.items():
        field = pb.Design.DESCRIPTOR.fields_by_name[key]
        if field.is_repeated:
            getattr(body.design, key).extend(value if isinstance(value, list) else [value])
        else:
            setattr(body.design, key, value)
    if settings is not None:
        body.settings_json = settings if isinstance(settings, str) else json.dumps(settings)
    try:
        return "OK", client.stub.SubmitJob(message, timeout=60).id
    except grpc.RpcError as exc:
        return exc.code().name, exc.details()


# -- security: the server's files -------------------------------------------------------------------------

PSEUDO_FILES = ("/proc/", "/dev/", "/sys/")


def library_roots() -> list[str]:
    """Where the code and its data live: Python's own directories and site-packages, and every
    directory a stage_cosim package comes from (the only places besides a job's own directory
    that a worker may open anything in)."""
    import site
    import sysconfig

    import stage_cosim.adapters.roofline.simulate  # noqa: F401
    import stage_cosim.api  # noqa: F401
    import stage_cosim.hardware.cluster  # noqa: F401
    import stage_cosim.search.explore  # noqa: F401
    import stage_cosim.serving.run  # noqa: F401

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values(), *site.getsitepackages(),
             site.getusersitepackages()}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "stage_cosim":
            roots.update(getattr(module, "__path__", None) or [])
    return sorted(os.path.abspath(r) for r in roots)


def _inside(path: str, roots: list[str]) -> bool:
    return path.startswith(PSEUDO_FILES) or any(path == r or path.startswith(r + os.sep) for r in roots)


def opens_outside(roots: list[str], record, allow_cwd_job: bool = False):  # noqa: ANN001, ANN201
    """An audit hook calling ``record(path)`` for every open, listdir or scandir outside ``roots``
    (with ``allow_cwd_job``, inside the working directory too once it is a job's directory)."""
    def hook(event: str, args: tuple) -> None:
        if event not in ("open", "os.listdir", "os.scandir") or not args or isinstance(args[0], int):
            return
        try:
            path = os.path.abspath(os.fsdecode(args[0]))
        except (TypeError, ValueError):
            return
        cwd = os.getcwd() if allow_cwd_job else ""
        if _inside(path, roots) or (cwd and os.path.basename(cwd).startswith("j-") and path.startswith(cwd + os.sep)):
            return
        record(path)

    return hook


def audit_every_open() -> None:
    """Worker init (the real searches run): append to ``$BRIDGE_TEST_OPEN_LOG`` every file or
    directory this worker opens outside the job's own directory and the library."""
    roots = os.environ["BRIDGE_TEST_LIBRARY"].split(os.pathsep)
    log = os.open(os.environ["BRIDGE_TEST_OPEN_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    sys.addaudithook(opens_outside(roots, lambda path: os.write(log, f"{os.getpid()} {path}\n".encode()),
                                   allow_cwd_job=True))


@pytest.mark.slow
def test_no_request_field_reads_the_servers_files(tmp_path, monkeypatch) -> None:
    """Every field of every request kind, given names of files that exist in the server's working
    directory and elsewhere (and absolute paths to them): the server opens nothing outside its
    data directory and the library, its workers nothing outside the job's own directory and the
    library; no reply carries a file's content, and an existing name is answered exactly like a
    missing one."""
    import threading

    from stage_cosim.api import OPTIMIZE_KEYS, SERVE_KEYS
    from stage_cosim.search.explore_spec import SPEC_KEYS

    cwd = tmp_path / "server-cwd"
    (cwd / "model-dir").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    for where in (cwd, tmp_path / "elsewhere"):
        (where / "secret.cfg").write_text(f"gpu: {SECRET}\n")
    (cwd / "model-dir" / "config.json").write_text(json.dumps(
        {"_name_or_path": SECRET, "n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 1000}))
    roots = library_roots()
    assert not any(str(tmp_path).startswith(r) for r in roots)
    opened: list[str] = []
    data: list[str] = []              # the server's data directory, once it exists
    recording = [False]               # only while it serves (start and stop make and remove temporary files)

    def server_record(path: str) -> None:
        thread = threading.current_thread().name
        if recording[0] and thread.startswith(("bridge-", "asyncio")) and not _inside(path, data):
            opened.append(f"{thread} {path}")

    sys.addaudithook(opens_outside(roots, server_record))
    log = tmp_path / "worker-opens.log"
    monkeypatch.setenv("BRIDGE_TEST_LIBRARY", os.pathsep.join(roots))
    monkeypatch.setenv("BRIDGE_TEST_OPEN_LOG", str(log))
    monkeypatch.chdir(cwd)                      # the server's (and its workers') working directory
    names = ["secret.cfg", "model-dir", str(cwd / "secret.cfg"), str(tmp_path / "elsewhere" / "secret.cfg"),
             "missing.cfg"]

    text_fields = [f.name for f in pb.Design.DESCRIPTOR.fields if f.type == f.TYPE_STRING]
    optimize_base = dict(SMALL, cluster="dgx-h100:8", global_batch=8)
    explore_base = {"model": "llama3-8b", "baseline": "dgx-h100:8", "global_batch": 8, "seq_len": 256,
                    "variables": {"gpu.hbm_GBps": {"values": [3350, 4000]}}}
    serve_base = {"rate": 5, "num_requests": 4, "output_len": 4}
    cases = [("simulate", f) for f in text_fields]
    cases += [("optimize", f) for f in sorted(OPTIMIZE_KEYS)]
    cases += [("explore", f) for f in sorted(SPEC_KEYS)]
    cases += [("serve_sim", f) for f in sorted(SERVE_KEYS)]
    replies: dict[tuple[str, str, str], str] = {}
    jobs: dict[tuple[str, str, str], str] = {}
    with start_in_thread(config(worker_init=f"{__name__}:audit_every_open")) as s, \
            Client(s.address, retries=2) as c:
        data.append(str(s.server.manager.data))
        recording[0] = True
        for kind, field in cases:
            for name in names:
                if kind == "simulate":
                    code, text = submit_raw(c, kind, {**SMALL, field: name})
                elif kind == "optimize":          # the search settings (the design is simulate's)
                    code, text = submit_raw(c, kind, optimize_base, {"budget": 2, "exhaustive_limit": 1, field: name})
                elif kind == "explore":
                    code, text = submit_raw(c, kind, {}, {**explore_base, field: name})
                else:
                    code, text = submit_raw(c, kind, {"model": "llama3-8b", "layers": 2}, {**serve_base, field: name})
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
    refused_on_sight = (("simulate", "model"), ("simulate", "cluster"), ("explore", "baseline"), ("serve_sim", "trace"))
    for kind, field in refused_on_sight:
        assert all(replies[(kind, field, n)].startswith(f"INVALID_ARGUMENT {field}: ") for n in names), field
    assert "trace: names a file" in replies[("serve_sim", "trace", "secret.cfg")]
    assert opened == [], opened[:10]
    assert not log.exists() or log.read_text() == "", log.read_text()[:2000]


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


@contextlib.contextmanager
def health_poller(client: Client) -> Iterator[list[str]]:
    """Health checks every 10 ms in a thread while the block runs (at least one); yields the list
    of their answers. (How fast they answer is benchmarks/bridge_load.py's to measure.)"""
    answers: list[str] = []
    stop = threading.Event()

    def poll() -> None:
        while True:
            answers.append(client.health())
            if stop.is_set():
                return
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        yield answers
    finally:
        stop.set()
        poller.join()


def test_oversized_and_hostile_documents_are_refused_without_stalling_the_server() -> None:
    """Each is INVALID_ARGUMENT naming its field, with a short message; health checks keep
    answering while they are parsed (off the event loop, within the document limits)."""
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
    with start_in_thread(config()) as s, Client(s.address, retries=0) as c, health_poller(c) as health:
        for kind, design, settings, field, rule in cases:
            code, details = submit_raw(c, kind, design, settings)
            assert code == "INVALID_ARGUMENT", (field, code, details[:200])
            assert details.startswith(f"{field}: ") and rule in details and len(details) <= 1000, details[:300]
        assert c.server_info().jobs == 0
        assert c.result(c.submit("simulate", SMALL).id) is not None        # the server still works
    assert health and set(health) == {"SERVING"}, health


def long_text_aliased(text_bytes: int, fan_out: int = 9, levels: int = 3) -> str:
    """A document of one anchored long text and ``levels`` lists of ``fan_out`` aliases each: a few
    dozen values, ``text_bytes * fan_out ** levels`` bytes once expanded."""
    lines = [f"a: &a '{'x' * text_bytes}'"]
    names = "abcdefgh"
    for level in range(1, levels + 1):
        lines.append(f"{names[level]}: &{names[level]} [{', '.join([f'*{names[level - 1]}'] * fan_out)}]")
    return "\n".join(lines) + "\n"


def test_long_texts_aliased_thousands_of_times_are_refused_at_once() -> None:
    """Few values, much text: a 40 KB document that expands to 29 MB (and a 200 KB one to 146 MB)
    passes the value and size limits, but its text is counted as expanded while it is parsed:
    INVALID_ARGUMENT naming the field at once, health checks unaffected, no memory taken. The
    resolved request's size is counted without writing it, and stops at the limit."""
    import resource

    from stage_cosim.bridge.documents import DocumentLimits, check_request_size
    from stage_cosim.errors import UserError

    docs = [long_text_aliased(n) for n in (1_000, 10_000, 40_000, 200_000)]
    assert len(docs[2]) < 41_000 and docs[2].count("*") < 30
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with start_in_thread(config()) as s, Client(s.address, retries=0) as c, health_poller(c) as health:
        for doc in docs:
            code, text = submit_raw(c, "simulate", {**SMALL, "cluster_description": doc})
            assert code == "INVALID_ARGUMENT" and text.startswith(
                "cluster_description: expands to more than 262,144 bytes of text"), text[:200]
        assert c.server_info().jobs == 0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert health and set(health) == {"SERVING"}, health
    assert grown_mib < 100, grown_mib     # was 850 MB
    # the whole request, counted with an early stop: 100,000 references to one 1 MiB text
    shared = ["y" * (1 << 20)] * 100_000
    with pytest.raises(UserError) as err:
        check_request_size({"model": "m", "cluster": {"k": shared}}, DocumentLimits(),
                           {"cluster": "cluster_description"})
    assert err.value.parameter == "cluster_description"
    assert err.value.rule.startswith("makes the request more than 262,144 bytes of JSON")


def test_numbers_and_values_json_cannot_hold_are_invalid_argument(server_with_standins) -> None:
    """Integers over Python's 4,300 digits (decimal in any document, hexadecimal in YAML), and
    YAML's dates, binary data, sets and non-text keys: INVALID_ARGUMENT naming the document,
    never INTERNAL."""
    digits = "1" * 5000
    cases = [
        ("simulate", {**SMALL, "cluster_description": f"num_gpus: {digits}"}, None, "cluster_description", "digits"),
        ("simulate", {**SMALL, "cluster_description": f"num_gpus: 0x{'f' * 5000}"}, None, "cluster_description",
         "digits"),
        ("simulate", {"model_config": f'{{"n_layer": {digits}}}'}, None, "model_config", "digits"),
        ("optimize", SMALL, f'{{"budget": {digits}}}', "settings_json", "digits"),
        ("serve_sim", {"model": "llama3-8b"}, f'{{"rate": 1e{digits}}}', "rate", "positive number"),   # a float: inf
        ("simulate", {**SMALL, "cluster_description": "gpu: 2001-12-14"}, None, "cluster_description", "date"),
        ("simulate", {**SMALL, "cluster_description": "gpu: 2001-13-45"}, None, "cluster_description",
         "cannot be read"),
        ("simulate", {**SMALL, "cluster_description": "gpu: !!binary aGVsbG8="}, None, "cluster_description", "bytes"),
        ("simulate", {**SMALL, "cluster_description": "gpu: !!set {a, b}"}, None, "cluster_description", "set"),
        ("simulate", {**SMALL, "cluster_description": "{1: a, gpu: b}"}, None, "cluster_description", "not text"),
    ]
    with Client(server_with_standins.address, retries=0) as c:
        for kind, design, settings, field, rule in cases:
            code, details = submit_raw(c, kind, design, settings)
            assert code == "INVALID_ARGUMENT", (field, code, details[:200])
            assert details.startswith(f"{field}: ") and rule in details and len(details) < 400, details[:300]


@pytest.mark.slow
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


@pytest.mark.slow
def test_jobs_that_cannot_fit_are_refused_and_over_limit_jobs_fail_in_one_line() -> None:
    from stage_cosim.bridge.process import WorkerSettings

    limits = WorkerSettings(memory_bytes=1 << 30, cpu_s=1.0)
    with start_in_thread(config(worker=limits)) as s, Client(s.address, retries=0) as c:
        info = c.server_info()
        assert (info.max_job_memory_bytes, info.job_cpu_s, info.search_workers) == (1 << 30, 1.0, 1)
        for design, field in (({**SMALL, "layers": 100_000}, "layers"),
                              ({**SMALL, "global_batch": 2 ** 31 - 1}, "global_batch")):
            code, text = submit_raw(c, "simulate", design)
            assert code == "INVALID_ARGUMENT" and text.startswith(f"{field}: ") and "GiB of memory" in text, text
        code, text = submit_raw(c, "optimize", {**SMALL, "layers": 100_000, "cluster": "dgx-h100:8",
                                                "global_batch": 8})
        assert code == "INVALID_ARGUMENT" and text.startswith("layers: "), text
        # a mesh past the 2^20 ranks the tool takes (the audit's 33 million ranks sat at a 1 GiB
        # limit for minutes) is refused with that limit, whatever the memory it would need
        for dp, tp in ((2 ** 28, 1), (2 ** 24, 2)):
            code, text = submit_raw(c, "simulate", {**SMALL, "layers": 2, "dp": dp, "tp": tp, "global_batch": dp,
                                                    "cluster": f"dgx-h100:{dp * tp}"})
            assert code == "INVALID_ARGUMENT" and text.startswith("dp: ") and "1,048,576" in text, text
        # and a stream of a billion requests needs gigabytes
        code, text = submit_raw(c, "serve_sim", {"model": "llama3-8b"}, {"rate": 5, "num_requests": 10 ** 9})
        assert code == "INVALID_ARGUMENT" and text.startswith("num_requests: ") and "GiB of memory" in text, text
        assert c.server_info().jobs == 0
        memory = c.wait(c.submit("optimize", SMALL, settings={"allocate_mib": 2048}).id)
        assert memory.state == pb.FAILED and memory.error == "memory: the job needed more than this server's " \
                                                            "1,024 MiB per job" and not memory.error_parameter
        cpu = c.wait(c.submit("optimize", SMALL, settings={"spin_s": 60}).id)
        assert cpu.state == pb.FAILED and cpu.error.startswith("cpu: the job used more than its 1 s of CPU time")
        assert c.result(c.submit("optimize", SMALL, settings={"budget": 2}).id)["evaluations"] == 2


@pytest.mark.slow
def test_the_largest_mesh_accepted_runs_in_bounded_memory() -> None:
    """A real request can no longer outgrow a worker by its mesh: the largest world the tool
    takes (2^20 ranks) simulates within 1 GiB of address space (it used to be possible to submit
    4 million ranks, which outgrew any limit), and one past it is refused at submit. The
    watchdog that fails a job at its limit is tested with an allocating job above."""
    from stage_cosim.bridge.process import WorkerSettings

    k = 19
    request = {**SMALL, "layers": 2, "seq_len": 128, "dp": 2 ** k, "tp": 2, "global_batch": 2 ** k,
               "cluster": f"dgx-h100:{2 ** (k + 1)}"}
    with start_in_thread(config(worker=WorkerSettings(memory_bytes=1 << 30))) as s, Client(s.address) as c:
        job = c.wait(c.submit("simulate", request, timeout_s=300).id)
        assert job.state == pb.SUCCEEDED, job.error
        code, text = submit_raw(c, "simulate", {**request, "dp": 2 ** (k + 1), "global_batch": 2 ** (k + 1),
                                                "cluster": f"dgx-h100:{2 ** (k + 2)}"})
        assert code == "INVALID_ARGUMENT" and text.startswith("dp: ") and "1,048,576" in text, text


# -- recovery and streams --------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_silently_dropped_connection_does_not_hang_a_watch(server_with_standins) -> None:
    """The connection goes silent mid-watch (nothing passes, nothing is closed): the client misses
    its heartbeats, gives the connection up for a new one and resumes; the watch ends with the
    job's final state soon after the job ends, with every event once."""
    from bridge_proxy import DroppingProxy

    proxy = DroppingProxy(server_with_standins.port)
    try:
        with Client(proxy.address, retries=10, backoff_s=0.05, heartbeat_s=0.5) as c:
            job = c.submit("optimize", SMALL, settings={"budget": 8, "sleep": 0.1})
            seen = []
            for event in c.watch(job.id):
                seen.append(event)
                if len(seen) == 3:
                    proxy.stall_all()
        seqs = [e.seq for e in seen]
        assert seqs == list(range(1, len(seqs) + 1)) and seen[-1].state.state == pb.SUCCEEDED
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def server_with_standins():
    with start_in_thread(config()) as s:
        yield s


def start_serve(data: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """``stage-cosim serve`` in a process of its own (one worker, the stand-ins), on a free port."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    proc = subprocess.Popen([sys.executable, "-m", "stage_cosim", "serve", "--port", "0", "--workers", "1",
                             "--heartbeat", "0.2", "--worker-init", STANDINS, "--search-check", STANDIN_CHECK,
                             "--data-dir", str(data), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()          # type: ignore[union-attr]
    return proc, "127.0.0.1:" + line.split(" serving on ")[1].split()[0].rsplit(":", 1)[1]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_kill_9_of_the_server_ends_its_workers_and_a_restart_resumes_every_watch(tmp_path) -> None:
    """kill -9 mid-job: the worker and the process its job started die with the server; an upload
    cut short leaves nothing after the restart; the restarted server runs the running and the
    queued job again, numbering events on, so a watch resumed with after_seq ends with the final
    state and the whole log reads 1, 2, 3, ... once."""
    import threading
    import time

    from test_bridge import process_gone

    data = tmp_path / "data"
    proc, address = start_serve(data)
    try:
        with Client(address, retries=0) as c:
            running = c.submit("optimize", SMALL, settings={"budget": 20, "sleep": 0.05, "spawn_child": True})
            queued = c.submit("optimize", SMALL, settings={"budget": 2})
            pids: dict[str, int] = {}
            seen: list[pb.JobEvent] = []
            for event in c.watch(running.id):
                seen.append(event)
                if event.HasField("log") and event.log.line.split()[1:2] == ["pid"]:
                    pids[event.log.line.split()[0]] = int(event.log.line.split()[-1])
                if len(pids) == 2 and any(e.HasField("progress") for e in seen):
                    break
            release = threading.Event()

            def cut_short_upload() -> None:
                def messages():
                    yield pb.UploadTracesRequest(header=pb.UploadHeader(files=[pb.FileSpec(
                        path="a.et", size=2 << 20, sha256="0" * 64)]))
                    yield pb.UploadTracesRequest(chunk=pb.FileChunk(path="a.et", offset=0, data=b"x" * (1 << 20)))
                    release.wait(30)
                with pytest.raises(grpc.RpcError):
                    c.stub.UploadTraces(messages())

            uploader = threading.Thread(target=cut_short_upload)
            uploader.start()
            deadline = time.time() + 20
            while not list((data / "uploads").glob(".incoming-*")) and time.time() < deadline:
                time.sleep(0.02)
            assert list((data / "uploads").glob(".incoming-*"))
            proc.kill()
            proc.wait()
            release.set()
            uploader.join(30)
        assert set(pids) == {"worker", "child"}
        deadline = time.time() + 10
        while not all(process_gone(p) for p in pids.values()) and time.time() < deadline:
            time.sleep(0.05)
        assert all(process_gone(p) for p in pids.values()), pids         # they died with their server
        proc, address = start_serve(data)
        assert not list((data / "uploads").glob(".incoming-*"))
        with Client(address) as c:
            rest = list(c.watch(running.id, after_seq=seen[-1].seq))
            assert rest[0].seq == seen[-1].seq + 1 and rest[-1].state.state == pb.SUCCEEDED
            log = list(c.watch(running.id))
            assert [e.seq for e in log] == list(range(1, len(log) + 1))
            assert [e.SerializeToString() for e in log[:len(seen)]] == [e.SerializeToString() for e in seen]
            assert any(e.HasField("log") and e.log.line.startswith("queued again") for e in rest)
            assert c.wait(queued.id).state == pb.SUCCEEDED
    finally:
        stop(proc)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard reads /proc")
def test_a_worker_that_runs_no_code_still_dies_with_its_server(tmp_path) -> None:
    """A worker that cannot run a line of Python (stopped here; stuck in an allocation at its
    memory limit in real life) misses its parent-death signal and its pipe's end: its guard
    process ends its whole group when the server is killed."""
    import time

    from test_bridge import process_gone

    proc, address = start_serve(tmp_path / "data")
    try:
        with Client(address) as c:
            assert c.result(c.submit("simulate", SMALL).id)["step_time_s"] > 0       # a worker is warm
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        workers = [int(p) for p in children]
        group = [int(p) for p in subprocess.run(["pgrep", "-g", str(os.getpgid(workers[0]))], capture_output=True,
                                                text=True).stdout.split()]
        assert len(workers) == 1 and len(group) == 2            # the worker and its guard
        os.kill(workers[0], signal.SIGSTOP)
        proc.kill()
        proc.wait()
        deadline = time.time() + 10
        while not all(process_gone(p) for p in group) and time.time() < deadline:
            time.sleep(0.05)
        assert all(process_gone(p) for p in group), group
    finally:
        stop(proc)


def test_a_resumed_watch_of_a_finished_job_always_ends_with_its_final_state(server_with_standins, run_cli) -> None:
    """after_seq at, past or far past the last event of a finished job (succeeded, failed,
    cancelled): the stream ends with the job's final state event, sent again with its own
    number — never a silent, empty stream."""
    s = server_with_standins
    with Client(s.address, retries=0) as c:
        done = c.wait(c.submit("optimize", SMALL, settings={"budget": 2}).id)
        failed = c.wait(c.submit("optimize", SMALL, settings={"fail": True}).id)
        queued = c.submit("optimize", SMALL, settings={"budget": 10_000, "sleep": 1}, timeout_s=60)
        c.cancel(queued.id)
        cancelled = c.wait(queued.id)
        for job in (done, failed, cancelled):
            final = [e for e in c.watch(job.id) if e.HasField("state")][-1]
            assert final.state.state == job.state
            for after in (job.last_seq, job.last_seq + 7, 10 ** 6):
                raw = list(c.stub.WatchJob(pb.WatchJobRequest(job_id=job.id, after_seq=after), timeout=10))
                assert [e.SerializeToString() for e in raw] == [final.SerializeToString()], (job.id, after)
                assert [e.seq for e in c.watch(job.id, after_seq=after)] == [final.seq]
            rest = list(c.watch(job.id, after_seq=final.seq - 1))      # one before the end: the end, once
            assert rest[-1].SerializeToString() == final.SerializeToString()
            assert sum(e.HasField("state") and e.state.state == job.state for e in rest) == 1
    code, out, _ = run_cli("remote", "watch", done.id, "--after", str(10 ** 6), "--server", s.address)
    assert code == 0 and out.splitlines()[-1].split()[2:4] == ["state", "succeeded"], out


def test_search_and_serving_settings_are_checked_at_submit() -> None:
    """Every optimize, explore and serve_sim setting goes through the parsing its job would run,
    at submit: a bad key or value is INVALID_ARGUMENT naming it, and no job (no worker) starts."""
    optimize = dict(SMALL, cluster="dgx-h100:8", global_batch=8)
    explore = {"model": "llama3-8b", "baseline": "dgx-h100:8", "global_batch": 8, "seq_len": 256,
               "variables": {"gpu.hbm_GBps": {"values": [3350, 4000]}}}
    serve = {"rate": 5, "num_requests": 4}
    cases = [
        ("optimize", optimize, {"astra_bin": "x"}, "astra_bin", "is not an optimize request field"),
        ("optimize", optimize, {"budget": float("nan")}, "budget", "must be an integer"),
        ("optimize", optimize, {"budget": 0}, "budget", "must be at least 1"),
        ("optimize", optimize, {"top": "5"}, "top", "must be an integer"),
        ("optimize", optimize, {"objective": "fastest"}, "objective", "must be one of"),
        ("optimize", optimize, {"objective": ["step-time"]}, "objective", "must be a name"),
        ("optimize", optimize, {"objective": "cost"}, "price", "needs --price"),
        ("optimize", optimize, {"headroom": 1.5}, "headroom", "must be in [0, 1)"),
        ("optimize", optimize, {"price": float("inf")}, "price", "must be a finite number"),
        ("optimize", optimize, {"allow_cross_domain_tp": "yes"}, "allow_cross_domain_tp", "true or false"),
        ("optimize", SMALL, {"budget": 2}, "global_batch", "is required for optimize"),
        ("explore", {}, {**explore, "bogus": 1}, "bogus", "is not an explore setting"),
        ("explore", {}, {**explore, "mode": "nope"}, "mode", "must be one of"),
        ("explore", {}, {**explore, "variables": {"gpu.nope": {"values": [1]}}}, "variables.gpu.nope", "numeric field"),
        ("explore", {}, {k: v for k, v in explore.items() if k != "variables"}, "variables", "is required"),
        ("serve_sim", {"model": "llama3-8b"}, {**serve, "bogus": 1}, "bogus", "is not a serve-sim request field"),
        ("serve_sim", {"model": "llama3-8b"}, {**serve, "rate": -1}, "rate", "positive number"),
        ("serve_sim", {"model": "llama3-8b"}, {"num_requests": 4}, "rate", "is required"),
        ("serve_sim", {"model": "llama3-8b"}, {**serve, "max_num_seqs": 0}, "max-num-seqs", "positive integer"),
        ("serve_sim", {"model": "llama3-8b"}, {**serve, "routing": "random"}, "routing", "must be one of"),
        ("serve_sim", {"model": "llama3-8b"}, {**serve, "seed": "one"}, "seed", "must be an integer"),
        ("serve_sim", {"model": "llama3-8b"}, {**serve, "rates": "1,x"}, "rates", "positive numbers"),
        ("serve_sim", {"model": "llama3-8b"}, {**serve, "slo_ttft": 0}, "slo-ttft", "positive number"),
        ("serve_sim", {"model": "llama3-8b", "global_batch": 8}, serve, "global_batch", "batches requests itself"),
        ("serve_sim", {"model": "llama3-8b", "phase": "decode"}, serve, "phase", "is not a serve-sim request field"),
        ("serve_sim", {"model": "llama3-8b"}, {"requests": [{"arrival_s": 0, "input_len": 0, "output_len": 1}]},
         "requests", "input_len, output_len >= 1"),
        ("serve_sim", {"model": "llama3-8b"}, {"requests": "rows"}, "requests", "must be a list"),
        ("serve_sim", {"model": "llama3-8b"}, {**serve, "trace": "requests.csv"}, "trace", "names a file"),
    ]
    with start_in_thread(config(worker_init=None)) as s, Client(s.address, retries=0) as c:    # the real searches
        for kind, design, settings, field, rule in cases:
            code, text = submit_raw(c, kind, design, settings)
            assert code == "INVALID_ARGUMENT" and text.startswith(f"{field}: ") and rule in text, (kind, settings, text)
        assert c.server_info().jobs == 0                       # refused before any job existed


def test_operator_limits_keep_every_reply_within_a_default_clients_messages(run_cli) -> None:
    """--max-request-kib is bounded so that the largest job record — its request at that limit,
    an inline result, progress, error and log excerpt at theirs — fits a default client's 4 MiB
    messages; at the bound, submitting, polling, listing and watching all work."""
    from stage_cosim.bridge.documents import DocumentLimits
    from stage_cosim.bridge.jobs import MAX_REQUEST_BYTES, RECORD_BYTES_BESIDES_REQUEST
    from stage_cosim.errors import UserError

    assert MAX_REQUEST_BYTES + RECORD_BYTES_BESIDES_REQUEST <= 4 << 20
    code, _, err = run_cli("serve", "--max-request-kib", "100000")
    assert code == 2 and err.startswith(f"error: max-request-kib: must be at most {MAX_REQUEST_BYTES >> 10:,}"), err
    code, _, err = run_cli("serve", "--max-job-memory-mib", "10")
    assert code == 2 and err.startswith("error: max-job-memory-mib: must be 0 (no limit) or at least 256"), err
    with pytest.raises(UserError) as refused:
        start_in_thread(config(documents=DocumentLimits(max_request_bytes=8 << 20))).start()
    assert refused.value.parameter == "max-request-kib"
    limits = DocumentLimits(max_bytes=MAX_REQUEST_BYTES, max_request_bytes=MAX_REQUEST_BYTES)
    pad = "x" * (MAX_REQUEST_BYTES - (4 << 10))
    with start_in_thread(config(documents=limits)) as s, Client(s.address, retries=0) as c:
        jobs = [c.submit("optimize", SMALL, settings={"budget": 1, "pad": pad, "n": i}) for i in range(3)]
        code, text = submit_raw(c, "optimize", SMALL, {"pad": pad + "x" * (8 << 10)})
        assert code == "INVALID_ARGUMENT" and text.startswith("settings_json: "), text[:200]
        for job in jobs:
            final = c.wait(job.id)
            assert final.state == pb.SUCCEEDED and final.ByteSize() < 4 << 20
            assert len(c.job(job.id).request_json) > MAX_REQUEST_BYTES - (8 << 10)
            assert [e.state.state for e in c.watch(job.id) if e.HasField("state")][-1] == pb.SUCCEEDED
        assert sorted(j.id for j in c.jobs()) == sorted(j.id for j in jobs)


@pytest.mark.slow
def test_sigterm_keeps_queued_jobs_for_the_next_server_and_cancels_them_without_one(tmp_path) -> None:
    """One behaviour for queued jobs, whichever way a server stops: with a data directory they
    wait there for the next server (after SIGTERM as after kill -9); without one, no server will
    run them, so a drain cancels them. A running job gets the drain timeout, then is cancelled."""
    import time

    from stage_cosim.bridge.limits import Limits

    data = tmp_path / "data"
    proc, address = start_serve(data, "--drain-timeout", "0.5")
    try:
        with Client(address, retries=0) as c:
            running = c.submit("optimize", SMALL, settings={"budget": 1000, "sleep": 0.05})
            while c.job(running.id).state != pb.RUNNING:
                time.sleep(0.02)
            queued = c.submit("optimize", SMALL, settings={"budget": 2})
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        proc, address = start_serve(data)
        with Client(address) as c:
            assert c.job(running.id).state == pb.CANCELLED
            final = c.wait(queued.id)
            assert final.state == pb.SUCCEEDED
            states = [e.state.state for e in c.watch(queued.id) if e.HasField("state")]
            assert states == [pb.QUEUED, pb.RUNNING, pb.SUCCEEDED]
    finally:
        stop(proc)
    s = start_in_thread(config(limits=Limits(workers=1, kill_grace_s=0.2))).start()
    try:
        with Client(s.address) as c:
            running = c.submit("optimize", SMALL, settings={"budget": 1000, "sleep": 0.05})
            while c.job(running.id).state != pb.RUNNING:
                time.sleep(0.02)
            queued = c.submit("optimize", SMALL, settings={"budget": 2})
    finally:
        s.stop(drain_timeout_s=0.5)
    assert s.server.manager.jobs[queued.id].state == pb.CANCELLED
    assert s.server.manager.jobs[running.id].state == pb.CANCELLED


# -- smaller --------------------------------------------------------------------------------------------

def test_bad_bytes_names_pages_and_empty_fields_are_invalid_argument(server_with_standins, tmp_path) -> None:
    """Garbage instead of a message, an upload name over 255 bytes or both a file and a folder, a
    negative page size, and an empty text field: INVALID_ARGUMENT naming the field, never
    UNKNOWN or INTERNAL, and no server path in any message."""
    import hashlib
    import os as os_

    s = server_with_standins
    data = str(s.server.manager.data)
    channel = grpc.insecure_channel(s.address)
    raw = lambda b: b  # noqa: E731
    try:
        for method in pb.DESCRIPTOR.services_by_name["Bridge"].methods:
            path = f"/stagecosim.v1.Bridge/{method.name}"
            for garbage in (b"\xff\xff\xff\xff", b"\x0a\x05ab", os_.urandom(64)):
                if method.client_streaming:
                    call = lambda p=path, g=garbage: channel.stream_unary(p, raw, raw)(iter([g]), timeout=10)  # noqa: E731
                elif method.server_streaming:
                    call = lambda p=path, g=garbage: list(channel.unary_stream(p, raw, raw)(g, timeout=10))  # noqa: E731
                else:
                    call = lambda p=path, g=garbage: channel.unary_unary(p, raw, raw)(g, timeout=10)  # noqa: E731
                try:
                    call()
                    continue           # random bytes can be a valid message
                except grpc.RpcError as exc:
                    code, details = exc.code(), exc.details()
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method.name, code, details)
                assert data not in details
    finally:
        channel.close()

    def upload(*files: tuple[str, bytes]) -> grpc.RpcError:
        specs = [pb.FileSpec(path=p, size=len(d), sha256=hashlib.sha256(d).hexdigest()) for p, d in files]
        messages = [pb.UploadTracesRequest(header=pb.UploadHeader(files=specs))]
        messages += [pb.UploadTracesRequest(chunk=pb.FileChunk(path=p, data=d)) for p, d in files if d]
        with pytest.raises(grpc.RpcError) as err:
            c.stub.UploadTraces(iter(messages), timeout=30)
        return err.value

    with Client(s.address, retries=0) as c:
        for files, field in ((((f"{'n' * 256}.et", b"abc"),), "files[0].path"),
                             (((f"d/{'é' * 128}", b"abc"),), "files[0].path"),
                             ((("a", b"abc"), ("a/b.et", b"abc")), "files[0].path"),
                             ((("x/a.et", b"abc"), ("x", b"")), "files[1].path")):
            err = upload(*files)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(f"{field}: "), \
                err.details()
            assert data not in err.details()
        assert not list(s.server.manager.uploads_root.glob(".incoming-*"))
        (tmp_path / "set").mkdir()
        (tmp_path / "set" / "ok.et").write_bytes(b"abc")
        uploaded = c.upload(tmp_path / "set").upload_id
        for call, request in ((c.stub.ListJobs, pb.ListJobsRequest(page_size=-5)),
                              (c.stub.ListArtifacts, pb.ListArtifactsRequest(upload_id=uploaded, page_size=-1))):
            with pytest.raises(grpc.RpcError) as err:
                call(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("page_size:")
        assert [f.path for f in c.artifacts(upload_id=uploaded)] == ["ok.et"]
        for field in ("schedule", "backend", "attention", "recompute", "network_model", "cluster", "model"):
            code, text = submit_raw(c, "simulate", {**SMALL, field: ""})
            assert (code, text) == ("INVALID_ARGUMENT", f"{field}: is empty (leave the field unset for the default)")
        code, text = submit_raw(c, "simulate", {**SMALL, "axis_order": ["tp", "", "pp"]})
        assert code == "INVALID_ARGUMENT" and text.startswith("axis_order: is empty")
        code, text = submit_raw(c, "optimize", SMALL, {"objective": ""})
        assert code == "INVALID_ARGUMENT" and text.startswith("objective: is empty")


def test_worker_module_path_has_no_working_directory(tmp_path, monkeypatch) -> None:
    """A worker runs in the jobs directory, then in each job's: neither may be on its module path
    (an unset PYTHONPATH once became an empty entry, which Python reads as the working directory,
    so a worker listed the jobs directory on every missed import)."""
    import subprocess

    from stage_cosim.bridge.process import worker_environment

    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = worker_environment()
    assert "" not in env["PYTHONPATH"].split(os.pathsep)
    (tmp_path / "shadow_probe_module.py").write_text("")
    args = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-c",
            "import importlib.util, os, sys; print(importlib.util.find_spec('shadow_probe_module') is None, "
            "os.getcwd() in [os.path.abspath(p) for p in sys.path])"]
    out = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]
