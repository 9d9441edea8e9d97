"""``stage-cosim synth``: write one trace per rank, the communicator groups and a manifest."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from tqdm import tqdm

from stage_cosim.files import check_output_folder, reported_write
from stage_cosim.hardware import resolve_cluster
from stage_cosim.cli.options import (
    inference_options, model_options, parallel_options, resolve_inference_options, resolve_model_options,
    resolve_parallel_options, warn_positions,
)
from stage_cosim.trace.formats import FORMATS

GiB = 1 << 30


@click.command()
@model_options
@parallel_options
@inference_options
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output directory.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="chakra", show_default=True,
              help="Chakra protobuf (what ASTRA-sim reads) or the same graphs as JSON.")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
@click.option("--quiet", is_flag=True, help="No progress bar or summary.")
@click.option("--cluster", default=None, metavar="PRESET[:GPUS]|FILE.yaml",
              help="The machine the traces are for; with --dtype fp8 its GPU decides the FP8 kernels "
                   "(default: H100, as on dgx-h100).")
def synth(out: Path, fmt: str, force: bool, quiet: bool, cluster: str | None, **kw) -> None:
    """Synthesize one training step (or a prefill or decode step) as per-rank execution traces."""
    from stage_cosim.manifest import build_manifest
    from stage_cosim.trace.writer import GROUPS_FILE, MANIFEST_FILE, TRACE_PREFIX, atomic_directory, write_traces
    from stage_cosim.workload import synthesize

    model = resolve_model_options(kw)
    inference = resolve_inference_options(kw)
    parallel = resolve_parallel_options(kw)
    check_output_folder(out, "out", force)        # before the work, not after it
    t0 = time.perf_counter()
    # the GPU decides the FP8 kernels (the recipe default, transposed copies)
    machine = resolve_cluster(cluster, parallel.world_size) if cluster else None
    workload = synthesize(model, parallel, machine.gpu if machine else None, inference=inference)
    parallel = workload.parallel
    show = not quiet and sys.stderr.isatty()
    with reported_write("out", out), atomic_directory(out, force) as scratch:
        with tqdm(total=workload.world_size, unit="rank", disable=not show, desc="writing") as bar:
            stats = write_traces(workload, scratch, fmt, progress=bar.update)
        manifest = build_manifest(workload, fmt=fmt, prefix=TRACE_PREFIX, groups_file=GROUPS_FILE,
                                  files=stats.files, bytes_written=stats.bytes_written, cluster=machine)
        text = json.dumps(manifest, indent=1, sort_keys=False) + "\n"
        (scratch / MANIFEST_FILE).write_text(text)
        # what this command wrote: the traces, the group file and the manifest itself
        written = (stats.files + 1, stats.bytes_written + len(text.encode()))
    elapsed = time.perf_counter() - t0
    if not quiet:
        print_summary(model, parallel, manifest, out, elapsed, written)
    warn_positions(model, parallel, inference)       # as simulate warns: with the result, once


def print_summary(model, parallel, manifest: dict, out: Path, elapsed: float,  # noqa: ANN001
                  written: tuple[int, int] | None = None) -> None:
    """What 'synth' prints (also 'remote synth'): the run, the files, and per stage the costs.
    ``written``: (files, bytes) in the output folder (default: the manifest's counts, which
    cannot count the manifest itself, plus the manifest file)."""
    counts = manifest["counts"]
    files, nbytes = written or (counts["files"] + 1, counts["bytes_written"])
    cp = f" cp{parallel.cp}({parallel.cp_comm})" if parallel.cp > 1 else ""
    mbs = parallel.num_microbatches
    inf = manifest.get("inference")
    step = (f"{inf['phase']} of {inf['batch']} requests, {parallel.num_microbatches} micro-batches per replica, "
            f"{inf['weight_dtype']} weights{', attention-dp' if inf['attention_dp'] else ''}"
            if inf else f"{mbs} micro-batch{'es' if mbs != 1 else ''} per rank, schedule {parallel.schedule}")
    click.echo(f"{model.name}: {parallel.world_size} ranks (dp{parallel.dp} tp{parallel.tp}{cp} pp{parallel.pp}"
               f"{f' vp{parallel.vp}' if parallel.vp > 1 else ''}"
               f"{f'; experts ep{parallel.ep} expert-tp{parallel.expert_tp} edp{parallel.edp}' if model.is_moe else ''}"
               f"), {step}")
    click.echo(f"wrote {files} files, {nbytes / 2**20:.1f} MiB to {out} in {elapsed:.2f} s")
    click.echo(f"{'stage':>5} {'layers':>9} {'nodes':>7} {'TFLOP':>9} {'comm GiB':>9} {'memory GiB':>11}  "
               "(weights/grads/optimizer/activations/workspace/KV cache)")
    for s in manifest["roles"]:
        mem = s["peak_memory_bytes"]
        comm = sum(v for g in s["comm_bytes"].values() for k, v in g.items() if k != "RECV")
        layers = f"{s['layers'][0]}-{s['layers'][1]}" if s["layers"] else "-"
        parts = "/".join(f"{mem.get(k, 0) / GiB:.1f}" for k in ("weights", "gradients", "optimizer", "activations",
                                                                "workspace", "kv_cache"))
        click.echo(f"{s['stage']:>5} {layers:>9} {sum(s['nodes'].values()):>7} {s['flops'] / 1e12:>9.1f} "
                   f"{comm / GiB:>9.2f} {mem['total'] / GiB:>11.2f}  ({parts})")
