#!/usr/bin/env python3
"""A STAND-IN for the ASTRA-sim binary, for testing process handling only.

It prints in the simulator's real output format but computes nothing: the numbers are made
up (rank r "finishes" at 1000 * (r + 1) cycles). Tests use it to exercise how the adapter
launches, times out, and reads crashes and deadlocks. Its numbers must never reach a user.

STANDIN_MODE: ok | crash | deadlock | hang | exit3 | abort-on-exit (every rank printed, then SIGABRT)
| drop-on-exit (SIGABRT with the last two ranks' lines lost, as the binary's asynchronous log can
lose them to its double free on exit) | drop-on-exit-once (that on the first run in a directory,
then as ok) | drop-all-on-exit-once (the first run in a directory loses every rank's line and
dies of SIGABRT after glibc's heap-corruption message, as the binary was seen to; then as ok)
"""

import os
import re
import signal
import sys
import time


def ranks() -> int:
    text = open("network.yml").read()
    counts = re.search(r"npus_count:\s*\[([^\]]*)\]", text)[1]
    n = 1
    for c in counts.split(","):
        n *= int(c)
    return n


def main() -> None:
    args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    assert args["--workload-configuration"] and args["--system-configuration"]
    mode = os.environ.get("STANDIN_MODE", "ok")
    n = ranks()
    if mode == "hang":
        time.sleep(3600)
    if mode == "exit3":
        print("[error] cannot parse system file")
        sys.exit(3)
    if mode == "crash":
        print("[info] starting")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGFPE)
    if mode in ("drop-on-exit-once", "drop-all-on-exit-once"):
        first = mode.replace("-once", "")
        mode = "ok" if os.path.exists(".standin-ran") else first
        open(".standin-ran", "w").close()
    if mode == "drop-all-on-exit":
        print("malloc_consolidate(): unaligned fastbin chunk detected")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGABRT)
    shown = n if mode in ("ok", "abort-on-exit") else max(0, n - 2) if mode == "drop-on-exit" else max(0, n - 1)
    for r in range(shown):
        print(f"[2026-01-01 00:00:00.000] [workload] [info] sys[{r}] finished, {1000 * (r + 1)} cycles, "
              f"exposed communication {100 * (r + 1)} cycles.")
        print(f"[2026-01-01 00:00:00.000] [statistics] [info] sys[{r}], Wall time: {1000 * (r + 1)}")
        print(f"[2026-01-01 00:00:00.000] [statistics] [info] sys[{r}], GPU time: {900 * (r + 1)}")
        print(f"[2026-01-01 00:00:00.000] [statistics] [info] sys[{r}], Comm time: {300 * (r + 1)}")
    if mode == "deadlock":
        print("[2026-01-01 00:00:00.000] [workload] [critical] deadlock detected: rank stuck waiting")
    if mode in ("abort-on-exit", "drop-on-exit"):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGABRT)


if __name__ == "__main__":
    main()
