"""``stage-cosim simulate``: step time, memory and where the time goes, on a cluster."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click

from stage_cosim.adapters import BACKENDS
from stage_cosim.adapters.roofline.network import ALGORITHMS
from stage_cosim.cli.astra_cmd import settings_from, with_astra_options
from stage_cosim.cli.emit import emit_option, launch_for, print_launch
from stage_cosim.cli.options import (
    cluster_option, inference_options, model_options, network_model_option, parallel_options,
    resolve_inference_options, resolve_model_options, resolve_parallel_options, warn_positions,
)
from stage_cosim.errors import UserError
from stage_cosim.parallel.software import get_software
from stage_cosim.result import SimResult

GiB = 1 << 30



# An inference step's weights (--weight-dtype), as the precision line says them.
WEIGHTS = {"bf16": "bf16 weights and GEMMs",
           "fp8": "fp8 weights (W8A8: FP8 GEMMs, {fp8_activation_scale} per-tensor activation scales)",
           "int4": "int4 weights (W4A16: 4 bits and a scale per 128 weights, dequantized in BF16 GEMMs)"}


def describe_precision(p: dict) -> str:
    """One line: "bf16", or "fp8 delayed (hybrid), FP8 attention, FP8 parameters"."""
    if p.get("dtype", "bf16") != "fp8":
        return p.get("dtype", "bf16")
    extras = [label for key, label in (("attention", "FP8 attention"), ("param_gather", "FP8 parameters"),
                                       ("dispatch", "FP8 dispatch"), ("te_layernorm_mlp", "TE LayerNormMLP"))
              if p.get(key)]
    if p.get("recipe") in ("blockwise", "rowwise"):
        layout = "column-wise copies quantized separately"      # their scales are not transposable
    else:
        layout = "transposed FP8 copies" if p.get("transposes") else "no transposes"
    if p.get("recipe") == "rowwise":
        # stated because nothing measures it: the rowwise-scaled GEMM kernels' own rate
        extras.append("rowwise GEMMs assumed at the per-tensor FP8 rate")
    return ", ".join([f"fp8 {p.get('recipe')} ({p.get('format')}, {layout})", *extras])


def _switches_line(par: dict) -> str:
    """The performance switches the step ran with, by their flag names (each can be set); a
    ``*`` marks those taken from the software profile because the request left them unset."""
    assumed = set(par.get("assumed") or ())

    def flag(name: str, text: str) -> str:
        return text + ("*" if name in assumed else "")

    def on(name: str) -> str:
        words = name.replace("_", "-")
        return flag(name, f"--{words}" if par[name] else f"--no-{words}")

    parts = [on("sp"), on("tp_comm_overlap"), on("overlap_grad_reduce"), on("overlap_param_gather"),
             flag("grad_reduce_dtype", f"--grad-reduce-in-{par['grad_reduce_dtype']}")]
    note = f"  (* {par.get('software')} default)" if assumed else f"  ({par.get('software')})"
    kernel = get_software(par.get("software")).attention_kernel
    if kernel:
        # (the fused attention kernel the profile's release runs: the GPU's efficiencies for it)
        note += f"; its attention kernel {kernel}"
    return " ".join(parts) + note


def _experts_line(par: dict) -> str:
    cap = par.get("moe_capacity_factor")
    drop = par.get("moe_dropped_fraction") or 0.0
    routing = "dropless" if cap is None else f"capacity factor {cap}"
    if drop:
        routing += f", {100 * drop:.1f} % of its tokens dropped"
    return (f"ep{par['ep']} expert-tp{par['expert_tp']} edp{par['edp']} {par['moe_token_dispatcher']} dispatcher;"
            f" busiest expert rank at {par['moe_load']:.2f}x the mean ({routing})")


def _params_line(cfg: dict, parameters: dict | None = None) -> str | None:
    """The model and its parameter counts (total, and active per token where experts route,
    saying what "active" counts): the result's own counts, else counted from its description."""
    from stage_cosim.model.params import ParameterCounts, describe, parameter_counts

    doc = cfg.get("model")
    if not doc:
        return None
    if parameters:
        fields = {k: v for k, v in parameters.items() if k in ParameterCounts.__dataclass_fields__}
        return f"{doc.get('name', '?')}: {describe(ParameterCounts(**fields))}"
    from stage_cosim.model import ModelConfig

    try:
        model = ModelConfig(**{k: v for k, v in doc.items() if k in ModelConfig.__dataclass_fields__})
        counts = parameter_counts(model)
    except (TypeError, ValueError, UserError):          # a description this version cannot rebuild
        return f"{doc.get('name', '?')}"
    return f"{model.name}: {describe(counts)}"


def _cluster_line(cfg: dict) -> str | None:
    c = cfg.get("cluster")
    if not c:
        return None
    from stage_cosim.hardware.cluster import cluster_from

    up, out = c["scale_up"], c["scale_out"]
    per = cluster_from(c).domain
    share = (f"{per} of {up['gpus_per_domain']} ({per // up['gpus_per_tray']} trays of a rack's "
             f"{up['gpus_per_domain'] // up['gpus_per_tray']})" if up.get("gpus_per_tray") and per < up["gpus_per_domain"]
             and c["num_gpus"] > per else f"{per}")
    return (f"{c['name']}: {c['num_gpus']:,} x {c['gpu']['name']} ({c['gpu']['hbm_GiB']:g} GiB HBM), "
            f"{share} per scale-up domain at {up['bandwidth_GBps']:g} GB/s, "
            f"scale-out {out['bandwidth_GBps']:g} GB/s per GPU")


def memory_categories(roles) -> list[str]:  # noqa: ANN001 (RoleResult)
    """The memory categories worth a column: those some stage holds, without the total, the
    published-style subtotals, and the parts of a category shown whole (``runtime_*``)."""
    keys: list[str] = []
    for role in roles:
        for k, v in role.memory.items():
            if k in keys or k == "total" or k.startswith("model_states_") or not v:
                continue
            if "_" in k and k.split("_", 1)[0] in role.memory and k.split("_", 1)[0] != k:
                continue
            keys.append(k)
    return keys


def print_memory(r: SimResult, rows: list) -> None:  # noqa: ANN001 (RoleResult)
    """Per stage, memory per GPU by category against HBM: what a configuration that does not
    fit would have to shed."""
    keys = memory_categories(rows)
    if not keys:
        return
    hbm = r.memory_capacity_bytes
    labels = [k.replace("_", " ") for k in keys]
    click.echo(f"\nmemory per GPU, GiB (HBM {hbm / GiB:.0f} GiB)")
    click.echo(f"{'stage':>5} " + " ".join(f"{lab:>{max(9, len(lab))}}" for lab in labels)
               + f" {'total':>8} {'of HBM':>7}")
    for role in rows:
        total = role.memory.get("total", role.peak_memory_bytes)
        click.echo(f"{role.stage:>5} " + " ".join(f"{role.memory.get(k, 0) / GiB:>{max(9, len(lab))}.2f}"
                                                  for k, lab in zip(keys, labels))
                   + f" {total / GiB:>8.2f} {100 * total / hbm:>6.0f}%")


def parse_tokens(text: str) -> float:
    """A token count: 1e12, 15T, 300B, 2.5M, 400K (positive, finite)."""
    units = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    t = text.strip().lower().replace("_", "").replace(",", "")
    scale = units.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if t[-1:] in units else t) * scale
    except ValueError:
        raise UserError("train-tokens", f"must be a number of tokens (1e12, 15T, 300B), got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError("train-tokens", f"must be a positive number of tokens, got {text!r}")
    return value


def training_run(r: SimResult, tokens: float | None, price: float | None) -> dict | None:
    """Time and cost of ``tokens`` (or of one step and a million tokens, with a price alone)."""
    if tokens is None and price is None:
        return None
    gpus = int(r.config.get("num_gpus", 1))
    per_step = r.tokens_per_s * r.step_time_s
    out: dict = {"num_gpus": gpus, "tokens_per_step": per_step, "price_per_gpu_hour": price}
    if tokens is not None:
        seconds = tokens / r.tokens_per_s
        out.update(tokens=tokens, steps=tokens / per_step, seconds=seconds, gpu_hours=seconds / 3600 * gpus)
        if price is not None:
            out["cost"] = out["gpu_hours"] * price
    if price is not None:
        out["cost_per_step"] = r.step_time_s / 3600 * gpus * price
        out["cost_per_million_tokens"] = 1e6 / r.tokens_per_s / 3600 * gpus * price
    return out


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:,.1f} hours"
    return f"{seconds / 60:,.1f} minutes" if seconds >= 120 else f"{seconds:,.1f} s"


def _count(n: float) -> str:
    """1.5T, 300B, 2M: a token count as people write it."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.4g}{unit}"
    return f"{n:,.0f}"


def _money(x: float) -> str:
    return f"${x:,.0f}" if x >= 100 else f"${x:,.4g}" if x >= 0.01 else f"${x:.6f}"


def print_training_run(run: dict) -> None:
    price = run.get("price_per_gpu_hour")
    if "tokens" in run:
        cost = f", {_money(run['cost'])} at ${price:g}/GPU-h" if "cost" in run else ""
        click.echo(f"to train {_count(run['tokens']):<8}{_duration(run['seconds'])} on {run['num_gpus']:,} GPUs: "
                   f"{run['steps']:,.0f} steps, {run['gpu_hours']:,.0f} GPU-hours{cost}")
    if price is not None:
        click.echo(f"cost             {_money(run['cost_per_step'])} per step, {_money(run['cost_per_million_tokens'])} "
                   f"per million tokens at ${price:g}/GPU-h")


def print_summary(r: SimResult, run: dict | None = None) -> None:
    """The text report (also 'remote simulate'); ``run``: :func:`training_run`'s figures."""
    cfg = r.config
    par = cfg.get("parallel") or {}
    inf = r.inference
    model_line, cluster_line = _params_line(cfg, r.parameters), _cluster_line(cfg)
    if model_line:
        click.echo(f"model            {model_line}")
    if cluster_line:
        click.echo(f"cluster          {cluster_line}")
    if inf:
        what = (f"prefill of {inf['batch']} x {inf['input_len']} tokens" if inf["phase"] == "prefill" else
                f"decode step of {inf['batch']} requests at context {inf['context_len']}")
        click.echo(f"step             {what} ({inf['micro_batches']} micro-batch"
                   f"{'es' if inf['micro_batches'] > 1 else ''} of {inf['micro_batch']} per replica)")
        click.echo(f"latency          {1e3 * r.step_time_s:.3f} ms "
                   f"({'time to first token' if inf['phase'] == 'prefill' else 'time per output token'})")
    else:
        click.echo(f"step time        {r.step_time_s:.4f} s")
    click.echo(f"throughput       {r.tokens_per_s:,.0f} tokens/s ({r.tokens_per_s_per_gpu:,.1f} per GPU)")
    # (how FLOPs are counted is said once: the result's flop_convention, in --json and the docs)
    click.echo(f"MFU / HFU        {100 * r.mfu:.1f} % / {100 * r.hfu:.1f} % of BF16 peak")
    if r.mfu_fp8 is not None:
        fmt = "MXFP8" if r.precision.get("recipe") == "mxfp8" else "FP8"
        click.echo(f"{'MFU (' + fmt + ' peak)':<17}{100 * r.mfu_fp8:.1f} %")
    click.echo(f"precision        {WEIGHTS[inf['weight_dtype']].format(**inf) if inf else describe_precision(r.precision)}")
    if inf:
        click.echo(f"HBM traffic      {inf['bytes_read'] / 1e9:,.2f} GB read (weights per micro-batch, KV cache), "
                   f"MBU {100 * inf['mbu']:.1f} %")
        click.echo(f"KV cache         {inf['kv_cache_bytes_per_gpu'] / GiB:.2f} GiB per GPU, "
                   f"{inf['kv_cache_bytes_per_token_per_gpu'] / 1024:.1f} KiB per token per GPU ({inf['kv_cache_dtype']})"
                   + (f" + {inf['state_bytes_per_sequence_per_gpu'] / 2**20:.2f} MiB SSM state per request"
                      if inf.get("state_bytes_per_sequence_per_gpu") else ""))
    fits = "fits" if r.fits_in_memory else "DOES NOT FIT"
    click.echo(f"peak memory      {r.peak_memory_bytes / GiB:.1f} GiB of {r.memory_capacity_bytes / GiB:.0f} GiB ({fits})")
    if run:
        print_training_run(run)
    if par:
        training = "" if inf else (f"{' vp' + str(par['vp']) if par.get('vp', 1) > 1 else ''}"
                                   f"{' sp' if par.get('sp') else ''} zero{par['zero']} recompute={par['recompute']}"
                                   f" micro-batch {par['micro_batch']} x {par['num_microbatches']}")
        cp = f" cp{par['cp']}({par['cp_comm']})" if par.get("cp", 1) > 1 else ""
        training += " attention-dp" if inf and inf.get("attention_dp") else ""
        training += " two-batch-overlap" if inf and inf.get("two_batch_overlap") else ""
        click.echo(f"configuration    dp{par['dp']} tp{par['tp']}{cp} pp{par['pp']}{training}"
                   f" on {cfg['num_gpus']} x {cfg['cluster']['gpu']['name']} ({cfg['network_model']} network)")
        if (cfg.get("model") or {}).get("num_experts"):
            click.echo(f"experts          {_experts_line(par)}")
        if not inf:
            click.echo(f"switches         {_switches_line(par)}")
    keys = [k for k in r.breakdown if any(role.breakdown.get(k) for role in r.roles)]
    click.echo("")
    click.echo(f"{'stage':>5} {'finish s':>9} " + " ".join(f"{k.replace('exposed_', 'exp_'):>12}" for k in keys)
               + f" {'mem GiB':>8}")
    # one row per stage: a replay of every rank has a role per rank, and the stage's row is the
    # rank that finishes last
    rows: dict[int, object] = {}
    for role in r.roles:
        if role.stage not in rows or role.finish_s > rows[role.stage].finish_s:
            rows[role.stage] = role
    for role in (rows[stage] for stage in sorted(rows)):
        click.echo(f"{role.stage:>5} {role.finish_s:>9.4f} " + " ".join(f"{role.breakdown[k]:>12.4f}" for k in keys)
                   + f" {role.peak_memory_bytes / GiB:>8.1f}")
    print_memory(r, [rows[stage] for stage in sorted(rows)])


def plot_stages(r: SimResult, path: Path) -> None:
    """Where each pipeline stage's step goes: one stacked bar per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stage_cosim.files import save_figure

    rows: dict[int, object] = {}
    for role in r.roles:
        if role.stage not in rows or role.finish_s > rows[role.stage].finish_s:
            rows[role.stage] = role
    roles = [rows[s] for s in sorted(rows)]
    keys = [k for k in r.breakdown if any(role.breakdown.get(k) for role in roles)]
    labels = [f"stage {role.stage}" for role in roles]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(roles) + 2.5))
    left = [0.0] * len(roles)
    for k in keys:
        vals = [role.breakdown.get(k, 0.0) for role in roles]
        ax.barh(labels, vals, left=left, label=k.replace("exposed_", "exposed ").replace("_", " "))
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds" + (" per step" if not r.inference else ""))
    par = r.config.get("parallel") or {}
    ax.set_title(f"{(r.config.get('model') or {}).get('name', 'step')}: where the time goes per pipeline stage"
                 + (f" (dp{par['dp']} tp{par['tp']} pp{par['pp']})" if par else ""))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / max(1, len(roles))), ncol=min(5, len(keys)),
              fontsize=8, frameon=False)
    fig.tight_layout()
    save_figure(fig, path)


@click.command()
@model_options
@parallel_options
@inference_options
@cluster_option
@network_model_option
@click.option("--nccl-algo", type=click.Choice(ALGORITHMS), default="auto",
              show_default=True,
              help="All-reduce algorithm, as NCCL_ALGO: auto (the fastest of ring, tree and, where the cluster's "
                   "switches reduce, collnet, by size and scale), or one forced where it can run (nvls: inside one "
                   "NVSwitch domain; collnet: scale_out.in_network_reduction). Calibrated network model only.")
@click.option("--traces", type=click.Path(path_type=Path), default=None,
              help="Simulate these Chakra traces (any generator; a trace directory or an export's run "
                   "directory) instead of synthesizing.")
@click.option("--comm-groups", type=click.Path(path_type=Path), default=None,
              help="--traces: the communicator-group file (default: comm_groups.json beside the traces or above).")
@click.option("--full", is_flag=True,
              help="Replay every rank node by node (one rank per pipeline stage where that is proven exact for "
                   "every rank) instead of one rank per stage, pass by pass.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--timeline", type=click.Path(path_type=Path), default=None,
              help="Write a Chrome/Perfetto trace (ui.perfetto.dev) of the simulated ranks (FILE.json).")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Draw where each pipeline stage's step goes (PNG, PDF or SVG).")
@click.option("--train-tokens", default=None, metavar="N",
              help="Print the time (and, with --price, the cost) to train N tokens (1e12, 15T, 300B).")
@click.option("--price", type=float, default=None, metavar="$/GPU-h",
              help="Price per GPU-hour: the cost of a step, of a million tokens and of --train-tokens.")
@click.option("--quiet", is_flag=True, help="No progress (--full shows it on a terminal).")
@click.option("--backend", type=click.Choice(BACKENDS), default="roofline", show_default=True,
              help="Our analytical simulator, or a user's ASTRA-sim binary.")
@click.option("--astra-sim", "astra_bin", default=None, metavar="PATH",
              help="ASTRA-sim binary (default: $ASTRA_SIM_BIN, then AstraSim_Analytical_Congestion_Unaware on PATH).")
@click.option("--keep", type=click.Path(path_type=Path), default=None,
              help="astra-sim backend: keep the run directory here.")
@click.option("--timeout", type=float, default=3600.0, show_default=True, help="astra-sim backend: seconds.")
@with_astra_options
@emit_option
def simulate(cluster: str, network_model: str, nccl_algo: str, traces: Path | None, comm_groups: Path | None,
             full: bool,
             as_json: bool, timeline: Path | None, plot: Path | None, train_tokens: str | None, price: float | None,
             quiet: bool, backend: str, astra_bin: str | None, keep: Path | None, timeout: float, compute_mode: str,
             **kw) -> None:
    """Simulate one training step with the built-in analytical simulator (or ASTRA-sim)."""
    from stage_cosim.adapters.simulate import simulate as run, simulate_every_rank, simulate_traces
    from stage_cosim.files import FIGURE_SUFFIXES, check_output
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.workload import synthesize

    # every output and option is checked before any work: a finished result is never lost
    check_output(timeline, "timeline", (".json",))
    check_output(plot, "plot", FIGURE_SUFFIXES)
    tokens = parse_tokens(train_tokens) if train_tokens is not None else None
    if price is not None and not (math.isfinite(price) and price > 0):
        raise UserError("price", f"must be a positive number of $ per GPU-hour, got {price}")
    target = kw.pop("emit")
    settings = settings_from(kw)
    model = resolve_model_options(kw)
    inference = resolve_inference_options(kw)
    parallel = resolve_parallel_options(kw, cluster)
    launch = None
    if target is not None:
        # before any work: what the framework cannot express is refused with nothing simulated
        if traces is not None or inference is not None:
            raise UserError("emit", "writes a training configuration's launch arguments (not with --traces or "
                                    "--phase prefill|decode)")
        launch = launch_for(target, model, parallel, resolve_cluster(cluster, parallel.world_size).gpu)
    if tokens is not None and inference is not None:
        raise UserError("train-tokens", "is the length of a training run (not with --phase prefill|decode)")
    if nccl_algo != "auto" and (backend == "astra-sim" or traces is not None or network_model == "astra"):
        raise UserError("nccl-algo", "chooses the calibrated network model's all-reduce algorithm for a synthesized "
                                     "workload (not with --backend astra-sim, --network-model astra or --traces)")
    programs = rep = names = None
    if backend == "astra-sim":
        from stage_cosim.adapters.astra_sim.backend import simulate_astra_sim

        if traces is not None or timeline is not None:
            raise UserError("backend", "--traces and --timeline work with the roofline backend only")
        check_output(keep / "x" if keep is not None else None, "keep")
        machine = resolve_cluster(cluster, parallel.world_size)
        result = simulate_astra_sim(synthesize(model, parallel, machine.gpu, inference=inference), machine,
                                    binary=astra_bin, mode=compute_mode, settings=settings, keep=keep,
                                    timeout_s=timeout)
    elif traces is not None:
        from stage_cosim.trace.location import locate

        if inference is not None:
            raise UserError("phase", "--traces simulates the traces as they are (the phase is theirs)")
        n = len(locate(traces, comm_groups).files)
        result, rep, programs = simulate_traces(traces, resolve_cluster(cluster, n), network_model,
                                                comm_groups=comm_groups, astra_settings=settings,
                                                compute_mode=compute_mode, symmetric=not full)
        for warning in result.config.get("warnings", []):
            click.echo(f"warning: {warning}", err=True)
    else:
        machine = resolve_cluster(cluster, parallel.world_size)
        workload = synthesize(model, parallel, machine.gpu, inference=inference)
        if full:
            with _progress(quiet) as progress:
                result, rep, programs = simulate_every_rank(workload, machine, network_model, astra_settings=settings,
                                                            compute_mode=compute_mode, progress=progress,
                                                            nccl_algo=nccl_algo)
        else:
            # the result is the same with or without a timeline: a timeline is recorded from a
            # node-level replay of its own (for the astra model, the replay that gives the result)
            astra = network_model == "astra"
            result, rep, programs = run(workload, machine, network_model, exact=True if astra and timeline else None,
                                        astra_settings=settings, compute_mode=compute_mode, nccl_algo=nccl_algo)
            if timeline is not None and rep is None:
                recorded, rep, programs = run(workload, machine, network_model, exact=True,
                                              astra_settings=settings, compute_mode=compute_mode, nccl_algo=nccl_algo)
                _compare_recorded(result, recorded)
        if timeline is not None:
            names = [[n.name for n in workload.role(workload.role_of(p.rank)).nodes] for p in programs or []]
    if traces is None:
        warn_positions(model, parallel, inference)      # with the result, never before an error
        from stage_cosim.hardware.gpu import calibration_warning

        if (note := calibration_warning(resolve_cluster(cluster, parallel.world_size).gpu)) is not None:
            click.echo(f"warning: {note}", err=True)    # the GPU's efficiencies are borrowed, not measured
    doc_run = training_run(result, tokens, price)
    if as_json:
        doc = result.to_dict()
        if doc_run:
            doc["training_run"] = doc_run
        if launch is not None:
            doc["launch"] = launch.to_dict()
        click.echo(json.dumps(doc, indent=1))
    else:
        print_summary(result, doc_run)
        if full and "ranks_replayed" in result.config:
            k, n = result.config["ranks_replayed"], result.config["num_gpus"]
            click.echo(f"\nreplay           every rank node by node: {k:,} of {n:,} ranks replayed"
                       + (" (each stands for its pipeline stage: proven exact for every rank)" if k < n else ""))
    # the outputs, after the result is out: a failure to write one is its own one-line error
    from stage_cosim.files import reported_write

    if timeline is not None:
        from stage_cosim.adapters.roofline.timeline import timeline_events, write_timeline

        labels = names or [[f"node{i}" for i in p.ids] for p in programs]
        with reported_write("timeline", timeline):
            write_timeline(timeline, timeline_events(programs, rep, labels))
        if not as_json:
            click.echo(f"\ntimeline: {timeline} (open in https://ui.perfetto.dev)")
    if plot is not None:
        with reported_write("plot", plot):
            plot_stages(result, plot)
        if not as_json:
            click.echo(f"plot: {plot}")
    if not as_json:
        print_launch(launch)


def _compare_recorded(result: SimResult, recorded: SimResult) -> None:
    """The timeline's replay (node by node) against the result's (pass by pass): they agree
    to rounding where no pass overlaps the next in a way the pass-level replay cannot see;
    where they do not, the timeline says so rather than passing for the result."""
    rel = abs(recorded.step_time_s - result.step_time_s) / result.step_time_s
    if rel > 1e-9:
        click.echo(f"warning: timeline: the node-level replay it records takes {recorded.step_time_s:.6f} s per step, "
                   f"{100 * rel:.3f} % from the reported {result.step_time_s:.6f} s (the pass-level replay)", err=True)


class _progress:
    """tqdm on stderr (a terminal, not --quiet) for the phases of a replay of every rank."""

    def __init__(self, quiet: bool) -> None:
        self.show = not quiet and sys.stderr.isatty()
        self.bar = None

    def __enter__(self):  # noqa: ANN204
        return self.update if self.show else None

    def update(self, phase: str, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None or self.bar.desc != phase:
            if self.bar is not None:
                self.bar.close()
            self.bar = tqdm(total=total, desc=phase, unit="rank" if total > 1 else "", leave=False,
                            dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        if self.bar is not None:
            self.bar.close()
