"""The layout of an exported ASTRA-sim run directory and the command line that runs it.

Kept apart from the exporter so that reading a run directory or running the binary does not
import the synthesis stack.
"""

from __future__ import annotations

from stage_cosim.trace.location import GROUPS_FILE

COMPUTE_MODES = ("replay", "roofline")
TRACE_DIR = "traces"
TRACE_PREFIX = "workload"
BINARY_ENV = "ASTRA_SIM_BIN"
DEFAULT_BINARY = "AstraSim_Analytical_Congestion_Unaware"


# The binary frees one object twice when it exits after some workloads (a rank running one
# collective on two communicator groups under a one-entry implementation list: see
# ``exit_warnings`` in adapters/astra_sim/analytical.py), and then may die of the heap corruption after
# printing every result, or before its log has printed them all. run.sh keeps the output (streamed,
# and in log/output.txt) and, when every rank printed its "finished" line before the process died
# of a signal, says so and exits 0; when some did not and it died of an abort, a segfault or a
# bus error, says the result is incomplete (run it again: a crash of the simulation itself dies
# so every time).
RUN_SH = """#!/bin/sh
# Run this ASTRA-sim workload: ./run.sh [/path/to/{default}] (or set {env}).
# Written by stage-cosim; every path is relative to this directory, so it can be copied anywhere.
set -e
cd "$(dirname "$0")"
BIN="${{1:-${{{env}:-{default}}}}}"
mkdir -p log
rm -f log/status
{{ "$BIN" \\
  --workload-configuration={traces}/{prefix} \\
  --system-configuration=system.json \\
  --network-configuration=network.yml \\
  --remote-memory-configuration=memory.json \\
  --comm-group-configuration={groups} \\
  --logging-folder=log 2>&1 && echo 0 > log/status || echo $? > log/status; }} | tee log/output.txt
status=$(cat log/status)
finished=$(grep -c '] finished, ' log/output.txt || true)
if [ "$status" -gt 128 ] && [ "$finished" -eq {ranks} ]; then
  echo "run.sh: all {ranks} ranks finished; the simulator then died of signal $((status - 128)) on exit" \\
       "(its double free of a collective implementation: see stage-cosim's docs/guide/astra-sim.md)." \\
       "Results above are complete." >&2
  exit 0
fi
if [ "$status" -eq 134 ] || [ "$status" -eq 135 ] || [ "$status" -eq 139 ]; then
  echo "run.sh: only $finished of {ranks} ranks printed a result before the simulator died of signal" \\
       "$((status - 128)) (its double free on exit can drop results still queued in its log): the result is" \\
       "incomplete; run it again (dying so every time is a crash of the simulation itself)" >&2
fi
exit "$status"
"""


def command(binary: str) -> list[str]:
    """The simulator command line for a run directory (run from inside it)."""
    return [binary, f"--workload-configuration={TRACE_DIR}/{TRACE_PREFIX}", "--system-configuration=system.json",
            "--network-configuration=network.yml", "--remote-memory-configuration=memory.json",
            f"--comm-group-configuration={GROUPS_FILE}", "--logging-folder=log"]
