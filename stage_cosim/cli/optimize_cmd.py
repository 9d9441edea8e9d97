"""``stage-cosim optimize``: the best parallelization of a model on a cluster."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from tqdm import tqdm

from stage_cosim.cli.optimize_serve import SERVE_FLAGS, serve_options
from stage_cosim.cli.options import (
    PRECISION_FLAGS, cluster_option, model_options, precision_options, resolve_model_options,
)
from stage_cosim.errors import UserError
from stage_cosim.files import save_figure
from stage_cosim.result import BREAKDOWN_KEYS

GiB = 1 << 30


def describe_point(p: dict, par: dict) -> str:
    parts = [f"dp{par['dp']}", f"tp{par['tp']}", f"pp{par['pp']}"]
    if par.get("cp", 1) > 1:
        comm = par.get("cp_comm", "p2p")
        size = f":{par['cp_a2a_size']}" if comm == "a2a+p2p" else ""
        parts.insert(2, f"cp{par['cp']}({comm}{size})")
    if par.get("vp", 1) > 1:
        parts.append(f"vp{par['vp']}")
    # the expert layout, wherever it is not the dense one (ep 1, expert_tp = tp)
    ep, etp = par.get("ep", 1), par.get("expert_tp", par["tp"])
    if ep > 1 or etp != par["tp"]:
        parts += [f"ep{ep}", f"expert_tp{etp}"]
    parts.append(f"mb{par['micro_batch']}")
    if par.get("sp"):
        parts.append("sp")
    parts.append(f"zero{par['zero']}")
    if par.get("recompute", "none") != "none":
        parts.append(f"rc={par['recompute']}")
    if par.get("dtype", "bf16") != "bf16":
        parts.append(par["dtype"])
    return " ".join(parts)


def print_report(doc: dict, objective, top_k: int) -> None:  # noqa: ANN001 (Objective)
    best = doc["best"]
    if best is None:
        click.echo("no feasible configuration", err=True)
    else:
        verdict = "proven optimum (every feasible configuration simulated)" if doc["proven_optimal"] else \
            f"best found by {doc['method']}"
        click.echo(f"best: {describe_point(best['point'], best['config']['parallel'])}  —  "
                   f"{objective.describe(best['score'])}  [{verdict}]")
        keys = [k for k in BREAKDOWN_KEYS if any(e["breakdown"].get(k) for e in doc["top"])]
        click.echo("")
        click.echo(f"{'#':>2} {'configuration':<42} {'step s':>8} {'MFU':>6} {'mem GiB':>8} "
                   + " ".join(f"{k.replace('exposed_', 'exp_'):>10}" for k in keys))
        for i, e in enumerate(doc["top"][:top_k], 1):
            click.echo(f"{i:>2} {describe_point(e['point'], e['config']['parallel']):<42} {e['step_time_s']:>8.4f} "
                       f"{100 * e['mfu']:>5.1f}% {e['peak_memory_bytes'] / GiB:>8.1f} "
                       + " ".join(f"{e['breakdown'][k]:>10.4f}" for k in keys))
        by_dtype = doc.get("best_by_dtype") or {}
        if len(by_dtype) > 1:
            click.echo("")
            times = {d: e["step_time_s"] for d, e in by_dtype.items()}
            fastest = min(times.values())
            for d, e in by_dtype.items():
                click.echo(f"best {d:<5} {describe_point(e['point'], e['config']['parallel']):<42} "
                           f"{e['step_time_s']:>8.4f} s  {100 * e['mfu']:>5.1f}% MFU of BF16 peak"
                           + (f"  ({e['step_time_s'] / fastest:.2f}x the fastest)" if e["step_time_s"] > fastest else ""))
        if len(doc["top"]) > 1:
            a, b = doc["top"][0], doc["top"][1]
            diffs = sorted(((b["breakdown"][k] - a["breakdown"][k], k) for k in keys), reverse=True)
            reasons = ", ".join(f"{k.replace('exposed_', 'exposed ').replace('_', ' ')} "
                                f"{'-' if d > 0 else '+'}{abs(d):.4f} s" for d, k in diffs if abs(d) > 1e-4)
            click.echo(f"\nwhy #1 beats #2 ({b['step_time_s'] - a['step_time_s']:+.4f} s per step): {reasons}")
    click.echo(f"\n{doc['evaluations']} configurations simulated or memory-checked, space of {doc['space_size']}"
               + (" (interrupted: best so far)" if doc["interrupted"] else ""))
    if doc["infeasible"]:
        click.echo("infeasible, by rule:")
        for reason, n in sorted(doc["infeasible"].items(), key=lambda kv: -kv[1]):
            click.echo(f"  {n:>7}  {reason}")


def plot_top(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = doc["top"]
    keys = [k for k in BREAKDOWN_KEYS if any(e["breakdown"].get(k) for e in top)]
    labels = [describe_point(e["point"], e["config"]["parallel"]) for e in top]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(top) + 2))
    left = [0.0] * len(top)
    for k in keys:
        vals = [e["breakdown"][k] for e in top]
        ax.barh(labels, vals, left=left, label=k.replace("_", " "))
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title("Top configurations: where the time goes")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def _check_fixed_precision(precision: dict, gpu) -> None:  # noqa: ANN001 (a hardware GPU)
    """A precision the user fixed is checked as simulate checks it, in one line, before any
    search: FP8 options need --dtype fp8 (or auto), and a fixed fp8 must run on the GPU (its
    recipe included); with --dtype auto the FP8 points the GPU cannot run are infeasible."""
    from stage_cosim.graph.precision import resolve_precision
    from stage_cosim.parallel import ParallelConfig

    opts = {k: v for k, v in precision.items() if k != "dtype" and v is not None}
    if precision.get("dtype") in (None, "bf16"):
        ParallelConfig(dtype="bf16", **opts)
    elif precision["dtype"] == "fp8":
        # (ZeRO 3: the GPU-independent rules of the options were checked by the search space)
        resolve_precision(ParallelConfig(dtype="fp8", zero=3, **opts), gpu)


@click.command()
@model_options
@precision_options(auto=True)
@cluster_option
@click.option("--phase", type=click.Choice(["train", "serve"]), default="train", show_default=True,
              help="train: the fastest training step; serve: the serving layout with the most goodput per GPU "
                   "under --slo-ttft/--slo-tpot.")
@click.option("--global-batch", type=int, default=None, help="Training: sequences per step (required).")
@click.option("--seq-len", type=int, default=None, help="Training: sequence length (required).")
@serve_options
@click.option("--objective", type=click.Choice(["step-time", "tokens-per-gpu", "cost"]), default="step-time",
              show_default=True)
@click.option("--price", type=float, default=0.0, help="Price per GPU-hour (cost objective).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--budget", type=int, default=None, help="Most simulations (default: all if the space is small, else 300).")
@click.option("--workers", type=int, default=1, show_default=True, help="Local worker processes.")
@click.option("--ray", "ray_address", default=None, metavar="auto|ADDRESS", help="Evaluate on a Ray cluster.")
@click.option("--headroom", type=float, default=0.0, show_default=True, help="Fraction of HBM to keep free.")
@click.option("--allow-cross-domain-tp", is_flag=True, help="Let tensor-parallel groups span scale-up domains.")
@click.option("--network-model", type=click.Choice(["calibrated", "astra"]), default="calibrated", show_default=True)
@click.option("--top", "top_k", type=int, default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="Bar chart of the top configurations (PNG).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def optimize(cluster: str, phase: str, global_batch: int | None, seq_len: int | None, objective: str, price: float,
             seed: int, budget: int | None, workers: int, ray_address: str | None, headroom: float,
             allow_cross_domain_tp: bool, network_model: str, top_k: int, as_json: bool, plot: Path | None,
             quiet: bool, **kw) -> None:
    """Search tp, pp, dp, vp, micro-batch, sp, ZeRO and recomputation (and, with --dtype auto, the
    precision) for the best training step; or, with --phase serve, the serving layout (tp, pp, ep,
    attention data parallelism, batch limit, prefill/decode split) with the most goodput per GPU."""
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.search.evaluate import Objective
    from stage_cosim.search.optimize import OptimizeSettings, optimize as run
    from stage_cosim.search.space import default_space

    serve = {k: kw.pop(k) for k in SERVE_FLAGS}
    if phase == "serve":
        from stage_cosim.cli.optimize_serve import optimize_serve

        ctx = click.get_current_context()
        given = [name for name in ("global_batch", "seq_len", "objective", "price", "headroom", "allow_cross_domain_tp",
                                   "network_model", *PRECISION_FLAGS)
                 if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)]
        if given:
            raise UserError(given[0].replace("_", "-"), "is a training search option (not with --phase serve)")
        for name in PRECISION_FLAGS:
            kw.pop(name)
        optimize_serve(cluster, serve, seed=seed, budget=budget, workers=workers, ray_address=ray_address,
                       top_k=top_k, as_json=as_json, plot=plot, quiet=quiet, model_kw=kw)
        return
    given = [k for k, v in serve.items() if v is not None]
    if given:
        raise UserError(given[0].replace("_", "-"), "is a serving search option (with --phase serve)")
    if global_batch is None or seq_len is None:
        raise UserError("global-batch" if global_batch is None else "seq-len", "is required for a training search")
    if global_batch <= 0 or seq_len <= 0:
        raise UserError("global-batch" if global_batch <= 0 else "seq-len", "must be a positive integer")
    if not 0 <= headroom < 1:
        raise UserError("headroom", f"must be in [0, 1), got {headroom}")
    if budget is not None and budget < 1:
        raise UserError("budget", f"must be at least 1, got {budget}")
    model = resolve_model_options(kw)
    if ":" not in cluster and not Path(cluster).suffix in (".yaml", ".yml"):
        raise UserError("cluster", f"give the GPU count to search over, e.g. {cluster}:1024")
    c = resolve_cluster(cluster)
    obj = Objective(objective, price)
    settings = OptimizeSettings(objective=obj, seed=seed, budget=budget, workers=workers, ray=ray_address,
                                top_k=top_k, headroom=headroom, network_model=network_model,
                                allow_cross_domain_tp=allow_cross_domain_tp)
    precision = {k: kw.pop(k) for k in PRECISION_FLAGS}
    _check_fixed_precision(precision, c.gpu)
    space = default_space(model, c, global_batch, seq_len, allow_cross_domain_tp=allow_cross_domain_tp,
                          precision=precision)
    show = not quiet and sys.stderr.isatty()
    with tqdm(disable=not show, unit="eval", desc="optimize", dynamic_ncols=True) as bar:
        def progress(p: dict) -> None:
            bar.update(p["evaluations"] - bar.n)
            if p["best_score"] is not None:
                bar.set_postfix_str(f"best {obj.describe(p['best_score'])}")

        result = run(space, c, settings, progress=progress)
    doc = result.to_dict()
    if plot is not None and doc["top"]:
        plot_top(doc, plot)
    if as_json:
        click.echo(json.dumps(doc, indent=1))
    else:
        print_report(doc, obj, top_k)
    if result.interrupted:
        raise click.exceptions.Exit(130)
