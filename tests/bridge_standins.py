"""Stand-ins for the searches, for the bridge's tests only (never a result a user sees).

``stage_cosim.api.optimize`` and ``explore`` are the lead's; the bridge looks them up when a job
runs. These small deterministic stand-ins exercise the job plumbing around them — progress that
carries best-so-far, log lines, should_stop, cancel, a child process to kill (as a running
ASTRA-sim would be), failures, large results — independently of the real search. The server's
worker processes install them with ``--worker-init bridge_standins:install``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Callable, Mapping


def standin_optimize(req: Mapping[str, Any], progress: Callable[[dict], None] | None = None,
                     should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Scores tp = 1, 2, 4, ... by a made-up step time; settings steer the stand-in's behaviour."""
    steps = int(req.get("budget", 4))
    sleep = float(req.get("sleep", 0.0))
    if req.get("fail"):
        raise RuntimeError("stand-in search failed on purpose")
    if req.get("allocate_mib"):       # more memory than a worker may have
        held = bytearray(int(req["allocate_mib"]) << 20)
        del held
    if req.get("spin_s"):             # more CPU time than a job may use
        end = time.process_time() + float(req["spin_s"])
        while time.process_time() < end:
            pass
    if req.get("spawn_child"):        # like a running ASTRA-sim binary: a process of its own
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"worker pid {os.getpid()}", file=sys.stderr, flush=True)
        print(f"child pid {child.pid}", file=sys.stderr, flush=True)
    best: dict[str, Any] | None = None
    done = 0
    for i in range(steps):
        if should_stop is not None and should_stop():
            break
        tp = 2 ** i
        score = round(1.0 / tp + 0.01 * tp, 6)
        if best is None or score < best["step_time_s"]:
            best = {"config": {"parallel": {"tp": tp}}, "step_time_s": score}
        done = i + 1
        print(f"stand-in evaluation {done}: tp{tp} -> {score}", file=sys.stderr, flush=True)
        if progress is not None:
            progress({"evaluations": done, "budget": steps, "best": best, "best_score": best["step_time_s"]})
        time.sleep(sleep)
    doc: dict[str, Any] = {"best": best, "top": [best] if best else [], "evaluations": done,
                           "proven_optimal": False, "infeasible": {}, "interrupted": done < steps,
                           "request": {k: req[k] for k in sorted(req) if k not in ("model_config",)}}
    if req.get("big_mib"):
        doc["padding"] = "x" * (int(req["big_mib"]) << 20)
    return doc


def standin_explore(req: Mapping[str, Any], progress: Callable[[dict], None] | None = None,
                    should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    doc = standin_optimize(req, progress, should_stop)
    return {"frontier": [doc["best"]], "space": req.get("space"), "evaluations": doc["evaluations"]}


def install() -> None:
    """Run in each worker process: put the stand-ins where the bridge looks them up."""
    import stage_cosim.api as api

    api.optimize = standin_optimize
    api.explore = standin_explore


def audit_opens() -> None:
    """Run in each worker process (instead of the stand-ins: the real searches run): record every
    file or directory the process opens under ``$BRIDGE_TEST_BAIT`` in ``$BRIDGE_TEST_OPEN_LOG``."""
    import os

    bait = os.environ["BRIDGE_TEST_BAIT"]
    log = os.open(os.environ["BRIDGE_TEST_OPEN_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    sys.addaudithook(opens_under(bait, lambda path: os.write(log, f"{os.getpid()} {path}\n".encode())))


def opens_under(root: str, record: Callable[[str], Any]) -> Callable[[str, tuple], None]:
    """An audit hook calling ``record(path)`` for every open, listdir or scandir below ``root``."""
    import os

    def hook(event: str, args: tuple) -> None:
        if event not in ("open", "os.listdir", "os.scandir") or not args or isinstance(args[0], int):
            return
        try:
            path = os.path.abspath(os.fsdecode(args[0]))
        except (TypeError, ValueError):
            return
        if path == root or path.startswith(root + os.sep):
            record(path)

    return hook
