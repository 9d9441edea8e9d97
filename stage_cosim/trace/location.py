"""Where a trace set is on disk, and reading it from there.

:func:`locate` accepts an ASTRA-sim run directory as the exporter writes it (``traces/`` with
``comm_groups.json`` beside it), a plain trace directory (the group file inside it, or in the
folder above), and an explicit group file. :func:`read` reads what it found (Chakra files
through :mod:`stage_cosim.trace.et_reader`, our JSON traces through
:func:`~stage_cosim.trace.traceset.from_nodes`); :func:`read_prefix` reads the simulator's own
``--workload-configuration``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from stage_cosim.errors import UserError
from stage_cosim.trace.chakra import TRACE_NAME, TraceFormatError, TraceNode, kind_of, read_comm_groups
from stage_cosim.trace.et_reader import read_files
from stage_cosim.trace.traceset import TraceSet, from_nodes

GROUPS_FILE = "comm_groups.json"
JSON_NAME = re.compile(r"^(?P<prefix>.+)\.(?P<rank>\d+)\.json$")
_TYPE_CODES = {"INVALID_NODE": 0, "METADATA_NODE": 1, "MEM_LOAD_NODE": 2, "MEM_STORE_NODE": 3,
               "COMP_NODE": 4, "COMM_SEND_NODE": 5, "COMM_RECV_NODE": 6, "COMM_COLL_NODE": 7}


def _read_json_rank(path: Path) -> list[TraceNode]:
    doc = json.loads(path.read_text())
    nodes = []
    for d in doc["nodes"]:
        attrs = dict(d.get("attrs", {}))
        kinds = {k: kind_of(v) for k, v in attrs.items()}
        nodes.append(TraceNode(d["id"], d.get("name", ""), _TYPE_CODES.get(d["type"], 0),
                               list(d.get("data_deps", [])), list(d.get("ctrl_deps", [])),
                               d.get("duration_micros", 0), attrs, kinds))
    return nodes


# -- where the traces are -----------------------------------------------------------------------

@dataclass(frozen=True)
class Located:
    """A trace set on disk: its files (Chakra ``.et`` or our ``.json``), its group file, and the
    ASTRA-sim run directory around it when there is one (system.json, network.yml)."""

    trace_dir: Path
    files: dict[int, Path]
    fmt: str
    groups_file: Path | None
    run_dir: Path | None


def _trace_files(directory: Path) -> tuple[dict[int, Path], str] | None:
    found: dict[tuple[str, str], dict[int, Path]] = {}
    for p in directory.iterdir():
        m = TRACE_NAME.match(p.name)
        if m:
            found.setdefault(("et", m["prefix"]), {})[int(m["rank"])] = p
            continue
        m = JSON_NAME.match(p.name)
        if m:
            found.setdefault(("json", m["prefix"]), {})[int(m["rank"])] = p
    et = {k: v for k, v in found.items() if k[0] == "et"}
    pick = et or found
    if not pick:
        return None
    if len(pick) > 1:
        raise TraceFormatError(f"{directory}: several trace prefixes ({', '.join(sorted(p for _, p in pick))})")
    (fmt, _), files = next(iter(pick.items()))
    return files, fmt


def locate(path: Path, comm_groups: Path | None = None) -> Located:
    """Find the traces at ``path``: a trace directory, or a run directory holding ``traces/``.

    The group file is ``comm_groups`` if given, else ``comm_groups.json`` beside the traces, else
    the one in the folder above them (where the exporter puts it); none means every collective
    runs over all ranks."""
    path = Path(path)
    if not path.is_dir():
        raise TraceFormatError(f"{path}: not a directory")
    trace_dir = path
    found = _trace_files(path)
    if found is None and (path / "traces").is_dir():
        trace_dir = path / "traces"
        found = _trace_files(trace_dir)
    if found is None:
        raise TraceFormatError(f"{path}: no <prefix>.<rank>.et (or .json) files, here or in {path / 'traces'}")
    files, fmt = found
    if comm_groups is not None:
        if not Path(comm_groups).is_file():
            raise UserError("comm-groups", f"{comm_groups}: no such file")
        groups_file: Path | None = Path(comm_groups)
    else:
        groups_file = next((p for p in (trace_dir / GROUPS_FILE, trace_dir.parent / GROUPS_FILE) if p.is_file()), None)
    run_dir = next((d for d in (path, trace_dir.parent) if (d / "system.json").is_file()), None)
    return Located(trace_dir, files, fmt, groups_file, run_dir)


def manifest_ranks(located: Located) -> tuple[int, Path] | None:
    """The world size a trace set's manifest gives (an export's ``ranks``, a synth's rank count),
    and the manifest: beside the traces, else in their run directory."""
    for d in dict.fromkeys((located.trace_dir, located.run_dir or located.trace_dir.parent)):
        path = d / "manifest.json"
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(doc, dict):
            continue
        counts, par = doc.get("counts"), doc.get("parallel")
        n = doc.get("ranks") or (counts.get("ranks") if isinstance(counts, dict) else None) \
            or (par.get("world_size") if isinstance(par, dict) else None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n, path
    return None


def missing_files(located: Located, world: int) -> list[Path]:
    """The trace files of ranks 0..world-1 that are not there, named as the present ones are."""
    some = next(iter(located.files.values()))
    m = (TRACE_NAME if located.fmt == "et" else JSON_NAME).match(some.name)
    ext = "et" if located.fmt == "et" else "json"
    return [located.trace_dir / f"{m['prefix']}.{r}.{ext}" for r in range(world) if r not in located.files]


def _groups(path: Path | None, parameter: str) -> dict[str, list[int]] | None:
    """The communicator groups of ``path``; an unreadable file is an error naming the flag that
    gave it (or would have: ``--comm-groups``, the binary's ``--comm-group-configuration``)."""
    if path is None:
        return None
    try:
        return read_comm_groups(path)
    except TraceFormatError as exc:
        raise UserError(parameter, str(exc)) from None


def read(located: Located) -> TraceSet:
    groups = _groups(located.groups_file, "comm-groups")
    if located.fmt == "et":
        return read_files(located.files, groups, str(located.trace_dir))
    try:
        ranks = {r: _read_json_rank(p) for r, p in sorted(located.files.items())}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise TraceFormatError(f"{located.trace_dir}: unreadable JSON trace ({exc})") from None
    return from_nodes(ranks, groups, str(located.trace_dir))


def read_prefix(prefix: str, ranks: Iterable[int], groups_file: Path | None) -> TraceSet:
    """ASTRA-sim's ``--workload-configuration=PREFIX``: ``PREFIX.<rank>.et`` for every rank of the
    network (the simulator aborts on a missing one and never opens extra ones)."""
    files = {}
    for r in ranks:
        p = Path(f"{prefix}.{r}.et")
        if not p.is_file():
            raise UserError("workload-configuration", f"{p}: no such file (ASTRA-sim needs one trace per rank "
                                                      "of the network and aborts without it)")
        files[r] = p
    groups = _groups(groups_file, "comm-group-configuration")
    try:
        return read_files(files, groups, prefix)
    except TraceFormatError as exc:
        raise UserError("workload-configuration", str(exc)) from None
