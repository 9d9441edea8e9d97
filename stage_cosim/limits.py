"""Sizes the tool computes, and the limits past which it refuses rather than runs out of memory."""

from __future__ import annotations

# The largest world (dp*tp*cp*pp ranks, a cluster's GPUs) the tool takes. Its memory grows with
# the ranks: the simulator lists the ranks of every communication group (about a hundred bytes a
# rank: a simulation at this limit peaks at about 170 MiB, `python benchmarks/world_limit.py`;
# gigabytes a thousand times further), and synth and export write one trace file per rank (a
# million files here). 2^20 is five times the largest GPU clusters built so far.
MAX_RANKS = 1 << 20
MAX_RANKS_TEXT = f"{MAX_RANKS:,} (2^20) this tool simulates (it lists every rank of each communication group)"
