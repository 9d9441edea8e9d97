"""``stage-cosim optimize --phase serve``: the serving layout with the most goodput per GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import click

from stage_cosim.files import FIGURE_SUFFIXES, check_output
from stage_cosim.inference.config import KV_CACHE_DTYPES, WEIGHT_DTYPES
from stage_cosim.serving.requests import LENGTH_DISTRIBUTIONS

# The options only a serving search takes (None: not given).
SERVE_FLAGS = ("slo_ttft", "slo_tpot", "attainment", "input_len", "output_len", "lengths", "length_spread",
               "num_requests", "chunk_tokens", "kv_cache_dtype", "weight_dtype", "hbm_utilization", "step_overhead")


def serve_options(f: Callable) -> Callable:
    opts = [
        click.option("--slo-ttft", "slo_ttft", type=float, default=None, help="Serving: time-to-first-token target, s."),
        click.option("--slo-tpot", "slo_tpot", type=float, default=None, help="Serving: time-per-output-token target, s."),
        click.option("--attainment", type=float, default=None,
                     help="Serving: share of requests that must meet the SLOs (default 0.9)."),
        click.option("--input-len", "input_len", type=int, default=None, help="Serving: mean prompt tokens (default 1024)."),
        click.option("--output-len", "output_len", type=int, default=None, help="Serving: mean output tokens (default 256)."),
        click.option("--lengths", type=click.Choice(LENGTH_DISTRIBUTIONS), default=None,
                     help="Serving: length distribution (default lognormal)."),
        click.option("--length-spread", "length_spread", type=float, default=None, help="Serving: log-normal sigma (0.6)."),
        click.option("--num-requests", "num_requests", type=int, default=None,
                     help="Serving: requests simulated per probed rate (default 500, at least 20); a rate "
                          "holds only if its run also reaches a steady state and keeps up with its arrivals."),
        click.option("--chunk-tokens", "chunk_tokens", type=int, default=None, help="Serving: tokens per step (8192)."),
        click.option("--kv-cache-dtype", "kv_cache_dtype", type=click.Choice(KV_CACHE_DTYPES), default=None),
        click.option("--weight-dtype", "weight_dtype", type=click.Choice(WEIGHT_DTYPES), default=None),
        click.option("--hbm-utilization", "hbm_utilization", type=float, default=None,
                     help="Serving: fraction of HBM the engine uses (0.9)."),
        click.option("--step-overhead", "step_overhead", type=float, default=None, help="Serving: host seconds per step."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _describe(point: dict[str, Any]) -> str:
    parts = [f"tp{point.get('tp', 1)}", f"pp{point.get('pp', 1)}"]
    if point.get("ep", 1) > 1:
        parts.append(f"ep{point['ep']}" + (f" etp{point['expert_tp']}" if point.get("expert_tp", 1) > 1 else ""))
    if point.get("adp", 1) > 1:
        parts.append(f"attention-dp{point['adp']}")
    parts.append(f"seqs{point.get('max_num_seqs')}")
    split = point.get("split", "none")
    parts.append("colocated" if split == "none" else f"prefill:decode {split}")
    return " ".join(parts)


def print_serving(doc: dict[str, Any]) -> None:
    best = doc["best"]
    t = doc["target"]
    slo = t["slo"]
    targets = " and ".join(x for x in (f"TTFT <= {1e3 * slo['ttft_s']:g} ms" if slo["ttft_s"] else "",
                                       f"TPOT <= {1e3 * slo['tpot_s']:g} ms" if slo["tpot_s"] else "") if x)
    click.echo(f"goal: the most requests per second per GPU with {100 * t['attainment']:g} % of them meeting {targets} "
               f"({t['input_len']} in / {t['output_len']} out tokens on average, {t['lengths']})")
    if best is None:
        click.echo("interrupted before any serving layout was found feasible" if doc["interrupted"]
                   else "no feasible serving layout", err=True)
    else:
        settled = ("every feasible layout simulated" if not doc.get("ruled_out")
                   else "every other feasible layout simulated or proven slower than the top found")
        verdict = f"proven optimum ({settled})" if doc["proven_optimal"] else \
            f"best found by {doc['method']}; not proven optimal, " + (
                "the feasible layouts were not counted" if doc["unexplored"] is None
                else f"{doc['unexplored']:,} of {doc['feasible']:,} feasible layouts neither simulated nor ruled out")
        click.echo(f"best: {_describe(best['point'])}  —  {best['goodput_requests_per_s_per_gpu']:.3f} requests/s per GPU "
                   f"({best['cluster_goodput_requests_per_s']:,.1f} on the cluster)  [{verdict}]")
        click.echo("")
        click.echo(f"{'#':>2} {'layout':<44} {'req/s/GPU':>10} {'tok/s/GPU':>10} {'TTFT p90':>9} {'TPOT p90':>9}")
        for i, e in enumerate(doc["top"], 1):
            lat = e["latency_s"]
            click.echo(f"{i:>2} {_describe(e['point']):<44} {e['goodput_requests_per_s_per_gpu']:>10.3f} "
                       f"{e['tokens_per_s_per_gpu']:>10,.0f} {1e3 * lat['ttft']['p90']:>7.0f}ms "
                       f"{1e3 * lat['tpot']['p90']:>7.1f}ms")
        _print_limits(doc)
    ruled = doc.get("ruled_out") or 0
    click.echo(f"\n{doc['evaluations']} layouts simulated"
               + (f", {ruled} ruled out (each failed at a rate below the goodput of the top {len(doc['top'])})"
                  if ruled else "")
               + f", space of {doc['space_size']}" + (" (interrupted: best so far)" if doc["interrupted"] else ""))
    if doc["infeasible"]:
        click.echo("infeasible, by rule:")
        for reason, n in sorted(doc["infeasible"].items(), key=lambda kv: -kv[1]):
            click.echo(f"  {n:>7}  {reason}")


def _print_limits(doc: dict[str, Any]) -> None:
    """Say which of the top rates stop short of the SLOs' edge: there the rate is what a probe
    could show, not the most the SLOs allow (see stage_cosim.search.sustained)."""
    limits = [e.get("limited_by") for e in doc["top"]]
    short, behind = limits.count("requests"), limits.count("throughput")
    if short:
        click.echo(f"\nnote: {short} of these rates are capped by the probe length, not by the SLOs: at the next rate "
                   f"probed, {doc['target']['requests_per_probe']} requests (--num-requests) met the SLOs without "
                   f"reaching a steady state (the unit held more than half of them at once on average); a larger "
                   f"--num-requests finds where the SLOs fail")
    if behind:
        click.echo(f"\nnote: {behind} of these rates are capped where the completions fell behind the arrivals while "
                   f"the SLOs still held (SLOs loose enough to hide a growing queue): the unit's throughput, not the "
                   f"SLOs, sets them")


def plot_serving(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stage_cosim.files import save_figure

    top = doc["top"]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(top) + 2))
    ax.barh([_describe(e["point"]) for e in top], [e["goodput_requests_per_s_per_gpu"] for e in top])
    ax.invert_yaxis()
    ax.set_xlabel("goodput (requests/s per GPU meeting the SLOs)")
    ax.set_title("Serving layouts")
    fig.tight_layout()
    save_figure(fig, path)


def optimize_serve(cluster: str, serve: dict[str, Any], *, seed: int, budget: int | None, workers: int,
                   ray_address: str | None, top_k: int, as_json: bool, plot: Path | None, quiet: bool,
                   model_kw: dict[str, Any]) -> None:
    from tqdm import tqdm

    from stage_cosim import api

    check_output(plot, "plot", FIGURE_SUFFIXES)
    req = {k: v for k, v in serve.items() if v is not None}
    req.update({k: v for k, v in model_kw.items() if v is not None and k != "arch"})
    req.update(cluster=cluster, seed=seed, budget=budget, workers=workers, ray=ray_address, top=top_k)
    show = not quiet and sys.stderr.isatty()
    with tqdm(disable=not show, unit="layout", desc="optimize serve", dynamic_ncols=True) as bar:
        def progress(p: dict) -> None:
            bar.update(p["evaluations"] - bar.n)
            if p["best_score"] is not None:
                bar.set_postfix_str(f"best {1 / p['best_score']:.3f} req/s/GPU")

        doc = api.optimize_serving({k: v for k, v in req.items() if v is not None}, progress=progress)
    if plot is not None and doc["top"]:
        plot_serving(doc, plot)
    click.echo(json.dumps(doc, indent=1)) if as_json else print_serving(doc)
    if doc["interrupted"]:
        raise click.exceptions.Exit(130)
    if doc["best"] is None:
        # an answer, not bad input: exit 1 with the reasons printed, as the training search does
        raise click.exceptions.Exit(1)
