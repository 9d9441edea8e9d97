"""The requests a serving simulation is driven by: arrival time, prompt and output lengths, and
what their prompts share.

Either Poisson arrivals at a rate with lengths drawn from a distribution (fixed, or log-normal
around the given means, as request lengths of chat workloads are), optionally each prompt
opening with one of ``prefix_groups`` shared prefixes of ``prefix_len`` tokens (a system prompt,
few-shot examples); or a trace file with one request per row: ``arrival_s,input_len,output_len``
(CSV with that header, or JSON lines with those keys) and optionally ``hash_ids`` (the prompt's
512-token blocks by content id, see :mod:`stage_cosim.serving.prefix`). Mooncake traces (JSON
lines of ``timestamp`` in milliseconds, ``input_length``, ``output_length``, ``hash_ids``) are
read as they are.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stage_cosim.errors import UserError, positive_int, require
from stage_cosim.files import local_files_allowed, refuse_local_file
from stage_cosim.serving.prefix import MOONCAKE_HASH_BLOCK

TRACE_FIELDS = ("arrival_s", "input_len", "output_len")
LENGTH_DISTRIBUTIONS = ("lognormal", "fixed")


@dataclass(frozen=True)
class Requests:
    """Requests in arrival order, column by column."""

    arrival_s: np.ndarray      # float64, non-decreasing
    input_len: np.ndarray      # int64, >= 1
    output_len: np.ndarray     # int64, >= 1 (the first output token comes out of the prefill)
    # per request, the content ids of its prompt's hash blocks (None: every prompt its own)
    hash_ids: tuple[tuple[int, ...], ...] | None = None
    hash_block: int = MOONCAKE_HASH_BLOCK          # tokens per hash id

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def rate(self) -> float:
        """Mean arrival rate over the trace (requests/s)."""
        span = float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0
        return (len(self) - 1) / span if span > 0 else math.inf

    def clipped(self, max_context: int) -> "Requests":
        """Every request fits ``max_context`` tokens (prompt plus output): prompts are cut first."""
        out = np.minimum(self.output_len, max_context - 1)
        inp = np.minimum(self.input_len, max_context - out)
        return Requests(self.arrival_s, inp, out, self.hash_ids, self.hash_block)


@dataclass(frozen=True)
class RequestStream:
    """Poisson arrivals at ``rate`` requests/s; prompt and output lengths with the given means
    (``lognormal``: log-normal with shape ``spread``, the spread of real chat prompts; ``fixed``:
    every request the same)."""

    rate: float
    """Poisson arrivals, requests per second."""
    num_requests: int = 1000
    """Requests to generate."""
    input_len: int = 1024
    """Mean prompt tokens (a shared prefix comes on top)."""
    output_len: int = 256
    """Mean output tokens."""
    lengths: str = "lognormal"
    """Length distribution: lognormal around the means (the spread of real chat prompts) or fixed
    (every request the same)."""
    spread: float = 0.6
    """Shape (sigma) of the log-normal lengths."""
    seed: int = 0
    """Random seed of the generated requests."""
    prefix_len: int = 0
    """Generated prompts open with a shared prefix of this many tokens, added to their own
    input-len tokens (as vLLM's benchmark random prefix is)."""
    prefix_groups: int = 1
    """Distinct shared prefixes, one drawn per request."""

    def __post_init__(self) -> None:
        require(isinstance(self.rate, (int, float)) and self.rate > 0 and math.isfinite(self.rate), "rate",
                f"must be a positive number of requests per second, got {self.rate!r}")
        positive_int(self.num_requests, "num-requests")
        positive_int(self.input_len, "input-len")
        positive_int(self.output_len, "output-len")
        require(self.lengths in LENGTH_DISTRIBUTIONS, "lengths",
                f"must be one of {', '.join(LENGTH_DISTRIBUTIONS)}, got {self.lengths!r}")
        require(0 <= self.spread <= 3, "length-spread", f"must be in [0, 3], got {self.spread!r}")
        require(isinstance(self.seed, int) and self.seed >= 0, "seed", f"must be a non-negative integer, got {self.seed!r}")
        require(isinstance(self.prefix_len, int) and self.prefix_len >= 0, "prefix-len",
                f"must be a non-negative integer (tokens), got {self.prefix_len!r}")
        positive_int(self.prefix_groups, "prefix-groups")

    def generate(self) -> Requests:
        rng = np.random.default_rng(self.seed)
        gaps = rng.exponential(1.0 / self.rate, self.num_requests)
        arrival = np.cumsum(gaps) - gaps[0]          # the first request arrives at 0
        inp, out = self._lengths(rng, self.input_len), self._lengths(rng, self.output_len)
        if not self.prefix_len:
            return Requests(arrival, inp, out)
        # drawn after the lengths, so a stream with a prefix has the same arrivals and lengths
        groups = rng.integers(0, self.prefix_groups, self.num_requests)
        return Requests(arrival, inp + self.prefix_len, out, tuple((int(g),) for g in groups), self.prefix_len)

    def _lengths(self, rng: np.random.Generator, mean: int) -> np.ndarray:
        if self.lengths == "fixed" or self.spread == 0:
            return np.full(self.num_requests, mean, dtype=np.int64)
        # a log-normal whose mean is ``mean``: mu = ln(mean) - spread^2 / 2
        draw = rng.lognormal(math.log(mean) - self.spread ** 2 / 2, self.spread, self.num_requests)
        return np.maximum(1, np.rint(draw)).astype(np.int64)


def read_trace(path: str | Path, parameter: str = "trace") -> Requests:
    """Requests from a CSV (header ``arrival_s,input_len,output_len``) or JSON-lines file."""
    if not local_files_allowed():
        refuse_local_file(parameter, str(path))
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise UserError(parameter, f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(parameter, f"{p}: cannot be read ({exc.__class__.__name__})") from None
    rows = _json_rows(text, p, parameter) if text.lstrip().startswith("{") else _csv_rows(text, p, parameter)
    return requests_from_rows(rows, f"{parameter}: {p}")


def _csv_rows(text: str, p: Path, parameter: str) -> list[dict]:
    reader = csv.DictReader(text.splitlines())
    names = set(_mooncake({f: "" for f in reader.fieldnames or []}))
    missing = [f for f in TRACE_FIELDS if f not in names]
    if missing:
        raise UserError(parameter, f"{p}: a CSV trace needs the columns {', '.join(TRACE_FIELDS)} "
                                   f"(missing {', '.join(missing)})")
    return list(reader)


def _json_rows(text: str, p: Path, parameter: str) -> list[dict]:
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise UserError(parameter, f"{p}: line {i} is not valid JSON") from None
        if not isinstance(row, dict):
            raise UserError(parameter, f"{p}: line {i} is not a JSON object")
        rows.append(row)
    return rows


def _mooncake(row: dict) -> dict:
    """A Mooncake trace row (timestamp in ms, input_length, output_length) in our field names."""
    if "arrival_s" in row or "timestamp" not in row:
        return row
    out = dict(row)
    try:
        out["arrival_s"] = float(row["timestamp"]) / 1000
    except (TypeError, ValueError):
        out["arrival_s"] = row["timestamp"]
    for ours, theirs in (("input_len", "input_length"), ("output_len", "output_length")):
        if theirs in row:
            out[ours] = row[theirs]
    return out


def _hash_ids(value, head: str, tail: str, i: int) -> tuple[int, ...]:  # noqa: ANN001
    """A row's ``hash_ids``: a JSON list, or in CSV a list or space-separated integers."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text) if text.startswith("[") else [int(x) for x in text.split()]
        except ValueError:
            value = None
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise UserError(head, f"{tail + ': ' if tail else ''}request {i}: hash_ids must be a list of integers")
    return tuple(value)


def requests_from_rows(rows: list[dict], where: str) -> Requests:
    """Requests from rows of ``arrival_s``, ``input_len``, ``output_len`` and optionally
    ``hash_ids`` (or Mooncake's ``timestamp`` in ms, ``input_length``, ``output_length``),
    sorted by arrival."""
    head, _, tail = where.partition(": ")
    if not rows:
        raise UserError(head, f"{tail + ': ' if tail else ''}holds no requests")
    arrival, inp, out, ids = [], [], [], []
    for i, row in enumerate(rows, 1):
        row = _mooncake(row)
        if row.get("hash_ids") not in (None, ""):
            ids.append(_hash_ids(row["hash_ids"], head, tail, i))
        else:
            ids.append(())
        try:
            a = float(row["arrival_s"])
            n_in, n_out = int(row["input_len"]), int(row["output_len"])
        except KeyError as exc:
            raise UserError(head, f"{tail + ': ' if tail else ''}request {i} has no {exc.args[0]}") from None
        except (TypeError, ValueError):
            raise UserError(head, f"{tail + ': ' if tail else ''}request {i}: arrival_s must be a number and "
                                  f"input_len, output_len integers") from None
        if not (math.isfinite(a) and a >= 0 and n_in >= 1 and n_out >= 1):
            raise UserError(head, f"{tail + ': ' if tail else ''}request {i}: arrival_s must be >= 0 and "
                                  f"input_len, output_len >= 1")
        arrival.append(a)
        inp.append(n_in)
        out.append(n_out)
    order = np.argsort(np.asarray(arrival), kind="stable")
    hashed = tuple(ids[k] for k in order) if any(ids) else None
    return Requests(np.asarray(arrival, dtype=np.float64)[order], np.asarray(inp, dtype=np.int64)[order],
                    np.asarray(out, dtype=np.int64)[order], hashed)
