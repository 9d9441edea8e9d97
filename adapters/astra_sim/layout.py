"""The layout of an exported ASTRA-sim run directory and the command line that runs it.

Kept apart from the exporter so that reading a run directory or running the binary does not
import the synthesis stack.
"""

from __future__ import annotations

from stage_cosim.trace.traceset import GROUPS_FILE

COMPUTE_MODES = ("replay", "roofline")
TRACE_DIR = "traces"
TRACE_PREFIX = "workload"
BINARY_ENV = "ASTRA_SIM_BIN"
DEFAULT_BINARY = "AstraSim_Analytical_Congestion_Unaware"


RUN_SH = """#!/bin/sh
# Run this ASTRA-sim workload: ./run.sh [/path/to/{default}] (or set {env}).
# Written by stage-cosim; every path is relative to this directory, so it can be copied anywhere.
set -e
cd "$(dirname "$0")"
BIN="${{1:-${{{env}:-{default}}}}}"
mkdir -p log
exec "$BIN" \\
  --workload-configuration={traces}/{prefix} \\
  --system-configuration=system.json \\
  --network-configuration=network.yml \\
  --remote-memory-configuration=memory.json \\
  --comm-group-configuration={groups} \\
  --logging-folder=log
"""


def command(binary: str) -> list[str]:
    """The simulator command line for a run directory (run from inside it)."""
    return [binary, f"--workload-configuration={TRACE_DIR}/{TRACE_PREFIX}", "--system-configuration=system.json",
            "--network-configuration=network.yml", "--remote-memory-configuration=memory.json",
            f"--comm-group-configuration={GROUPS_FILE}", "--logging-folder=log"]
