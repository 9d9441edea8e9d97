"""Read ASTRA-sim's output: one ``finished`` line per rank and its statistics lines.

    [..] [workload] [info] sys[3] finished, 64440 cycles, exposed communication 64440 cycles.
    [..] [statistics] [info] sys[3], Wall time: 64440
    [..] [statistics] [info] sys[3], GPU time: 100000
    [..] [statistics] [info] sys[3], Comm time: 64440

One cycle is one nanosecond. A deadlock exits 0 with fewer ``finished`` lines than ranks and a
line containing ``critical``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles, exposed communication (\d+) cycles")
STAT = re.compile(r"sys\[(\d+)\], (Wall time|GPU time|Comm time): (\d+)")


@dataclass
class AstraOutput:
    finished_ns: dict[int, int] = field(default_factory=dict)
    exposed_comm_ns: dict[int, int] = field(default_factory=dict)
    wall_ns: dict[int, int] = field(default_factory=dict)
    gpu_ns: dict[int, int] = field(default_factory=dict)
    comm_ns: dict[int, int] = field(default_factory=dict)
    critical: list[str] = field(default_factory=list)

    def missing(self, ranks: int) -> list[int]:
        return [r for r in range(ranks) if r not in self.finished_ns]

    @property
    def step_time_ns(self) -> int:
        return max(self.finished_ns.values(), default=0)


def parse_output(text: str) -> AstraOutput:
    out = AstraOutput()
    for line in text.splitlines():
        m = FINISHED.search(line)
        if m:
            r = int(m[1])
            out.finished_ns[r] = int(m[2])
            out.exposed_comm_ns[r] = int(m[3])
            continue
        m = STAT.search(line)
        if m:
            target = {"Wall time": out.wall_ns, "GPU time": out.gpu_ns, "Comm time": out.comm_ns}[m[2]]
            target[int(m[1])] = int(m[3])
            continue
        if "critical" in line.lower():
            out.critical.append(line.strip())
    return out
