"""``stage-cosim serve-sim``: a serving engine on a cluster under a request stream."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from stage_cosim.api import DEFAULT_REQUEST_TIMEOUT_S
from stage_cosim.cli.options import model_options
from stage_cosim.errors import UserError
from stage_cosim.fielddocs import field_docs
from stage_cosim.files import FIGURE_SUFFIXES, check_output
from stage_cosim.inference.config import FP8_ACTIVATION_SCALES, KV_CACHE_DTYPES, WEIGHT_DTYPES, InferenceConfig
from stage_cosim.parallel.config import DEFAULT_AXIS_ORDER, TOKEN_DISPATCHERS, ParallelConfig
from stage_cosim.serving.config import ROUTING, SLO, ServingConfig
from stage_cosim.serving.engines import engine_names
from stage_cosim.serving.requests import LENGTH_DISTRIBUTIONS, RequestStream
from stage_cosim.serving.steptime import DEFAULT_RESOLUTION

GiB = 1 << 30
SWEEP = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)     # --plot without --rates: these multiples of --rate


# Each flag that sets a field of a configuration dataclass shows that field's docstring as its
# help (one text for the flag, config files, JSON and docs), then what only the flag says: its
# default (the field's own, the engine profile's, or the one the request fills in).
def _shown(value: object) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) \
        else str(value)


def _field_help(cls: type, name: str, default: bool) -> str:
    return field_docs(cls)[name] + (f" Default {_shown(getattr(cls, name))}." if default else "")


def _serving(name: str, default: bool = False) -> str:
    return _field_help(ServingConfig, name, default)


def _engine_set(name: str) -> str:
    """A ServingConfig field an engine profile sets (--engine): its default is the engine's."""
    return field_docs(ServingConfig)[name] + \
        f" Default: the engine's; {_shown(getattr(ServingConfig, name))} without --engine."


def _stream(name: str, default: bool = False) -> str:
    return _field_help(RequestStream, name, default)


def _slo(name: str) -> str:
    return field_docs(SLO)[name]


def _parallel(name: str) -> str:
    return field_docs(ParallelConfig)[name]


def _of_instance(name: str) -> str:
    """A degree of ParallelConfig, which in a serving run is one instance's."""
    return _parallel(name).rstrip(".") + " of one instance."


def _inference(name: str) -> str:
    return field_docs(InferenceConfig)[name]


def _ms(v: float | None) -> str:
    return f"{1e3 * v:>9.1f}" if v is not None else f"{'-':>9}"


def print_report(r: dict[str, Any]) -> None:
    dep, inst, wl = r["deployment"], r["deployment"]["instance"], r["workload"]
    pools = ", ".join(f"{p['instances']} {role} instance{'s' if p['instances'] > 1 else ''}"
                      for role, p in dep["pools"].items())
    layout = f"tp{inst['tp']} pp{inst['pp']}" + (f" ep{inst['ep']}" if inst["ep"] > 1 else "")
    if inst["attention_ranks"] > 1:
        layout += f" attention-dp{inst['attention_ranks']}"
    click.echo(f"deployment       {pools} of {layout} ({inst['gpus']} GPUs each, {dep['gpus']} GPUs)")
    sv = r["serving"]
    click.echo(f"engine           {r.get('engine', 'settings as given')}: max-num-seqs {sv['max_num_seqs']}, "
               f"{sv['chunk_tokens']} tokens per step{' (chunked prefill)' if sv['enable_chunked_prefill'] else ' (whole prompts)'}, "
               f"overhead {1e3 * sv['step_overhead_s']:.2f} ms per step, {1e3 * sv['request_overhead_s']:.1f} ms per request")
    click.echo(f"memory per GPU   weights {inst['weights_bytes_per_gpu'] / GiB:.1f} GiB, working set "
               f"{inst['workspace_bytes_per_gpu'] / GiB:.1f} GiB, KV cache {inst['kv_capacity_bytes_per_gpu'] / GiB:.1f} GiB"
               + (f" = {inst['kv_capacity_tokens_per_rank']:,} tokens per attention rank"
                  if inst["kv_capacity_tokens_per_rank"] is not None else
                  # a pure state-space model caches no tokens: each sequence's fixed state limits admission
                  f" = the state of {inst['state_capacity_sequences_per_rank']:,} sequences per attention rank "
                  f"({inst['state_bytes_per_sequence_per_gpu'] / 2**20:,.1f} MiB each per GPU, whatever their length)"))
    req = r["requests"]
    src = (f"Poisson at {wl['rate']:g}/s" if "rate" in wl else "from a trace") + \
        f", input {wl['input_len_mean']:,.0f} / output {wl['output_len_mean']:,.0f} tokens on average"
    click.echo(f"requests         {req['total']:,} ({src})")
    click.echo(f"completed        {req['completed']:,} in {r['duration_s']:,.1f} s ({req['rejected']} rejected: too long "
               f"for the KV cache; {req['preempted']} preempted {req['preemptions']} times)")
    timeout = r["serving"]["request_timeout_s"]
    click.echo(f"dropped          {req['dropped']:,} " + (f"(not finished {timeout:g} s after arriving: the client gave up)"
                                                         if timeout else "(no client timeout)"))
    if r["serving"]["enable_prefix_caching"]:
        pc = r["prefix_cache"]
        click.echo(f"prefix cache     {100 * pc['hit_rate']:.1f} % of prompt tokens hit ({pc['hit_tokens']:,} of "
                   f"{pc['queried_tokens']:,}); {pc['evicted_blocks']:,} blocks evicted")
    if r["serving"].get("kv_offloading_size"):
        off, link = r["kv_offload"], inst["host_to_device_GBps"]
        click.echo(f"KV offload       {r['serving']['kv_offloading_size']:g} GiB of host memory: "
                   f"{off['hit_tokens']:,} hit tokens from it; {off['stored_blocks']:,} blocks stored, "
                   f"{off['loaded_blocks']:,} loaded back at {link:g} GB/s ({off['load_time_s']:.3f} s of steps)")
    t = r["throughput"]
    click.echo(f"throughput       {t['requests_per_s']:,.2f} requests/s, {t['output_tokens_per_s']:,.0f} output tokens/s "
               f"({t['output_tokens_per_s_per_gpu']:,.0f} per GPU), {t['total_tokens_per_s']:,.0f} tokens/s in all")
    click.echo("")
    click.echo(f"{'latency (ms)':<16} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}")
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end to end")):
        st = r["latency_s"][key]
        click.echo(f"{label:<16} " + " ".join(_ms(st[k]) for k in ("mean", "p50", "p90", "p99", "max")))
    click.echo("")
    slo = r["slo"]
    targets = [f"TTFT <= {1e3 * slo['ttft_s']:g} ms" if slo["ttft_s"] else "",
               f"TPOT <= {1e3 * slo['tpot_s']:g} ms" if slo["tpot_s"] else ""]
    targets = [x for x in targets if x]
    click.echo(f"SLO              {' and '.join(targets) if targets else 'none given (every completed request counts)'}: "
               f"{100 * slo['attainment']:.1f} % met, goodput {slo['goodput_requests_per_s']:,.2f} requests/s "
               f"({slo['goodput_requests_per_s_per_gpu']:,.3f} per GPU)")
    kv = r["kv_cache"]
    click.echo(f"KV cache         peak {100 * kv['peak_occupancy']:.1f} %, mean {100 * kv['mean_occupancy']:.1f} % of capacity")
    s, st = r["steps"], r["step_times"]
    mean_ms = 1e3 * (s["time_s"]["mean"] or 0)
    click.echo(f"steps            {s['count']:,} (mean {mean_ms:.2f} ms, {s['decodes_per_step']['mean'] or 0:.1f} decodes); "
               f"{st['cached_shapes']:,} step shapes simulated ({st['mode']}"
               f"{': ' + st['reason'] if st.get('reason') else ''})")
    ll = r["littles_law"]
    click.echo(f"Little's law     {ll['in_system_mean']:.2f} requests in the system on average; arrival rate x time in "
               f"system = {ll['rate_times_time']:.2f} ({100 * ll['relative_error']:.2f} % apart)")


def plot_sweep(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stage_cosim.files import save_figure

    rates = [r["rate"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, label in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for pct, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(rates, [1e3 * (r["latency_s"][key][pct] or float("nan")) for r in runs], style, label=pct)
        target = runs[0]["slo"][f"{key}_s"]
        if target:
            ax.axhline(1e3 * target, color="tab:red", lw=1, label="SLO")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_yscale("log")
        ax.legend()
    axes[2].plot(rates, [r["throughput"]["requests_per_s"] for r in runs], "o-", label="throughput")
    axes[2].plot(rates, [r["slo"]["goodput_requests_per_s"] for r in runs], "s--", label="goodput (SLOs met)")
    axes[2].plot(rates, rates, color="lightgray", lw=1, label="offered")
    axes[2].set_xlabel("arrival rate (requests/s)")
    axes[2].set_ylabel("requests/s")
    axes[2].legend()
    fig.suptitle("Latency and goodput against load")
    fig.tight_layout()
    save_figure(fig, path)


@click.command("serve-sim")
@model_options
@click.option("--cluster", default="dgx-h100", show_default=True, metavar="PRESET[:GPUS]|FILE.yaml",
              help="Cluster (default GPU count: the deployment's, dp*tp*pp or the two pools).")
@click.option("--tp", type=int, default=1, show_default=True, help=_of_instance("tp"))
@click.option("--pp", type=int, default=1, show_default=True, help=_of_instance("pp"))
@click.option("--dp", type=int, default=1, show_default=True,
              help=_parallel("dp").rstrip(".") + ": model replicas (instances); with --attention-dp, attention "
                   "ranks of one instance.")
@click.option("--ep", type=int, default=1, show_default=True, help=_parallel("ep"))
@click.option("--expert-tp", "expert_tp", type=int, default=None, help=_parallel("expert_tp"))
@click.option("--attention-dp/--no-attention-dp", "attention_dp", default=None,
              help=_inference("attention_dp") + " With it, one instance over dp*tp*pp GPUs.")
@click.option("--moe-token-dispatcher", "moe_token_dispatcher", type=click.Choice(TOKEN_DISPATCHERS), default=None,
              help=_parallel("moe_token_dispatcher"))
@click.option("--axis-order", "axis_order", default=None,
              help=_parallel("axis_order") + f" Default {','.join(DEFAULT_AXIS_ORDER)}.")
@click.option("--weight-dtype", "weight_dtype", type=click.Choice(WEIGHT_DTYPES), default=None,
              help=_inference("weight_dtype"))
@click.option("--kv-cache-dtype", "kv_cache_dtype", type=click.Choice(KV_CACHE_DTYPES), default=None,
              help=_inference("kv_cache_dtype"))
@click.option("--fp8-activation-scale", "fp8_activation_scale", type=click.Choice(FP8_ACTIVATION_SCALES), default=None,
              help=_inference("fp8_activation_scale"))
@click.option("--two-batch-overlap", "two_batch_overlap", is_flag=True, default=None,
              help=_inference("two_batch_overlap"))
@click.option("--rate", type=float, default=None, help=_stream("rate"))
@click.option("--num-requests", "num_requests", type=int, default=None, help=_stream("num_requests", default=True))
@click.option("--input-len", "input_len", type=int, default=None, help=_stream("input_len", default=True))
@click.option("--output-len", "output_len", type=int, default=None, help=_stream("output_len", default=True))
@click.option("--lengths", type=click.Choice(LENGTH_DISTRIBUTIONS), default=None,
              help=_stream("lengths", default=True))
@click.option("--length-spread", "length_spread", type=float, default=None, help=_stream("spread", default=True))
@click.option("--seed", type=int, default=None, help=_stream("seed", default=True))
@click.option("--prefix-len", "prefix_len", type=int, default=None, help=_stream("prefix_len"))
@click.option("--prefix-groups", "prefix_groups", type=int, default=None, help=_stream("prefix_groups", default=True))
@click.option("--trace", type=click.Path(path_type=Path), default=None,
              help="Requests from a file: CSV with arrival_s,input_len,output_len[,hash_ids], or JSON lines "
                   "(Mooncake traces as they are).")
@click.option("--engine", type=click.Choice(engine_names()), default=None,
              help="Engine release profile: its scheduler defaults and host overheads (default: the settings as given).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", "enable_prefix_caching", default=None,
              help=_engine_set("enable_prefix_caching"))
@click.option("--cuda-graph-sizes", "cuda_graph_sizes", default=None, metavar="N,N,...",
              help=_serving("cuda_graph_sizes"))
@click.option("--kv-offloading-size", "kv_offloading_size", type=float, default=None, metavar="GIB",
              help=_serving("kv_offloading_size", default=True))
@click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", "enable_chunked_prefill", default=None,
              help=_engine_set("enable_chunked_prefill"))
@click.option("--guaranteed-no-evict/--no-guaranteed-no-evict", "guaranteed_no_evict", default=None,
              help=_engine_set("guaranteed_no_evict"))
@click.option("--request-timeout", "request_timeout", type=float, default=None,
              help=_serving("request_timeout_s") + f" Default {DEFAULT_REQUEST_TIMEOUT_S:g}; 0: no timeout.")
@click.option("--request-overhead", "request_overhead", type=float, default=None,
              help=_engine_set("request_overhead_s"))
@click.option("--requests-out", "requests_out", type=click.Path(path_type=Path), default=None,
              help="Write every request's arrival, first token, finish, tokens and drop to this CSV.")
@click.option("--max-num-seqs", "max_num_seqs", type=int, default=None, help=_engine_set("max_num_seqs"))
@click.option("--chunk-tokens", "chunk_tokens", type=int, default=None, help=_engine_set("chunk_tokens"))
@click.option("--kv-block-size", "kv_block_size", type=int, default=None, help=_serving("kv_block_size", default=True))
@click.option("--hbm-utilization", "hbm_utilization", type=float, default=None,
              help=_serving("hbm_utilization", default=True))
@click.option("--step-overhead", "step_overhead", type=float, default=None, help=_engine_set("step_overhead_s"))
@click.option("--step-resolution", "step_resolution", type=float, default=None,
              help=_serving("step_resolution") + f" Default 1/{round(1 / DEFAULT_RESOLUTION)}.")
@click.option("--prefill-gpus", "prefill_gpus", type=int, default=None, help=_serving("prefill_gpus"))
@click.option("--decode-gpus", "decode_gpus", type=int, default=None, help=_serving("decode_gpus"))
@click.option("--routing", type=click.Choice(ROUTING), default=None, help=_serving("routing", default=True))
@click.option("--slo-ttft", "slo_ttft", type=float, default=None, help=_slo("ttft_s"))
@click.option("--slo-tpot", "slo_tpot", type=float, default=None, help=_slo("tpot_s"))
@click.option("--rates", default=None, metavar="R,R,...", help="--plot: the arrival rates to sweep "
              f"(default {', '.join(f'{x:g}' for x in SWEEP)} x --rate).")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Draw latency and goodput against load (PNG, PDF or SVG).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def serve_sim(plot: Path | None, as_json: bool, quiet: bool, rates: str | None, **kw: Any) -> None:
    """Simulate serving a request stream: latency percentiles, throughput, goodput under SLOs.

    Continuous batching with chunked prefill and a paged KV cache bounded by HBM, on every
    instance of the cluster (or disaggregated prefill and decode pools); step times from the
    simulator."""
    from tqdm import tqdm

    from stage_cosim import api

    check_output(plot, "plot", FIGURE_SUFFIXES)
    req = {k: v for k, v in kw.items() if v is not None and k not in ("arch",)}
    if req.get("requests_out") is not None:
        req["requests_out"] = str(req["requests_out"])
    if kw.get("arch") is not None:
        raise UserError("arch", "serve-sim takes a model by --model (a preset or config.json)")
    if plot is not None:
        if rates is None and req.get("rate") is None:
            raise UserError("plot", "sweeps the arrival rate: give --rate (or --rates)")
        req["rates"] = rates or ",".join(f"{f * req['rate']:g}" for f in SWEEP)
    elif rates is not None:
        raise UserError("rates", "is the sweep of --plot")
    show = not quiet and sys.stderr.isatty()
    with tqdm(disable=not show, unit="req", desc="serve-sim", dynamic_ncols=True, leave=False) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        report = api.serve_sim(req, progress=progress)
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        print_report(report)
    for warning in report.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    if plot is not None:
        try:
            plot_sweep(report["runs"], plot)
        except OSError as exc:
            raise UserError("plot", f"{plot}: could not be written ({exc.strerror or exc})") from None
        if not as_json:
            click.echo(f"plot             {plot} (latency against load, {len(report['runs'])} rates)")
