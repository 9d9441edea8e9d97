"""Whether a serving probe sustained the rate it was offered, beyond meeting the SLOs.

A probe of the serving search (:func:`stage_cosim.search.serving.goodput`) offers a unit
``num_requests`` Poisson arrivals at a rate. Meeting the SLOs is not enough to call that rate
sustained. With few requests at a high rate, every request arrives before the first one
finishes: the batch takes them all at once, no queue builds, every request meets the SLOs, and
the "sustained" rate would be whatever was offered (thousands of requests per second per GPU
from probes of 20 requests). Such a run measured how the unit absorbs one burst, not a rate. A
probe that meets the SLOs holds only if it also passes two checks:

* **It reaches a steady state.** By Little's law a unit serving a rate λ whose requests spend
  W seconds in it holds λW of them on average. A run of N requests fills the unit over its
  first λW arrivals (they meet a unit still below that load) and drains it over its last λW
  (arrivals have stopped); only between the two does it serve the rate's steady load. So the
  run must leave a middle between them: λW at most :data:`STEADY_SHARE` of N, with λ the
  arrivals the run drew (requests over their span) and W the mean arrival-to-last-token time
  it measured. Otherwise the SLOs met are those of a unit never fully loaded, and a longer
  probe (``--num-requests``) is needed to judge that rate. It also bounds the rate by what the
  unit achieved: the arrivals span at least twice the mean time in the system, so completed
  requests over the makespan (the span plus the last requests' time in the system) reach at
  least half the offered rate wherever no request takes more than twice the mean.
* **Its completions keep up with its arrivals.** Completions per second between the 20th and
  80th percentile of completion times (the report's steady rate: past the fill, before the
  drain) must be at least :data:`KEEP_UP` of arrivals per second between the same percentiles
  of arrival times. In steady state the middle completions are the middle arrivals shifted by
  their time in the system, at the rate they arrived; past the unit's capacity they come at the
  capacity, below the offered rate, however loose the SLOs that would otherwise hide a queue
  growing through the run. Measured over the middle, not as completed requests over the whole
  makespan: that ratio falls short of the offered rate even far below capacity (a default
  probe of Llama-3 70B at its goodput completes its 500 requests at 0.73 of it, the last
  requests' time in the system added to the arrivals' span), so it cannot tell a short run
  from an overloaded one. The arrivals compared are those the run drew, not the nominal rate,
  which keeps a Poisson sample's unevenness out of the ratio.

Both only get harder to pass as the offered rate rises (λW grows with λ and with the load; the
arrivals' middle span shrinks and the completions' does not shrink faster), so the rate search
keeps its bracket: every rate above a probe that fails one is taken to fail too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# the report's own steady-rate window, so that arrivals and completions are measured alike
from stage_cosim.serving.metrics import steady_rate

# The most requests a probe's unit may hold on average (rate × mean time in the system), as a
# share of the probe's requests: under a half, filling and draining leave a middle at the
# rate's steady load. Llama-3 70B's default probe (500 requests) at its goodput holds 0.26 of
# them; 20 requests offered at its capacity would have held twice their number.
STEADY_SHARE = 0.5

# The share of the middle arrivals' rate the middle completions must reach: the completions of
# a run in steady state are its arrivals shifted by times in the system that vary from request
# to request, which moves the ratio by a few per cent (Llama-3 70B at its default goodput
# probe: 1.00; 3 % above it, where the SLOs already fail: 0.97; 22 % above it: 0.82).
KEEP_UP = 0.9

# ``limited_by`` of a layout: what failed at the lowest rate its search found failing.
SLO_LIMIT = "slo"
STEADY = "requests"          # met the SLOs without reaching a steady state: too few requests
THROUGHPUT = "throughput"    # met the SLOs while completions fell behind arrivals: past capacity


def arrival_rate(arrival_s: np.ndarray) -> float:
    """Arrivals per second between the 20th and 80th percentile of arrival times (the window of
    the report's steady completion rate); infinite for arrivals at one instant."""
    rate = steady_rate(np.asarray(arrival_s, dtype=np.float64))
    return rate if rate > 0 else float("inf")


def shortfall(arrival_s: np.ndarray, report: dict[str, Any]) -> str | None:
    """Why a run that met the SLOs did not show its rate sustained (:data:`STEADY` or
    :data:`THROUGHPUT`), or None where it did (see the module's docstring)."""
    arrival = np.asarray(arrival_s, dtype=np.float64)
    n = len(arrival)
    span = float(arrival[-1] - arrival[0]) if n > 1 else 0.0
    rate = (n - 1) / span if span > 0 else float("inf")
    in_system = report["latency_s"]["e2e"]["mean"]
    if in_system is None or rate * in_system > STEADY_SHARE * n:
        return STEADY
    if report["throughput"]["steady_requests_per_s"] < KEEP_UP * arrival_rate(arrival):
        return THROUGHPUT
    return None
