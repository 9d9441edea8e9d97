"""Bridge under load: concurrent clients submit small simulations and watch each to its end.

    python benchmarks/bridge_load.py [--clients 32] [--jobs 500] [--workers 2] [--server HOST:PORT]

Starts ``stage-cosim serve`` on a free loopback port (unless --server is given), then each
client thread takes design points from a shared list, submits each with its own request id,
resubmits every tenth (as a client retrying after a lost reply would) and watches the job to its
final state. Every design point is distinct, so nothing comes from the cache in the first pass.
Then it checks that no job was lost or duplicated and that every result equals the local
``stage_cosim.api.simulate`` of the same request, and prints throughput and latency (submit to
final event). A second pass submits the same points again, under new request ids: the cache
answers them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from stage_cosim import api
from stage_cosim.bridge import Client
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb


def design_points(n: int) -> list[dict[str, Any]]:
    """``n`` distinct small simulations of a shortened Llama-3 8B."""
    points = []
    for layers, seq, (dp, tp) in itertools.product(range(1, 1000), (128, 256, 512, 1024),
                                                   ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1))):
        points.append(dict(model="llama3-8b", layers=layers, seq_len=seq, dp=dp, tp=tp, global_batch=2 * dp))
        if len(points) == n:
            return points
    return points


def run_pass(address: str, points: list[dict[str, Any]], clients: int, tag: str) -> dict[str, Any]:
    work: queue.Queue[int] = queue.Queue()
    for i in range(len(points)):
        work.put(i)
    jobs: dict[int, pb.Job] = {}
    latencies: list[float] = []
    resubmits_same: list[bool] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client_loop() -> None:
        with Client(address, retries=8) as c:
            while True:
                try:
                    i = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    rid = f"{tag}-{i}"
                    t0 = time.perf_counter()
                    job = c.submit("simulate", points[i], request_id=rid)
                    if i % 10 == 0:
                        again = c.submit("simulate", points[i], request_id=rid)
                        with lock:
                            resubmits_same.append(again.id == job.id)
                    final = c.wait(job.id)
                    dt = time.perf_counter() - t0
                    with lock:
                        jobs[i] = final
                        latencies.append(dt)
                except Exception as exc:  # noqa: BLE001 (counted and reported)
                    with lock:
                        errors.append(f"{i}: {exc}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    latencies.sort()
    return {"jobs": jobs, "wall": wall, "latencies": latencies, "resubmits_same": resubmits_same, "errors": errors}


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def start_server(workers: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "stage_cosim", "serve", "--port", "0", "--workers", str(workers)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()   # type: ignore[union-attr]
    address = line.split(" serving on ")[1].split()[0]
    return proc, address


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--server", default=None, help="use this running server instead of starting one")
    args = ap.parse_args()

    proc = None
    address = args.server
    if address is None:
        proc, address = start_server(args.workers)
    try:
        points = design_points(args.jobs)
        first = run_pass(address, points, args.clients, f"load-{os.getpid()}")
        second = run_pass(address, points, args.clients, f"again-{os.getpid()}")
        with Client(address) as c:
            listed = [j for j in c.jobs(page_size=1000) if j.request_id.startswith(f"load-{os.getpid()}-")]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)

    # checks: every job final and succeeded, once, with the right result
    expected = [json.dumps(api.simulate(p), sort_keys=True) for p in points]
    jobs = first["jobs"]
    wrong = [i for i, job in jobs.items()
             if job.state != pb.SUCCEEDED or json.dumps(json.loads(job.result_json), sort_keys=True) != expected[i]]
    ids = [job.id for job in jobs.values()]
    lost = len(points) - len(jobs)
    duplicated = len(listed) - len(set(j.request_id for j in listed)) + (len(ids) - len(set(ids)))
    cached_first = sum(job.cached for job in jobs.values())
    cached_second = sum(job.cached for job in second["jobs"].values())
    wrong_second = [i for i, job in second["jobs"].items()
                    if json.dumps(json.loads(job.result_json), sort_keys=True) != expected[i]]

    print(f"bridge load: {args.clients} clients, {len(points)} distinct small simulations "
          f"(llama3-8b, 1-{max(p['layers'] for p in points)} layers, seq 128-1024, up to 4 GPUs), "
          f"server with {args.workers} workers, {os.cpu_count()} CPUs")
    for name, r, cached in (("first pass", first, cached_first), ("repeat (cache)", second, cached_second)):
        lat = r["latencies"]
        print(f"{name:<15} {len(r['jobs']) / r['wall']:8.1f} jobs/s   {r['wall']:6.2f} s   latency p50 "
              f"{1000 * pct(lat, 0.5):7.1f} ms  p99 {1000 * pct(lat, 0.99):7.1f} ms  mean "
              f"{1000 * statistics.fmean(lat) if lat else float('nan'):7.1f} ms   cached {cached}/{len(r['jobs'])}")
    ok = not (lost or duplicated or wrong or wrong_second or first["errors"] or second["errors"]) \
        and all(first["resubmits_same"]) and len(listed) == len(points)
    print(f"checks: {len(jobs)}/{len(points)} jobs final and succeeded with the local result, lost {lost}, "
          f"duplicated {duplicated}, wrong {len(wrong) + len(wrong_second)}, "
          f"resubmits answered with the same job {sum(first['resubmits_same'])}/{len(first['resubmits_same'])}, "
          f"errors {len(first['errors']) + len(second['errors'])}: {'OK' if ok else 'FAILED'}")
    for e in (first["errors"] + second["errors"])[:5]:
        print("  ", e)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
