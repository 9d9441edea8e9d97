"""Run a user's ASTRA-sim binary on a run directory and turn every way it can fail into one line.

Failures the simulator does not report clearly, all detected here: the binary is missing or not
executable; it exits non-zero or dies on a signal (a floating-point exception from a bad system
file, an assertion); it exits 0 but printed fewer ``finished`` lines than ranks or a
``critical`` line (a deadlock); it runs past the time limit. A signal after every rank printed
its result is not a failure: the binary's double free on exit, which leaves the results whole.
The same double free can kill it before its asynchronous log has printed every result: a run
killed with some ``finished`` lines missing (and no assertion or critical line) is run again, at
most :data:`RERUNS` times, and otherwise reported in one line; a partial result is never read.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from stage_cosim.adapters.astra_sim.layout import BINARY_ENV, DEFAULT_BINARY, command
from stage_cosim.adapters.astra_sim.parse import AstraOutput, parse_output

EXCERPT_LINES = 12
RERUNS = 2          # runs repeated when the results were lost on exit (about 3 runs in 100 lose some)


class AstraSimError(Exception):
    """The simulator did not produce a result: ``summary`` (one line) and a log excerpt."""

    def __init__(self, kind: str, summary: str, excerpt: str = "") -> None:
        super().__init__(summary)
        self.kind = kind
        self.summary = summary
        self.excerpt = excerpt

    def __str__(self) -> str:
        return self.summary + (f"\n--- simulator output (last lines) ---\n{self.excerpt}" if self.excerpt else "")


@dataclass
class AstraRun:
    output: AstraOutput
    returncode: int
    log: str
    warning: str | None = None      # it printed every result, then died on exit


def find_binary(explicit: str | None) -> str:
    """The binary from --astra-sim, else $ASTRA_SIM_BIN, else the default name on PATH."""
    candidate = explicit or os.environ.get(BINARY_ENV) or DEFAULT_BINARY
    path = shutil.which(candidate) if os.sep not in candidate else candidate
    if path is None or not os.path.exists(path):
        raise AstraSimError("missing", f"ASTRA-sim binary not found: {candidate!r} (give --astra-sim PATH or "
                                       f"set {BINARY_ENV})")
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise AstraSimError("not-executable", f"ASTRA-sim binary is not an executable file: {path}")
    return os.path.abspath(path)


def _excerpt(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[-EXCERPT_LINES:])


def _lost_on_exit(text: str, out: AstraOutput) -> bool:
    """Killed (abort, segfault, bus error) with results missing and no sign of a failure of the
    simulation itself (an assertion, a critical line): results still queued in the log may have
    been lost when it died of its double free. That was seen with some ranks' lines printed and
    with none (5 in 300 runs of a tied-embedding pp3 dp2 export, glibc's message printed or not)."""
    return not out.critical and "Assertion" not in text


def run(binary: str, run_dir: Path, ranks: int, timeout_s: float = 3600.0, reruns: int = RERUNS) -> AstraRun:
    """Run the simulator in ``run_dir``; raises :class:`AstraSimError` unless every rank finished.
    A run whose results may have been lost on exit is run again (at most ``reruns`` times); one
    that dies so on every run without printing any rank's result is a crash of the simulation."""
    binary = find_binary(binary)
    lost: list[int] = []            # finished lines printed by each run that lost results on exit
    while True:
        try:
            done = _run_once(binary, run_dir, ranks, timeout_s)
        except _LostOnExit as exc:
            lost.append(exc.printed)
            if len(lost) <= reruns:
                continue
            if not any(lost):
                raise exc.crash from None       # the same death before any result, every time
            raise AstraSimError("incomplete", f"ASTRA-sim was killed by {exc.signal} before its log printed every "
                                              f"rank's result, on each of {len(lost)} runs (at most {max(lost)} of "
                                              f"{ranks} ranks printed; its double free on exit can drop results still "
                                              f"queued in its log): no partial result is used") from None
        if lost:
            done.warning = ((done.warning + "; ") if done.warning else "") + (
                f"{len(lost)} earlier run{'s' if len(lost) > 1 else ''} lost results on exit (killed before "
                f"its log printed every rank's result) and {'were' if len(lost) > 1 else 'was'} run again")
        return done


class _LostOnExit(Exception):
    """A run killed with results missing; ``crash``: the error it is if no rerun does better."""

    def __init__(self, signal_name: str, printed: int, crash: AstraSimError) -> None:
        super().__init__(signal_name)
        self.signal, self.printed, self.crash = signal_name, printed, crash


def _run_once(binary: str, run_dir: Path, ranks: int, timeout_s: float) -> AstraRun:
    try:
        proc = subprocess.Popen(command(binary), cwd=run_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    except OSError as exc:
        raise AstraSimError("not-executable", f"cannot start ASTRA-sim ({binary}): {exc.strerror or exc}") from None
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        raise AstraSimError("timeout", f"ASTRA-sim ran past the time limit of {timeout_s:g} s and was stopped",
                            _excerpt(text or "")) from None
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)   # cancelled: do not leave the simulator running
        proc.wait()
        raise
    text = text or ""
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        out = parse_output(text)
        if not out.missing(ranks) and not out.critical:
            # Every rank's result was printed before the process died: the binary's double free
            # on exit (see ``exit_warnings`` in adapters/astra_sim/analytical.py) corrupts the heap
            # after the simulation is over, so the results stand.
            return AstraRun(out, proc.returncode, text,
                            f"every rank finished, then ASTRA-sim was killed by {sig} on exit (its double free "
                            f"of a collective implementation); the results are complete")
        hint = " (a floating-point exception: often a system file with a 0 or a missing value)" \
            if proc.returncode == -signal.SIGFPE else ""
        crash = AstraSimError("signal", f"ASTRA-sim was killed by {sig}{hint}", _excerpt(text))
        if proc.returncode in (-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS) and _lost_on_exit(text, out):
            raise _LostOnExit(sig, len(out.finished_ns), crash)
        raise crash
    if proc.returncode != 0:
        raise AstraSimError("exit", f"ASTRA-sim exited with status {proc.returncode}", _excerpt(text))
    out = parse_output(text)
    missing = out.missing(ranks)
    if missing or out.critical:
        what = f"{len(missing)} of {ranks} ranks never finished (e.g. {missing[:5]})" if missing else \
            "it reported a critical error"
        raise AstraSimError("deadlock", f"ASTRA-sim exited 0 but {what}: a deadlock (mismatched collectives "
                                        f"or a stalled node)", _excerpt(text))
    return AstraRun(out, proc.returncode, text)
