"""``stage-cosim explore SPEC.yaml``: hardware design-space exploration."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click
from tqdm import tqdm

from stage_cosim.cli.optimize_cmd import describe_point
from stage_cosim.files import FIGURE_SUFFIXES, check_output, reported_write, save_figure


def significant(v: float, digits: int = 3) -> str:
    """``v`` to ``digits`` significant digits, in plain notation where it reads: 2140.16 -> 2140,
    315 -> 315, 0.123456 -> 0.123 (the model's inputs are not known to six digits)."""
    if not v or not math.isfinite(v):
        return f"{v:g}"
    r = round(v, digits - 1 - math.floor(math.log10(abs(v))))
    return f"{r:.0f}" if abs(r) >= 10 ** (digits - 1) else f"{r:.{digits}g}"


def _fmt_values(values: dict) -> str:
    # (a choice variable's value, a topology's name or a switch, prints as it is)
    return ", ".join(f"{k}={significant(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v}"
                     for k, v in values.items())


# How each objective's value reads (lower is better for all of them)
METRIC_LABELS = {"step_time_s": "step time (s)", "gpu_seconds_per_token": "GPU-seconds per decoded token",
                 "gpu_seconds_per_request": "GPU-seconds per request meeting the SLOs"}
UNITS = {"step_time_s": "s/step", "gpu_seconds_per_token": "GPU-s/token", "gpu_seconds_per_request": "GPU-s/request"}


def _layout(best: dict | None) -> str:
    """The best configuration of a candidate: a parallelization, or a serving layout."""
    if not best:
        return "-"
    if "layout" in best:
        from stage_cosim.cli.optimize_serve import _describe

        return _describe(best["point"])
    return describe_point(best["point"], best["config"]["parallel"])


def plot_frontier(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = doc.get("metric", "step_time_s")
    fig, ax = plt.subplots(figsize=(8, 5))
    pts = [c for c in doc["all"] if c[m] is not None]
    ax.scatter([c["cost_per_gpu"] for c in pts], [c[m] for c in pts], s=10, c="lightgray",
               label="candidates")
    front = doc.get("frontier") or doc.get("best") or []
    ax.plot([c["cost_per_gpu"] for c in front], [c[m] for c in front], "o-", color="tab:blue",
            label="best per cost (confirmed)")
    b = doc["baseline"]
    ax.scatter([b["cost_per_gpu"]], [b[m]], marker="*", s=200, color="tab:red", zorder=5,
               label="baseline")
    ax.set_xlabel("cost per GPU ($)")
    label = METRIC_LABELS.get(m, m)
    ax.set_ylabel(label)
    name = (((b.get("best") or {}).get("config") or {}).get("model") or {}).get("name")
    ax.set_title(f"{name + ': ' + label if name else label[0].upper() + label[1:]} against hardware cost")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


@click.command()
@click.argument("spec", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="Frontier plot (PNG).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def explore(spec: Path, as_json: bool, plot: Path | None, quiet: bool) -> None:
    """Search GPU and network parameters (bounds and costs from SPEC) for the best step time per cost."""
    from stage_cosim.search.explore import explore as run, planned_evaluations
    from stage_cosim.search.explore_spec import load_spec

    check_output(plot, "plot", FIGURE_SUFFIXES)         # before the exploration, not after it
    s = load_spec(spec)
    show = not quiet and sys.stderr.isatty()
    with tqdm(total=planned_evaluations(s), disable=not show, unit="candidate", desc="explore",
              dynamic_ncols=True) as bar:
        def progress(p: dict) -> None:
            bar.update(p["done"] - bar.n)

        doc = run(s, progress=progress)
    if as_json:
        click.echo(json.dumps(doc, indent=1))
    else:
        print_report(doc, s)
    if plot is not None:
        with reported_write("plot", plot):          # the result is out: a failed write loses nothing
            plot_frontier(doc, plot)
    if doc["interrupted"]:
        raise click.exceptions.Exit(130)            # the best so far is printed; the search did not end


def print_report(doc: dict, s) -> None:  # noqa: ANN001 (ExploreSpec)
    """The text report of an exploration (also printed by 'stage-cosim remote explore')."""
    b = doc["baseline"]
    m = doc.get("metric", "step_time_s")
    unit = UNITS.get(m, m)
    click.echo(f"baseline  {_fmt_values(b['values'])}: ${b['cost_per_gpu']:,.0f}/GPU, {b[m]:.4g} {unit} "
               f"({_layout(b['best'])})")
    what = "configuration" if m == "step_time_s" else "layout"
    if b.get("proven_optimal"):
        click.echo(f"          the baseline's proven optimum (every feasible {what} simulated, or bounded above it)")
    elif b.get("unexplored") is not None:
        click.echo(f"          not proven optimal: the best the inner searches found, {b['unexplored']:,} structurally "
                   f"feasible {what}s not simulated (a larger baseline_budget explores more)")
    rows = doc.get("frontier") or doc.get("best") or []
    label = METRIC_LABELS.get(m, m)
    title = f"Pareto frontier (cost against {label})" if s.mode == "pareto" else f"best within ${s.budget:,.0f}/GPU"
    click.echo(f"\n{title}:")
    click.echo(f"{'$/GPU':>10} {unit:>12} {'vs base':>8}  hardware  |  best configuration")
    for c in rows:
        click.echo(f"{c['cost_per_gpu']:>10,.0f} {c[m]:>12.4g} {c[m] / b[m] - 1:>+7.1%}  "
                   f"{_fmt_values(c['values'])}  |  {_layout(c['best'])}")
    unproven = [c for c in rows if not c.get("proven_optimal")]
    if unproven:
        click.echo(f"({len(unproven)} of {len(rows)} rows: the best {'configuration' if m == 'step_time_s' else 'layout'} "
                   "a local search from the winners found on that hardware, not proven optimal)")
    if doc["sensitivity"]:
        click.echo(f"\nsensitivity around the baseline (elasticity: % of {label} per % of the resource):")
        for d in doc["sensitivity"]:
            el = "n/a" if d["elasticity"] is None else f"{d['elasticity']:+.3f}"
            if d["elasticity"] is None and d.get("step_time_s") and isinstance(d.get("baseline"), (str, bool)):
                # a choice: the objective on each alternative instead of an elasticity
                alts = ", ".join(f"{k} {'—' if t is None else f'{t:.4g}'}" for k, t in d["step_time_s"].items())
                el = f"a choice ({d['baseline']}); the others: {alts}"
            click.echo(f"  {d['variable']:<28} {el}")
        top = doc["sensitivity"][0]
        if top["elasticity"]:
            click.echo(f"bottleneck: {top['variable']}")
    click.echo(f"\n{doc['candidates_evaluated']} hardware candidates evaluated"
               + (" (interrupted: best so far)" if doc["interrupted"] else ""))
