"""``stage-cosim compare``: two or more configurations side by side.

The command's flags (those of ``simulate``: model, parallel configuration, cluster) are what the
runs share; each ``--run`` changes some of them, as ``key=value`` items named like the flags
("tp=4 pp=4 vp=2 sp recompute=full") or as a run file (a YAML mapping of the same names). Each
run is simulated as ``simulate`` simulates it; the table shows step time, throughput, MFU, the
peak stage's memory by category and the step's time by category, and each run's difference
from the first.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import click

from stage_cosim.cli.options import (
    cluster_option, inference_options, model_options, network_model_option, parallel_options,
    resolve_inference_options, resolve_model_options, resolve_parallel_options, warn_positions,
)
from stage_cosim.errors import UserError

GiB = 1 << 30
# The parameters of the command that are not settings a run can change.
NOT_SETTINGS = ("runs", "as_json")
# The figures of a run (SimResult.to_dict() keys) in the table's order: (key, label, scale, format).
FIGURES = (("step_time_s", "step time s", 1.0, ".4f"), ("tokens_per_s", "tokens/s", 1.0, ",.0f"),
           ("tokens_per_s_per_gpu", "tokens/s per GPU", 1.0, ",.1f"), ("mfu", "MFU %", 100.0, ".2f"),
           ("hfu", "HFU %", 100.0, ".2f"), ("peak_memory_bytes", "peak memory GiB", 1 / GiB, ".2f"))


def _settings(ctx: click.Context, run: str, index: int) -> dict[str, Any]:
    """A run's settings by parameter name, from its items or its run file, converted as click
    converts the flags."""
    from stage_cosim.cli.run_file import flag_names

    names = {k: v for k, v in flag_names(ctx.command).items() if v[0].name not in NOT_SETTINGS}
    where = f"run {index}"
    if run.strip().endswith((".yaml", ".yml")) and " " not in run.strip():
        from stage_cosim.files import read_yaml

        doc = read_yaml(Path(run.strip()), "run")
        if not isinstance(doc, dict):
            raise UserError("run", f"{run}: must be a mapping of flag names to values")
        items = [(str(k), v) for k, v in doc.items()]
    else:
        try:
            tokens = shlex.split(run)
        except ValueError as exc:
            raise UserError("run", f"{where}: {exc}") from None
        if not tokens:
            raise UserError("run", f"{where}: is empty (give key=value items, e.g. \"tp=4 pp=2\")")
        items = [(t.split("=", 1)[0], t.split("=", 1)[1]) if "=" in t else (t, True) for t in tokens]
    out: dict[str, Any] = {}
    for key, value in items:
        if key not in names:
            raise UserError("run", f"{where}: {key!r} is not a flag of '{ctx.command_path}'")
        param, negates = names[key]
        if param.name in out:
            raise UserError("run", f"{where}: {key!r} is given twice")
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        try:
            converted = param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise UserError("run", f"{where}: {key}: {exc.message.rstrip('.')}") from None
        out[param.name] = (not converted) if negates else converted
    return out


def _prepare(kw: dict[str, Any], cluster: str):  # noqa: ANN202
    """One run's workload and machine, resolved from its flags as ``simulate`` resolves them."""
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.workload import synthesize

    model = resolve_model_options(kw)
    inference = resolve_inference_options(kw)
    parallel = resolve_parallel_options(kw, cluster)
    machine = resolve_cluster(cluster, parallel.world_size)
    workload = synthesize(model, parallel, machine.gpu, inference=inference)
    return workload, machine, (model, parallel, inference)


def _peak_role(doc: dict[str, Any]) -> dict[str, Any]:
    return max(doc["roles"], key=lambda r: (r["peak_memory_bytes"], -r["stage"]))


def table(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The compared figures, each a list with a value per run, and each run's difference from
    the first: {"figures": {...}, "memory": {category: [...]}, "breakdown": {category: [...]}}."""
    from stage_cosim.cli.simulate_cmd import memory_categories
    from stage_cosim.result import BREAKDOWN_KEYS, RoleResult

    peaks = [_peak_role(d) for d in docs]
    categories = memory_categories([RoleResult(**p) for p in peaks])
    keys = [k for k in BREAKDOWN_KEYS if any(d["breakdown"].get(k) for d in docs)]
    values = {"figures": {k: [d[k] for d in docs] for k, *_ in FIGURES},
              "memory": {c: [p["memory"].get(c, 0) for p in peaks] for c in categories},
              "breakdown": {k: [d["breakdown"].get(k, 0.0) for d in docs] for k in keys}}
    difference = {part: {k: [v - vs[0] for v in vs] for k, vs in rows.items()} for part, rows in values.items()}
    return {**values, "difference": difference}


def _label(doc: dict[str, Any]) -> str:
    from stage_cosim.cli.optimize_cmd import describe_point

    par = doc["config"]["parallel"]
    return describe_point({}, par)


def print_table(runs: list[str], docs: list[dict[str, Any]], t: dict[str, Any]) -> None:
    n = len(docs)
    for i, (run, doc) in enumerate(zip(runs, docs), 1):
        click.echo(f"#{i}  {_label(doc)}   ({run})")
    width = max(12, *(len(f"#{i}-#1") for i in range(2, n + 1)))
    heads = [f"#{i}" for i in range(1, n + 1)] + [f"#{i}-#1" for i in range(2, n + 1)]
    click.echo("")
    click.echo(f"{'':<26}" + "".join(f"{h:>{width}}" for h in heads))

    def row(label: str, values: list[float], diffs: list[float], fmt: str, scale: float) -> None:
        shown = [f"{v * scale:{fmt}}" for v in values] + [f"{d * scale:+{fmt}}" for d in diffs[1:]]
        click.echo(f"{label:<26}" + "".join(f"{s:>{width}}" for s in shown))

    for key, label, scale, fmt in FIGURES:
        row(label, t["figures"][key], t["difference"]["figures"][key], fmt, scale)
    click.echo("memory, peak stage, GiB")
    for c, vs in t["memory"].items():
        row(f"  {c.replace('_', ' ')}", vs, t["difference"]["memory"][c], ".2f", 1 / GiB)
    click.echo("time, critical stage, s")
    for k, vs in t["breakdown"].items():
        row(f"  {k.replace('_', ' ')}", vs, t["difference"]["breakdown"][k], ".4f", 1.0)


@click.command()
@model_options
@parallel_options
@inference_options
@cluster_option
@network_model_option
@click.option("--run", "runs", multiple=True, metavar="'KEY=VALUE ...'|RUN.yaml",
              help="A configuration to compare (give two or more): the flags above changed by key=value items "
                   "named like the flags ('tp=4 pp=4 vp=2 sp'), or by a YAML run file of them.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def compare(cluster: str, network_model: str, runs: tuple[str, ...], as_json: bool, **kw) -> None:
    """Put two or more configurations side by side: step time, throughput, MFU, memory by
    category, time by category, and each one's difference from the first."""
    from stage_cosim.adapters.simulate import simulate as run

    if len(runs) < 2:
        raise UserError("run", f"give two or more configurations to compare (--run), got {len(runs)}")
    ctx = click.get_current_context()
    shared = {**kw, "cluster": cluster, "network_model": network_model}
    # every run checked (and synthesized) before any is simulated: one bad run costs nothing
    prepared = []
    for i, text in enumerate(runs, 1):
        settings = {**shared, **_settings(ctx, text, i)}
        c, net = settings.pop("cluster"), settings.pop("network_model")
        try:
            prepared.append((*_prepare(settings, c), net))
        except UserError as exc:
            raise UserError(exc.parameter, f"run {i}: {exc.rule}") from None
    docs = []
    for workload, machine, (model, parallel, inference), net in prepared:
        result, _, _ = run(workload, machine, net)
        warn_positions(model, parallel, inference)
        docs.append(result.to_dict())
    t = table(docs)
    if as_json:
        click.echo(json.dumps({"runs": [{"run": r, "result": d} for r, d in zip(runs, docs)], **t}, indent=1))
    else:
        print_table(list(runs), docs, t)
