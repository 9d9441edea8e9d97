"""``stage-cosim optimize``: the best parallelization of a model on a cluster."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from tqdm import tqdm

from stage_cosim.cli.emit import emit_option, print_launch, try_launch
from stage_cosim.launch.frameworks import FRAMEWORKS, LAUNCHABLE
from stage_cosim.cli.optimize_serve import SERVE_FLAGS, serve_options
from stage_cosim.cli.options import (
    PRECISION_FLAGS, cluster_option, software_option, model_options, network_model_option, precision_options,
    resolve_model_options,
)
from stage_cosim.errors import UserError
from stage_cosim.parallel.software import get_software
from stage_cosim.files import FIGURE_SUFFIXES, check_output, reported_write, save_figure
from stage_cosim.result import BREAKDOWN_KEYS
from stage_cosim.search.evaluate import OBJECTIVES
from stage_cosim.hardware.runtime import DEFAULT_HEADROOM

if TYPE_CHECKING:
    from stage_cosim.model.config import ModelConfig
    from stage_cosim.search.space import SearchSpace

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


STEP_PRECISION = 1e-4      # the report shows seconds to 4 decimals


def _shown(e: dict, keys: list[str]) -> tuple:
    """Every figure the report shows for an entry, as shown."""
    return (f"{e['step_time_s']:.4f}", f"{100 * e['mfu']:.1f}", f"{e['peak_memory_bytes'] / GiB:.1f}",
            *(f"{e['breakdown'].get(k, 0.0):.4f}" for k in keys))


def _dimension(token: str) -> str:
    """The dimension a token of :func:`describe_point` sets: dp8 -> dp, rc=full -> rc, cp2(a2a) -> cp."""
    return re.match(r"[a-z_]+", token).group(0) if re.match(r"[a-z_]+", token) else token


def _difference(a: dict, b: dict) -> str:
    """What ``b``'s configuration sets otherwise than ``a``'s: "rc=selective", "dp4 tp4 (#1: dp8
    tp2)", "no sp"."""
    ta = {_dimension(t): t for t in describe_point(a["point"], a["config"]["parallel"]).split()}
    tb = {_dimension(t): t for t in describe_point(b["point"], b["config"]["parallel"]).split()}
    changed = [d for d in tb if d in ta and ta[d] != tb[d]]
    parts = [tb[d] for d in changed]
    if changed:
        parts[-1] += f" (#1: {' '.join(ta[d] for d in changed)})"
    parts += [tb[d] for d in tb if d not in ta] + [f"no {ta[d]}" for d in ta if d not in tb]
    return " ".join(parts) or "the same configuration"


def fold(top: list[dict], keys: list[str]) -> list[tuple[dict, list[dict]]]:
    """The ranked entries, those identical in every figure shown folded into the first of them:
    (entry, its equivalent variants)."""
    out: list[tuple[dict, list[dict]]] = []
    for e in top:
        same = next((group for group in out if _shown(group[0], keys) == _shown(e, keys)), None)
        if same is None:
            out.append((e, []))
        else:
            same[1].append(e)
    return out


def print_report(doc: dict, objective, top_k: int) -> None:  # noqa: ANN001 (Objective)
    best = doc["best"]
    if best is None and doc["interrupted"]:
        # stopped before the first result: nothing found yet is not nothing feasible
        click.echo("best: none yet — interrupted before any configuration was found feasible")
    elif best is None:
        # an answer, not an error (exit status 1): the rules (and memory) below rule out every configuration
        click.echo("best: none — no feasible configuration (the rules below rule out every one)")
    else:
        verdict = "proven optimum (every feasible configuration simulated)" if doc["proven_optimal"] else \
            f"best found by {doc['method']}, not proven optimal"
        if doc["proven_optimal"] and doc.get("branch_and_bound"):
            verdict = "proven optimum (branch and bound: every other feasible configuration simulated, over the " \
                      "memory, or bounded above it)"
        click.echo(f"best: {describe_point(best['point'], best['config']['parallel'])}  —  "
                   f"{objective.describe(best['score'])}  [{verdict}]")
        keys = [k for k in BREAKDOWN_KEYS if any(e["breakdown"].get(k) for e in doc["top"])]
        rows = fold(doc["top"][:top_k], keys)
        click.echo("")
        click.echo(f"{'#':>2} {'configuration':<42} {'step s':>8} {'MFU':>6} {'mem GiB':>8} "
                   + " ".join(f"{k.replace('exposed_', 'exp_'):>10}" for k in keys))
        for i, (e, same) in enumerate(rows, 1):
            also = f"  (also: {'; '.join(_difference(e, v) for v in same)})" if same else ""
            click.echo(f"{i:>2} {describe_point(e['point'], e['config']['parallel']):<42} {e['step_time_s']:>8.4f} "
                       f"{100 * e['mfu']:>5.1f}% {e['peak_memory_bytes'] / GiB:>8.1f} "
                       + " ".join(f"{e['breakdown'][k]:>10.4f}" for k in keys) + also)
        folded = sum(len(same) for _, same in rows)
        if folded:
            click.echo(f"({folded} equivalent variant{'s' if folded > 1 else ''} folded: identical in every figure "
                       "shown)")
        by_dtype = doc.get("best_by_dtype") or {}
        if len(by_dtype) > 1:
            click.echo("")
            times = {d: e["step_time_s"] for d, e in by_dtype.items()}
            fastest = min(times.values())
            for d, e in by_dtype.items():
                click.echo(f"best {d:<5} {describe_point(e['point'], e['config']['parallel']):<42} "
                           f"{e['step_time_s']:>8.4f} s  {100 * e['mfu']:>5.1f}% MFU of BF16 peak"
                           + (f"  ({e['step_time_s'] / fastest:.2f}x the fastest)" if e["step_time_s"] > fastest else ""))
        if len(rows) > 1:
            click.echo("\n" + why_first(rows[0][0], rows[1][0], keys))
    click.echo(f"\n{doc['evaluations']} configurations simulated or memory-checked, space of {doc['space_size']}"
               + (" (interrupted: best so far)" if doc["interrupted"] else ""))
    bb = doc.get("branch_and_bound")
    if bb:
        click.echo(f"branch and bound: {bb['bounded']:,} of {bb['feasible']:,} feasible configurations bounded; "
                   f"{bb['simulated']:,} simulated, {bb['pruned_by_memory']:,} over the memory, "
                   f"{bb['pruned_by_bound']:,} ruled out by their bound")
    if not doc["proven_optimal"] and doc.get("unexplored") is not None and doc.get("feasible") is not None:
        click.echo(f"not proven optimal: {doc['unexplored']:,} of {doc['feasible']:,} structurally feasible "
                   f"configurations not simulated (a larger --budget explores more; the whole space proves the optimum)")
    if doc["infeasible"]:
        click.echo("infeasible, by rule:")
        for reason, n in sorted(doc["infeasible"].items(), key=lambda kv: -kv[1]):
            click.echo(f"  {n:>7}  {reason}")
    if best is None and doc.get("memory_needs"):
        click.echo(doc["memory_needs"])


def why_first(a: dict, b: dict, keys: list[str]) -> str:
    """Why #1 beats #2: the categories where their step differs beyond the shown precision, and
    what #2 changes in the configuration; a tie within that precision is said as one."""
    gap = b["step_time_s"] - a["step_time_s"]
    change = f"#2 has {_difference(a, b)}"
    if abs(gap) < STEP_PRECISION / 2:
        from stage_cosim.search.optimize import tied

        headroom = ""
        if tied(a["step_time_s"], b["step_time_s"]) and a["peak_memory_bytes"] < b["peak_memory_bytes"]:
            headroom = (f"; tied, #1 keeps more memory free ({a['peak_memory_bytes'] / GiB:.1f} GiB peak, "
                        f"#2 {b['peak_memory_bytes'] / GiB:.1f} GiB)")
        return (f"why #1 beats #2: they tie within the shown precision ({STEP_PRECISION:g} s per step; #1 by "
                f"{gap:.2e} s); {change}{headroom}")
    diffs = sorted(((b["breakdown"].get(k, 0.0) - a["breakdown"].get(k, 0.0), k) for k in keys),
                   key=lambda dk: -abs(dk[0]))
    shown = [(d, k) for d, k in diffs if abs(d) >= STEP_PRECISION / 2] or diffs[:1]
    reasons = ", ".join(f"{k.replace('exposed_', 'exposed ').replace('_', ' ')} {d:+.4f} s" for d, k in shown)
    return f"why #1 beats #2 ({gap:+.4f} s per step; {change}): {reasons}"


def plot_top(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in BREAKDOWN_KEYS if any(e["breakdown"].get(k) for e in doc["top"])]
    rows = fold(doc["top"], keys)
    top = [e for e, _ in rows]
    labels = [describe_point(e["point"], e["config"]["parallel"]) + (f" (+{len(same)} equivalent)" if same else "")
              for e, same in rows]
    legend_in = 0.25 * math.ceil(len(keys) / 5) + 0.1       # the legend's rows below the axis, inches
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(top) + 2 + legend_in))
    left = [0.0] * len(top)
    for k in keys:
        vals = [e["breakdown"][k] for e in top]
        ax.barh(labels, vals, left=left, label=k.replace("_", " "))
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    name = ((top[0].get("config") or {}).get("model") or {}).get("name") if top else None
    ax.set_title(f"{name + ': t' if name else 'T'}op configurations, where the time goes")
    # below the axis, clear of the bars (inside it, it hid the bars' ends)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=min(5, len(keys)), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 1))
    save_figure(fig, path)


def launchable_space(target: str, space: SearchSpace) -> SearchSpace:
    """``space`` narrowed to what ``target``'s launch expresses (its values of each dimension,
    and its rules across them; :data:`stage_cosim.launch.frameworks.LAUNCHABLE`)."""
    from stage_cosim.search.space import Constraint

    launchable = LAUNCHABLE[target]
    rules = [Constraint(f"emit: {FRAMEWORKS[target]} {rule}", holds) for rule, holds in launchable.rules]
    return space.narrowed(launchable.values, rules)


def refuse_before_search(target: str, model: ModelConfig, space: SearchSpace) -> None:
    """What ``target`` refuses whatever the search picks (a feature of the model, a precision
    held fixed, an FP8 option), refused before the search in the emitter's own words: the
    emitter run on one GPU with the space's fixed settings, and with FP8 where the space may
    pick it and an FP8 option is given (else the options apply to no point its launch takes)."""
    from stage_cosim.launch import emit
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.parallel.config import FP8_OPTIONS

    fixed = dict(space.fixed)
    dtypes = next((d.choices for d in launchable_space(target, space).dimensions if d.name == "dtype"),
                  (fixed.get("dtype", "bf16"),))
    options = {k: v for k, v in fixed.items() if k in FP8_OPTIONS}
    fixed["dtype"] = "fp8" if "fp8" in dtypes and (options or dtypes == ("fp8",)) else "bf16"
    if fixed["dtype"] == "bf16":
        fixed = {k: v for k, v in fixed.items() if k not in FP8_OPTIONS}
    try:
        # (ZeRO 3: the FP8 options' own rules, as the search space checked them)
        probe = ParallelConfig(zero=3, global_batch=space.global_batch, seq_len=space.seq_len, **fixed)
        # (the recipe the GPU would resolve changes no refusal: a recipe is refused only as given)
        emit(target, model, probe, fp8_recipe=probe.fp8_recipe or "delayed")
    except UserError as exc:
        if exc.parameter == "emit":
            raise
        # (what one GPU cannot run is the search's to rule on, point by point)


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
@click.option("--objective", type=click.Choice(OBJECTIVES), default="step-time",
              show_default=True)
@click.option("--price", type=float, default=0.0, help="Price per GPU-hour (cost objective).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--budget", type=int, default=None, help="Most simulations (default: all if the space is small, else 300).")
@click.option("--workers", type=int, default=1, show_default=True, help="Local worker processes.")
@click.option("--ray", "ray_address", default=None, metavar="auto|ADDRESS", help="Evaluate on a Ray cluster.")
@click.option("--headroom", type=float, default=DEFAULT_HEADROOM, show_default=True,
              help="Fraction of HBM to keep free beyond everything modelled (the runtime memory included): "
                   "a margin for what is not.")
@click.option("--allow-cross-domain-tp", is_flag=True, help="Let tensor-parallel groups span scale-up domains.")
@software_option
@network_model_option
@click.option("--top", "top_k", type=int, default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@emit_option
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="Bar chart of the top configurations (PNG).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def optimize(cluster: str, phase: str, global_batch: int | None, seq_len: int | None, objective: str, price: float,
             seed: int, budget: int | None, workers: int, ray_address: str | None, headroom: float,
             allow_cross_domain_tp: bool, software: str | None, network_model: str, top_k: int, as_json: bool, plot: Path | None,
             quiet: bool, **kw) -> None:
    """Search tp, cp (with its exchange: p2p, all-gather, a2a, a2a+p2p and its group size), pp,
    dp, vp, micro-batch, sp, ZeRO, recomputation, for MoE models ep and expert-tp (and, with
    --dtype auto, the precision) for the best training step; or, with --phase serve, the serving layout (tp, pp, ep,
    attention data parallelism, batch limit, prefill/decode split) with the most goodput per GPU."""
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.search.evaluate import Objective
    from stage_cosim.search.optimize import OptimizeSettings, optimize as run
    from stage_cosim.search.space import default_space

    serve = {k: kw.pop(k) for k in SERVE_FLAGS}
    target = kw.pop("emit")
    if top_k < 1:
        raise UserError("top", f"must be at least 1, got {top_k}")
    if phase == "serve":
        from stage_cosim.cli.optimize_serve import optimize_serve

        if target is not None:
            raise UserError("emit", "writes a training configuration's launch arguments (not with --phase serve)")

        ctx = click.get_current_context()
        given = [name for name in ("global_batch", "seq_len", "objective", "price", "headroom", "allow_cross_domain_tp",
                                   "software", "network_model", *PRECISION_FLAGS)
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
    if not 0 <= seed < 2**32:
        raise UserError("seed", f"must be in 0..{2**32 - 1}, got {seed}")
    if not math.isfinite(price) or price < 0:
        raise UserError("price", f"must be a non-negative number of $ per GPU-hour, got {price}")
    check_output(plot, "plot", FIGURE_SUFFIXES)         # before the search, not after it
    model = resolve_model_options(kw)
    if ":" not in cluster and Path(cluster).suffix not in (".yaml", ".yml"):
        raise UserError("cluster", f"give the GPU count to search over, e.g. {cluster}:1024")
    c = resolve_cluster(cluster)
    obj = Objective(objective, price)
    settings = OptimizeSettings(objective=obj, seed=seed, budget=budget, workers=workers, ray=ray_address,
                                top_k=top_k, headroom=headroom, network_model=network_model,
                                allow_cross_domain_tp=allow_cross_domain_tp)
    precision = {k: kw.pop(k) for k in PRECISION_FLAGS}
    _check_fixed_precision(precision, c.gpu)
    get_software(software)                               # an unknown profile: one line, before the search
    space = default_space(model, c, global_batch, seq_len, allow_cross_domain_tp=allow_cross_domain_tp,
                          precision=precision, fixed={"software": software} if software else None)
    if target is not None:
        # a launch to write: what the framework refuses whatever the search picks is refused
        # now, and the search tries only what it launches (the best found must be one)
        refuse_before_search(target, model, space)
        space = launchable_space(target, space)
    show = not quiet and sys.stderr.isatty()
    with tqdm(disable=not show, unit="eval", desc="optimize", dynamic_ncols=True) as bar:
        def progress(p: dict) -> None:
            bar.update(p["evaluations"] - bar.n)
            if p["best_score"] is not None:
                bar.set_postfix_str(f"best {obj.describe(p['best_score'])}")

        result = run(space, c, settings, progress=progress)
    doc = result.to_dict()
    if doc["best"] is None and not result.interrupted:
        from stage_cosim.search.evaluate import MEMORY_REASON, gpus_for_training_state

        need, why = gpus_for_training_state(model, c, headroom, bool(precision.get("fp8_param_gather")))
        if need > c.num_gpus and MEMORY_REASON in doc["infeasible"]:
            doc["memory_needs_gpus"], doc["memory_needs"] = need, why
    launch, refused = try_launch(target, model, doc["best"])
    if launch is not None:
        doc["launch"] = launch.to_dict()
    if as_json:
        click.echo(json.dumps(doc, indent=1))
    else:
        print_report(doc, obj, top_k)
        print_launch(launch)
    if plot is not None and doc["top"]:
        with reported_write("plot", plot):         # the result is out: a failed write loses nothing
            plot_top(doc, plot)
    if result.interrupted:
        raise click.exceptions.Exit(130)
    if doc["best"] is None:
        raise click.exceptions.Exit(1)      # an answer (no configuration is feasible), not bad input
    if refused is not None:
        raise refused
