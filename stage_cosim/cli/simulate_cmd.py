"""``stage-cosim simulate``: step time, memory and where the time goes, on a cluster."""

from __future__ import annotations

import json
from pathlib import Path

import click

from stage_cosim.cli.astra_cmd import settings_from, with_astra_options
from stage_cosim.cli.options import (
    cluster_option, inference_options, model_options, parallel_options, resolve_inference_options,
    resolve_model_options, resolve_parallel_options,
)
from stage_cosim.errors import UserError
from stage_cosim.result import SimResult

GiB = 1 << 30



# An inference step's weights (--weight-dtype), as the precision line says them.
WEIGHTS = {"bf16": "bf16 weights and GEMMs",
           "fp8": "fp8 weights (W8A8: FP8 GEMMs, activations quantized per tensor as they come)",
           "int4": "int4 weights (W4A16: 4 bits and a scale per 128 weights, dequantized in BF16 GEMMs)"}


def describe_precision(p: dict) -> str:
    """One line: "bf16", or "fp8 delayed (hybrid), FP8 attention, FP8 parameters"."""
    if p.get("dtype", "bf16") != "fp8":
        return p.get("dtype", "bf16")
    extras = [label for key, label in (("attention", "FP8 attention"), ("param_gather", "FP8 parameters"),
                                       ("dispatch", "FP8 dispatch"), ("te_layernorm_mlp", "TE LayerNormMLP"))
              if p.get(key)]
    layout = "transposed FP8 copies" if p.get("transposes") else "no transposes"
    return ", ".join([f"fp8 {p.get('recipe')} ({p.get('format')}, {layout})", *extras])
def _experts_line(par: dict) -> str:
    cap = par.get("moe_capacity_factor")
    drop = par.get("moe_dropped_fraction") or 0.0
    routing = "dropless" if cap is None else f"capacity factor {cap}"
    if drop:
        routing += f", {100 * drop:.1f} % of its tokens dropped"
    return (f"ep{par['ep']} expert-tp{par['expert_tp']} edp{par['edp']} {par['moe_token_dispatcher']} dispatcher;"
            f" busiest expert rank at {par['moe_load']:.2f}x the mean ({routing})")


def print_summary(r: SimResult) -> None:
    cfg = r.config
    par = cfg.get("parallel") or {}
    inf = r.inference
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
    click.echo(f"MFU / HFU        {100 * r.mfu:.1f} % / {100 * r.hfu:.1f} % of BF16 peak   ({r.flop_convention})")
    if r.mfu_fp8 is not None:
        fmt = "MXFP8" if r.precision.get("recipe") == "mxfp8" else "FP8"
        click.echo(f"{'MFU (' + fmt + ' peak)':<17}{100 * r.mfu_fp8:.1f} %")
    click.echo(f"precision        {WEIGHTS[inf['weight_dtype']] if inf else describe_precision(r.precision)}")
    if inf:
        click.echo(f"HBM traffic      {inf['bytes_read'] / 1e9:,.2f} GB read (weights per micro-batch, KV cache), "
                   f"MBU {100 * inf['mbu']:.1f} %")
        click.echo(f"KV cache         {inf['kv_cache_bytes_per_gpu'] / GiB:.2f} GiB per GPU, "
                   f"{inf['kv_cache_bytes_per_token_per_gpu'] / 1024:.1f} KiB per token per GPU ({inf['kv_cache_dtype']})")
    fits = "fits" if r.fits_in_memory else "DOES NOT FIT"
    click.echo(f"peak memory      {r.peak_memory_bytes / GiB:.1f} GiB of {r.memory_capacity_bytes / GiB:.0f} GiB ({fits})")
    if par:
        training = "" if inf else (f"{' vp' + str(par['vp']) if par.get('vp', 1) > 1 else ''}"
                                   f"{' sp' if par.get('sp') else ''} zero{par['zero']} recompute={par['recompute']}"
                                   f" micro-batch {par['micro_batch']} x {par['num_microbatches']}")
        cp = f" cp{par['cp']}({par['cp_comm']})" if par.get("cp", 1) > 1 else ""
        training += " attention-dp" if inf and inf.get("attention_dp") else ""
        click.echo(f"configuration    dp{par['dp']} tp{par['tp']}{cp} pp{par['pp']}{training}"
                   f" on {cfg['num_gpus']} x {cfg['cluster']['gpu']['name']} ({cfg['network_model']} network)")
        if (cfg.get("model") or {}).get("num_experts"):
            click.echo(f"experts          {_experts_line(par)}")
    keys = [k for k in r.breakdown if any(role.breakdown.get(k) for role in r.roles)]
    click.echo("")
    click.echo(f"{'stage':>5} {'finish s':>9} " + " ".join(f"{k.replace('exposed_', 'exp_'):>12}" for k in keys)
               + f" {'mem GiB':>8}")
    for role in r.roles:
        click.echo(f"{role.stage:>5} {role.finish_s:>9.4f} " + " ".join(f"{role.breakdown[k]:>12.4f}" for k in keys)
                   + f" {role.peak_memory_bytes / GiB:>8.1f}")


@click.command()
@model_options
@parallel_options
@inference_options
@cluster_option
@click.option("--network-model", type=click.Choice(["calibrated", "astra"]), default="calibrated", show_default=True,
              help="calibrated: NCCL-like real clusters; astra: ASTRA-sim's congestion-unaware analytical model.")
@click.option("--traces", type=click.Path(path_type=Path), default=None,
              help="Simulate these Chakra traces (any generator; a trace directory or an export's run "
                   "directory) instead of synthesizing.")
@click.option("--comm-groups", type=click.Path(path_type=Path), default=None,
              help="--traces: the communicator-group file (default: comm_groups.json beside the traces or above).")
@click.option("--full", is_flag=True, help="Replay every rank instead of one rank per pipeline stage.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--timeline", type=click.Path(path_type=Path), default=None,
              help="Write a Chrome/Perfetto trace (ui.perfetto.dev) of the simulated ranks.")
@click.option("--backend", type=click.Choice(["roofline", "astra-sim"]), default="roofline", show_default=True,
              help="Our analytical simulator, or a user's ASTRA-sim binary.")
@click.option("--astra-sim", "astra_bin", default=None, metavar="PATH",
              help="ASTRA-sim binary (default: $ASTRA_SIM_BIN, then AstraSim_Analytical_Congestion_Unaware on PATH).")
@click.option("--keep", type=click.Path(path_type=Path), default=None,
              help="astra-sim backend: keep the run directory here.")
@click.option("--timeout", type=float, default=3600.0, show_default=True, help="astra-sim backend: seconds.")
@with_astra_options
def simulate(cluster: str, network_model: str, traces: Path | None, comm_groups: Path | None, full: bool,
             as_json: bool, timeline: Path | None, backend: str, astra_bin: str | None, keep: Path | None,
             timeout: float, compute_mode: str, **kw) -> None:
    """Simulate one training step with the built-in analytical simulator (or ASTRA-sim)."""
    from stage_cosim.adapters.roofline.simulate import simulate as run, simulate_traces
    from stage_cosim.adapters.roofline.timeline import timeline_events, write_timeline
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.workload import synthesize

    settings = settings_from(kw)
    model = resolve_model_options(kw)
    inference = resolve_inference_options(kw)
    parallel = resolve_parallel_options(kw)
    if backend == "astra-sim":
        from stage_cosim.adapters.astra_sim.backend import simulate_astra_sim

        if traces is not None or timeline is not None:
            raise UserError("backend", "--traces and --timeline work with the roofline backend only")
        machine = resolve_cluster(cluster, parallel.world_size)
        result = simulate_astra_sim(synthesize(model, parallel, machine.gpu, inference=inference), machine,
                                    binary=astra_bin, mode=compute_mode, settings=settings, keep=keep,
                                    timeout_s=timeout)
        click.echo(json.dumps(result.to_dict(), indent=1)) if as_json else print_summary(result)
        return
    if traces is not None:
        from stage_cosim.trace.traceset import locate

        if inference is not None:
            raise UserError("phase", "--traces simulates the traces as they are (the phase is theirs)")
        n = len(locate(traces, comm_groups).files)
        result, rep, programs = simulate_traces(traces, resolve_cluster(cluster, n), network_model,
                                                comm_groups=comm_groups, astra_settings=settings,
                                                compute_mode=compute_mode, symmetric=not full)
        for warning in result.config.get("warnings", []):
            click.echo(f"warning: {warning}", err=True)
        names = None
    else:
        machine = resolve_cluster(cluster, parallel.world_size)
        workload = synthesize(model, parallel, machine.gpu, inference=inference)
        # a timeline needs every node's times: replay node by node then
        result, rep, programs = run(workload, machine, network_model,
                                    symmetric=not full, exact=True if timeline is not None else None,
                                    astra_settings=settings, compute_mode=compute_mode)
        names = [[n.name for n in workload.role(workload.role_of(p.rank)).nodes] for p in programs or []]
    if timeline is not None:
        labels = names or [[f"node{i}" for i in p.ids] for p in programs]
        write_timeline(timeline, timeline_events(programs, rep, labels))
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        print_summary(result)
        if timeline is not None:
            click.echo(f"\ntimeline: {timeline} (open in https://ui.perfetto.dev)")
