"""Memory and time at the largest world the tool takes (2^20 ranks, ``stage_cosim.limits``).

    python benchmarks/world_limit.py

Each case runs ``stage-cosim simulate`` in its own process and prints its wall time and peak
resident memory (the child's ru_maxrss), so the figure is the whole command's: interpreter,
imports, synthesis and simulation. A world past the limit is refused in one line, so this is the
most memory a simulation can ask for by its mesh.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from stage_cosim.limits import MAX_RANKS

SMALL = ["--model", "llama3-8b", "--layers", "8", "--seq-len", "128"]
CASES = [  # (label, flags)
    ("dp 2^20", ["--dp", str(MAX_RANKS), "--global-batch", str(MAX_RANKS), "--cluster", f"dgx-h100:{MAX_RANKS}"]),
    ("tp8 pp8 dp16384", ["--tp", "8", "--pp", "8", "--dp", str(MAX_RANKS // 64),
                         "--global-batch", str(MAX_RANKS // 64), "--cluster", f"dgx-h100:{MAX_RANKS}"]),
    ("one GPU (baseline)", ["--cluster", "dgx-h100:1"]),
]


def run(flags: list[str]) -> tuple[float, float]:
    """(wall seconds, peak resident MiB) of one simulate command in a child process."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "stage_cosim", "simulate", *SMALL, *flags],
                            stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)          # this child's own resource usage
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"simulate {' '.join(flags)} failed (status {proc.returncode})")
    return time.perf_counter() - t, usage.ru_maxrss / 1024          # ru_maxrss: KiB on Linux


def main() -> None:
    print(f"{'case':<22} {'ranks':>10} {'wall s':>8} {'peak MiB':>9}")
    for label, flags in CASES:
        ranks = int(flags[flags.index("--cluster") + 1].split(":")[1])
        wall, peak = run(flags)
        print(f"{label:<22} {ranks:>10,} {wall:>8.1f} {peak:>9.0f}")


if __name__ == "__main__":
    main()
