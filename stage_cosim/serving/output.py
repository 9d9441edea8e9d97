"""A serving run's requests one by one, as CSV: what a measured trace can be compared against
request by request."""

from __future__ import annotations

import csv
import math
import os
import tempfile
from pathlib import Path

from stage_cosim.serving.scheduler import RequestLog

COLUMNS = ("arrival_s", "first_token_s", "finish_s", "input_tokens", "cached_tokens", "output_tokens", "dropped")


def _t(v: float) -> str:
    return "" if math.isnan(v) else f"{v:.6f}"


def write_requests_csv(log: RequestLog, path: str | Path) -> None:
    """One row per request in arrival order (times in seconds from the stream's start; empty
    where a request never got there: dropped or rejected). Written to a temporary file in the
    same folder and renamed, so a reader never sees half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            for r in range(len(log.arrival)):
                gone = log.dropped[r] or log.rejected[r]
                w.writerow((_t(log.arrival[r]), "" if gone else _t(log.first_token[r]),
                            "" if gone else _t(log.finish[r]), log.input_len[r], log.cached_tokens[r],
                            log.output_len[r], "true" if log.dropped[r] else "false"))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
