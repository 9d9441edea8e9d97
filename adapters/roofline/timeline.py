"""Chrome / Perfetto trace of a replay: one track per rank per stream, one slice per node.

Open the file in https://ui.perfetto.dev (or chrome://tracing). Times are microseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from stage_cosim.adapters.roofline.engine import AgentProgram, Replay


def timeline_events(programs: Sequence[AgentProgram], rep: Replay, names: Sequence[Sequence[str]],
                    agents: Sequence[int] | None = None) -> list[dict]:
    events: list[dict] = []
    chosen = range(len(programs)) if agents is None else agents
    for a in chosen:
        p = programs[a]
        events.append({"ph": "M", "name": "process_name", "pid": a, "args": {"name": p.name}})
        tids: dict[str, int] = {}
        for i, t in enumerate(p.types):
            stream = p.streams[i] or "recv"
            tid = tids.setdefault(stream, len(tids))
            s, e = rep.start[a][i], rep.end[a][i]
            args = {"type": t}
            if t != "COMP":
                args.update(bytes=p.nbytes[i], kind=p.kind[i])
                if p.coll[i]:
                    args["collective"] = p.coll[i]
            events.append({"ph": "X", "pid": a, "tid": tid, "name": names[a][i], "ts": s * 1e6,
                           "dur": max(0.0, e - s) * 1e6, "cat": t, "args": args})
        for stream, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": a, "tid": tid, "args": {"name": stream}})
    return events


def write_timeline(path: Path, events: list[dict]) -> None:
    """Atomic: a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
