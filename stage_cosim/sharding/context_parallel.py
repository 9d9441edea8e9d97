"""Fused attention's rule, and its exchange of keys and values over context parallelism.

Under cp every op runs on its own piece of the sequence, but attention's keys and values span
all of it. With neither a ring nor all-to-alls (``cp_ring`` = ``cp_a2a`` = 1) the generic
placement rules gather K and V over cp; otherwise the exchange (:func:`_attention_exchange`,
Transformer Engine's context-parallel attention) passes them round a ring of ranks
(:func:`ring_steps`: each step's share of the work and its kernel's shape) and swaps heads for
sequence by all-to-all inside groups of ranks. :func:`attention_rows` is the rows of work a
fused attention kernel splits over its thread blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy as sp

from stage_cosim.graph.cost import op_flops
from stage_cosim.graph.dims import DTYPE_BYTES, degree_symbol
from stage_cosim.graph.ir import ATTENTION_KINDS, Op, Tensor
from stage_cosim.parallel.axes import AXIS, BLOCK_AXES, group_name
from stage_cosim.sharding.layout import (
    DATA_PARALLEL, Placements, local_bytes, local_numel, local_size, on_mesh,
)
from stage_cosim.sharding.placement import PARTIAL, REPLICATE, Collective, Placement, Shard
from stage_cosim.sharding.redistribute import PassState
from stage_cosim.sharding.rules import Rule, choose, operands, register
from stage_cosim.sharding.steps import Step


@register(*ATTENTION_KINDS)
class Attention(Rule):
    """Fused (flash) attention and its backward: the generic rule, with the kernel's own shape,
    unless the policy exchanges the keys and values over cp."""

    matmul = True
    key_share = 1.0

    def run(self, pas: PassState, op: Op, phase: str) -> None:
        if pas.policy.cp_ring > 1 or pas.policy.cp_a2a > 1:
            _attention_exchange(pas, op, phase)
        else:
            super().run(pas, op, phase)

    def flops(self, pas: PassState, op: Op, flops: sp.Expr) -> sp.Expr:
        if not pas.policy.cp_load_balance:
            # Contiguous chunks: the last cp rank's queries see every key before them, the
            # most work of all (2 - 1/cp times the average); the step waits for it, so this
            # rank's graph is that rank's.
            flops *= 2 - 1 / degree_symbol("cp")
        return flops

    def groups(self, op: Op, local: Callable[[str], sp.Expr]) -> sp.Expr | None:
        return attention_rows(op, local)


# -- the exchange over cp ----------------------------------------------------------------------


def _step(pas: PassState, name: str, kind: str, phase: str, deps: list[int] | tuple[int, ...], *,
          category: str = "", flops: sp.Expr = sp.S.Zero, model_flops: sp.Expr = sp.S.Zero,
          mem: sp.Expr = sp.S.Zero, nbytes: sp.Expr = sp.S.Zero, peer: int = 0, pair: int = -1,
          matmul: str = "", key_share: float = 0.0) -> int:
    idx = len(pas.steps)
    axes = ("cp",) if kind in ("send", "recv") else ()
    pas.steps.append(Step(idx, name, phase, kind, category or group_name(axes), flops,
                          model_flops if phase != "recompute" else sp.Integer(0), mem,
                          tuple(sorted(set(deps))), axes=axes, comm_bytes=nbytes, matmul=matmul,
                          peer=peer, pair=pair, key_share=key_share))
    return idx


def _attention_exchange(pas: PassState, op: Op, phase: str) -> None:
    """Fused attention whose keys and values arrive in pieces: the one op the placement
    rules cannot express (Transformer Engine's context-parallel attention).

    The operands stay sharded on the sequence over cp. With ``cp_a2a`` > 1 the queries, keys
    and values are first swapped by all-to-all from sequence- to head-sharded inside groups
    of that many cp ranks (DeepSpeed-Ulysses; the output swaps back). With ``cp_ring`` > 1
    the remaining ranks pass K/V round a ring: at each of ``cp_ring`` steps a rank sends the
    K/V chunk it holds to the next rank and receives the previous one's while flash
    attention runs on the chunk it has; the partial outputs are merged by their log-sum-exp.
    The backward runs the ring again with K/V and dK/dV (dK/dV one step behind) and adds up
    each step's gradients. Under the load-balanced split every step costs 1/cp_ring of the
    rank's causal work; with contiguous chunks the last rank works at every step after the
    first (a diagonal half block, then whole blocks) and the ring waits for it.
    """
    pol = pas.policy
    forward = op.kind == "attention"
    cp = BLOCK_AXES.index("cp")
    labels = choose(pas, op)
    on = on_mesh(op.mesh)

    def placed(t: Tensor, letters: str, grad: bool = False) -> Placements:
        pl: list[Placement | None] = []
        for i, (l, here) in enumerate(zip(labels, on)):
            if not here:
                pl.append(None)
            elif i == cp:   # every activation keeps its own piece of the sequence (a KV cache its tokens)
                own = next((label for label in ("s", AXIS["cp"].keys) if label in t.labels), None)
                pl.append(Shard(own) if own else PARTIAL if grad else REPLICATE)
            elif l is not None and l in letters:
                pl.append(Shard(t.labels[letters.index(l)]))
            elif grad and l is not None:
                pl.append(PARTIAL)
            else:
                pl.append(REPLICATE)
        if t.kind == "weight":
            pl = [REPLICATE if dpar and p is not None else p for p, dpar in zip(pl, DATA_PARALLEL)]
        return tuple(pl)

    local_inputs: list[Tensor] = []
    ready: list[tuple[int, ...]] = []
    for t, letters in operands(op):
        lt = pas.redistribute(t, placed(t, letters), phase)
        local_inputs.append(lt)
        ready.append(pas.producers.get(lt, ()))

    local = local_size(labels)
    out_pls = [placed(o, letters, grad=not forward) for o, letters in zip(op.outputs, op.letters()[1])]
    flops, model_flops = op_flops(op, local, local_numel(op.outputs[0], out_pls[0]))
    in_bytes = [local_bytes(t, pas.placements[t]) for t in local_inputs]
    out_bytes = [local_bytes(o, pl) for o, pl in zip(op.outputs, out_pls)]
    mem = op.memory_passes * sp.Add(*in_bytes, *out_bytes)
    # forward inputs q, keys, v (and sinks); backward dout, q, keys, v, out, lse
    query = 0 if forward else 1
    keyed = list(op.key_inputs)
    kv = sp.Add(*(in_bytes[i] for i in keyed))
    q_bytes, o_bytes = in_bytes[query], out_bytes[0]
    a2a_axes = ("cp",) if pol.cp_ring == 1 else ("cp_a2a",)
    ring, stride = pol.cp_ring, pol.cp_a2a          # ring neighbours are cp_a2a coordinates apart

    def swap(indices: list[int], deps_of: list[tuple[int, ...]], nbytes: list[sp.Expr],
             what: str) -> list[tuple[int, ...]]:
        """All-to-all of the given operands (by index) inside the cp_a2a groups."""
        out = list(deps_of)
        if pol.cp_a2a > 1:
            for i in indices:
                out[i] = (pas.collective(f"{op.name}.{what}{i}.a2a_{group_name(a2a_axes)}",
                                         Collective.ALL_TO_ALL, a2a_axes, nbytes[i], deps_of[i], phase),)
        return out

    # forward: q, k, v to head-sharded; backward: dout (q, k, v and out were saved head-sharded)
    ready = swap([query, *keyed] if forward else [0], ready, in_bytes, "in")
    everything = sorted({d for r in ready for d in r})
    kv_ready = sorted({d for i in keyed for d in ready[i]})
    # each step's work and kernel shape; the graph is the last cp rank's (see ring_steps)
    steps = ring_steps(ring - 1, ring, pol.cp_load_balance, forward)
    rows = attention_rows(op, local, keys=local("s"))   # a step's keys held: a chunk, as its queries
    kernels: list[int] = []
    recvs: list[int] = []
    accums: list[int] = []
    for j in range(ring):
        if ring > 1 and (j < ring - 1 or not forward):
            if forward:
                nbytes, what = kv, "kv"
            else:   # K/V forward round the ring, dK/dV one step behind
                nbytes = kv if j == 0 else (2 * kv if j < ring - 1 else kv)
                what = "kv" if j == 0 else ("kv_dkv" if j < ring - 1 else "dkv")
            deps = kv_ready if j == 0 else [recvs[-1]] + ([] if forward else [accums[-1]])
            pair = pas.pairs
            pas.pairs += 1
            direction = 1 if forward else -1
            _step(pas, f"{op.name}.{what}_send{j}", "send", phase, deps, nbytes=nbytes,
                  peer=direction * stride, pair=pair)
            recvs.append(_step(pas, f"{op.name}.{what}_recv{j}", "recv", phase, deps, nbytes=nbytes,
                               peer=-direction * stride, pair=pair))
        deps = everything if j == 0 else [recvs[j - 1], kernels[-1]]
        kernels.append(_step(pas, f"{op.name}.step{j}" if ring > 1 else op.name, "compute", phase, deps,
                             category=op.kind, flops=flops * steps[j].work, model_flops=model_flops / ring,
                             mem=mem, matmul=op.precision or "bf16", key_share=steps[j].loop))
        if rows is not None:
            pas.steps[kernels[-1]].groups = rows * steps[j].rows
        if ring > 1 and not forward:
            # dQ += this step's dQ; dK/dV += this step's (in the buffer that travels)
            n = sp.Add(*(local_numel(op.inputs[i], pas.placements[local_inputs[i]]) for i in [query, *keyed]))
            accums.append(_step(pas, f"{op.name}.accumulate{j}", "compute", phase,
                                [kernels[-1]] + ([recvs[j - 1]] if j else []), category="pointwise",
                                flops=n, mem=n * 3 * DTYPE_BYTES["bf16"]))
    last = [kernels[-1]]
    if ring > 1 and forward:
        # merge the partial outputs by their log-sum-exp (kept until the ring is done)
        n_out = local_numel(op.outputs[0], out_pls[0])
        n_lse = local_numel(op.outputs[1], out_pls[1])
        for j in range(ring):
            last = [_step(pas, f"{op.name}.merge{j}", "compute", phase, last, category="pointwise",
                          flops=3 * n_out, mem=n_out * (DTYPE_BYTES["bf16"] + 2 * DTYPE_BYTES["fp32"])
                          + n_lse * 3 * DTYPE_BYTES["fp32"])]
    done = tuple(accums[-1:] or last)
    # dK, dV: the last step's gradients and the ring's returning buffer
    outs = [tuple(sorted(set(done) | {recvs[-1]})) if not forward and ring > 1 and i in op.key_outputs
            else done for i in range(len(op.outputs))]
    outs = swap([0] if forward else [0, *op.key_outputs], outs, out_bytes, "out")
    for o, pl, deps in zip(op.outputs, out_pls, outs):
        pas.placements[o] = pl
        pas.producers[o] = deps
    # Buffers alive while the exchange runs (Transformer Engine): the ring's double-buffered
    # K/V receives and every step's partial output until they are merged (fp32 accumulator);
    # backward K/V and dK/dV double-buffered plus the dQ accumulator; the all-to-all copies.
    if ring > 1:
        ring_bytes = 2 * kv + ring * o_bytes + 2 * o_bytes if forward else 4 * kv + q_bytes
    else:
        ring_bytes = sp.Integer(0)
    swapped = (q_bytes + kv + o_bytes) if pol.cp_a2a > 1 else sp.Integer(0)
    pas.transient = sp.Max(pas.transient, ring_bytes + swapped)


@dataclass(frozen=True)
class RingStep:
    """One step of the ring on one cp rank, relative to that rank's load-balanced share:
    ``work``, the share of a rank's attention work it does (under load balancing every rank
    does 1 in all); ``loop``, the length of its thread blocks' loop as a share of the
    sequence; ``rows``, the rows of work they split, as a share of the rank's query rows."""

    work: sp.Rational
    loop: float
    rows: sp.Rational


def ring_steps(rank: int, ring: int, load_balance: bool = True, forward: bool = True) -> list[RingStep]:
    """The steps of the ring of ``ring`` ranks on the ``rank``-th of them. At step j it holds
    the keys and values of rank ``rank - j`` (mod ring).

    Load-balanced, a rank holds chunks i and 2*ring-1-i of the sequence's 2*ring (2c tokens).
    Step 0 is the diagonal: its 2c queries against its own 2c keys, causal. Every later step is
    half a block: from an earlier rank, all 2c queries against the visitor's first chunk; from
    a later one, the rank's second chunk of queries against all 2c of its keys. Each is 1/ring of
    the rank's work. Forward, a thread block loops over keys and the rows are queries; backward
    (FlashAttention splits the keys over thread blocks) the reverse.

    Contiguous chunks (no load balancing, c tokens each): the diagonal block, then a whole block
    of queries against each earlier rank's keys (twice the diagonal's unmasked half), nothing
    against later ones (masked): rank i does (2i + 1)/ring of the balanced share, the last rank
    2 - 1/ring of it."""
    one = sp.Integer(1)
    out = [RingStep(one / ring, 1.0 / ring, one)]
    for j in range(1, ring):
        earlier = j <= rank            # the visitor's tokens come before the rank's (own chunk)
        if not load_balance:
            out.append(RingStep(2 * one / ring if earlier else sp.Integer(0), 1.0 / ring, one))
        elif earlier == forward:       # forward from an earlier rank / backward from a later one
            out.append(RingStep(one / ring, 0.5 / ring, one))
        else:
            out.append(RingStep(one / ring, 1.0 / ring, one / 2))
    return out


def attention_rows(op: Op, local: Callable[[str], sp.Expr],
                   keys: sp.Expr | None = None) -> sp.Expr | None:
    """The rows of work a fused attention kernel splits over thread blocks: its query rows
    (sequences x queries x query heads) forward; its key rows backward (``keys``, or the key
    sequence, per sequence and query head), where FlashAttention gives each thread block a tile
    of keys and loops over the queries. None for a kernel over a KV cache (an inference
    engine's, which splits the keys too when the queries are few). ``local``: label -> size."""
    if any(t.kind == "kv_cache" for t in op.inputs):
        return None
    n = local("s") if op.kind == "attention" else (keys if keys is not None else local("t"))
    return local("b") * n * local("g") * local("q")
