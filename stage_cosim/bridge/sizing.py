"""At least how much memory a job needs, from closed-form counts: no graph is built.

A server refuses at submit the jobs that cannot be simulated within its per-job memory limit
(``serve --max-job-memory-mib``), instead of letting a worker grow until the limit stops it. The
figure is a *lower bound* — refusing on it is never wrong; a job that passes and still outgrows
the limit fails with a one-line memory error — built from what synthesis creates:

* every layer has at least ``NODES_PER_LAYER_PASS`` nodes in each of its forward and backward
  pass templates (measured 14.4–24.7 over the presets' architectures, tp, sp, recomputation,
  ZeRO-3, interleaving);
* the simulator works through each template once, at ``TEMPLATE_NODE_BYTES`` per node plus
  ``TEMPLATE_NODE_BYTES_PER_STAGE_LAYER`` for every layer of the pipeline stage (its step end
  ties each block to the others: measured 1.05 kB at 64 layers, 1.9 kB at 256, 5.3 kB at 1,024);
* every micro-batch places every template, one list slot per node (``SLOT_BYTES``, measured
  17 B), created as a full node (``NODE_BYTES``, measured 300–400 B) when the job writes traces,
  a timeline or replays every rank;
* every rank costs ``RANK_BYTES``: its place in the mesh's groups and in the simulator's
  per-rank state (measured 42–84 B per rank — peak resident memory of ``api.simulate`` for
  2^16–2^19 ranks, tp 1–8, pp 1–4, ZeRO 0–1 — so a mesh of millions of ranks needs hundreds of
  megabytes however small its model);
* the worker process itself, with the library imported, holds ``WORKER_BYTES`` of address
  space before any job (measured 137 MB), which the per-job limit includes;
* a serving simulation holds at least ``REQUEST_BYTES`` per request of its stream (measured
  about 350 B per request for ``api.serve_sim``).

(The measurements: Python's allocation peak, ``tracemalloc``, of ``api.simulate`` and of the
materialized role graphs of shortened llama3-8b and gpt3-175b models, and peak resident memory
for the per-rank and per-request terms; the constants sit below every measured value.)
"""

from __future__ import annotations

import math

from stage_cosim.errors import UserError

NODES_PER_LAYER_PASS = 12
TEMPLATE_NODE_BYTES = 700
TEMPLATE_NODE_BYTES_PER_STAGE_LAYER = 1.5
SLOT_BYTES = 16
NODE_BYTES = 250
RANK_BYTES = 32
WORKER_BYTES = 128 << 20
REQUEST_BYTES = 64
GIB = 1 << 30


def job_bytes(layers: int, pp: int, micro_batches: int, ranks: int, materialized: bool) -> float:
    """The lower bound for ``layers`` layers on ``pp`` stages, ``micro_batches`` per pipeline."""
    template_nodes = 2 * NODES_PER_LAYER_PASS * layers
    per_template_node = TEMPLATE_NODE_BYTES + TEMPLATE_NODE_BYTES_PER_STAGE_LAYER * math.ceil(layers / max(1, pp))
    slots = template_nodes * micro_batches
    return (WORKER_BYTES + template_nodes * per_template_node
            + slots * (SLOT_BYTES + (NODE_BYTES if materialized else 0)) + ranks * RANK_BYTES)


def check_fits(layers: int, pp: int, micro_batches: int, ranks: int, materialized: bool, limit_bytes: int,
               rank_field: str = "dp") -> None:
    """Refuse, naming the factor that dominates, a job whose lower bound exceeds ``limit_bytes``."""
    if limit_bytes <= 0:
        return
    need = job_bytes(layers, pp, micro_batches, ranks, materialized)
    if need <= limit_bytes:
        return
    alone = {"layers": job_bytes(layers, pp, 1, 1, materialized) - WORKER_BYTES,
             "global_batch": job_bytes(1, 1, micro_batches, 1, materialized) - WORKER_BYTES,
             "ranks": ranks * RANK_BYTES}
    field = max(alone, key=alone.get)      # type: ignore[arg-type]
    if field == "ranks":
        field = rank_field
    raise UserError(field, f"{layers:,} layers on {pp} pipeline stages, {micro_batches:,} micro-batches per "
                           f"pipeline and {ranks:,} ranks need at least {need / GIB:,.1f} GiB of memory to "
                           f"simulate; this server allows {limit_bytes / GIB:,.1f} GiB per job")


def check_requests_fit(requests: int, field: str, limit_bytes: int) -> None:
    """Refuse a serving simulation whose request stream alone exceeds ``limit_bytes``."""
    if limit_bytes <= 0:
        return
    need = WORKER_BYTES + requests * REQUEST_BYTES
    if need > limit_bytes:
        raise UserError(field, f"{requests:,} requests need at least {need / GIB:,.1f} GiB of memory to simulate; "
                               f"this server allows {limit_bytes / GIB:,.1f} GiB per job")
