"""The search's evaluations, made cheaper, give what a fresh simulation gives, to the bit.

``evaluate`` reuses pass and block runs, and whole step timings, kept from earlier candidates
(adapters/roofline/run_cache.py); the engine replays a lone agent (every pass template timed
on its own) without its rendezvous bookkeeping and looks each collective's time up once; the
breakdown counts categories by position. Each must leave every figure as it was:

* on random structurally feasible configurations of five models (dense with cp, FP8,
  interleaved and zero-bubble pipelines, a tied-embedding GPT, Mixture-of-Experts, sliding-window
  and latent attention, ZeRO 0-3), evaluated one after another as a search does, the result
  equals (==) a fresh synthesis and simulation through the engine's original interface (a
  network without the lone-agent shortcut's ``span``, nothing kept);
* the breakdown equals the original event-by-event charge, string categories and all.
"""

from __future__ import annotations

import random

import pytest

from stage_cosim.adapters.roofline import run_cache
from stage_cosim.adapters.roofline import simulate as roofline
from stage_cosim.adapters.roofline.breakdown import _CHARGE_ORDER, _CHARGED_TO, charge
from stage_cosim.adapters.simulate import simulate
from stage_cosim.result import BREAKDOWN_KEYS
from stage_cosim.search import evaluate as evaluate_mod
from stage_cosim.search.evaluate import Objective, evaluate
from stage_cosim.workload import precision_for, synthesize
from tests.test_search_bound import _sample

# (case, configurations): 40 in all, each evaluated, and a third of them again from a fresh
# synthesis (the whole step's timings kept)
SAMPLES = (("llama", 14), ("gpt-tied", 6), ("mixtral", 12), ("gpt-oss", 4), ("deepseek", 4))

# (a capacity of ten HBMs: every configuration of the sample is simulated, whatever its memory)
ANY_MEMORY = -9.0


class PlainNetwork:
    """A network seen through the engine's original interface only (no ``span``, no
    ``identity``): every collective goes through the rendezvous and ``collective``, nothing is
    kept between simulations."""

    def __init__(self, net) -> None:  # noqa: ANN001
        self._net = net
        self.name = net.name

    def stream(self, node_type: str, kind: str) -> str | None:
        return self._net.stream(node_type, kind)

    def collective(self, *args, **kw) -> list[float]:  # noqa: ANN002, ANN003
        return self._net.collective(*args, **kw)

    def p2p(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        return self._net.p2p(src, dst, nbytes)

    def placement_key(self, members) -> tuple:  # noqa: ANN001
        return self._net.placement_key(members)


def _fresh(model, cluster, par, monkeypatch) -> dict:  # noqa: ANN001
    """``par`` synthesized anew and simulated on the plain network, outside any reuse."""
    assert run_cache.active() is None
    real = roofline.make_network
    with monkeypatch.context() as m:
        m.setattr(roofline, "make_network", lambda *a, **kw: PlainNetwork(real(*a, **kw)))
        w = synthesize(model, par, precision=precision_for(par, cluster.gpu))
        result, _, _ = simulate(w, cluster)
    return result.to_dict()


@pytest.mark.parametrize("case, n", SAMPLES)
def test_evaluations_equal_fresh_simulations(case: str, n: int, monkeypatch) -> None:
    model, cluster, configs = _sample(case, n, seed=11, policies=6)
    kept = run_cache._CACHE
    kept.clear()
    evaluate_mod._workload.cache_clear()
    seen = []
    for i, par in enumerate(configs):
        e = evaluate(model, cluster, par, {}, Objective(), headroom=ANY_MEMORY)
        if not e.feasible:
            continue
        assert e.result == _fresh(model, cluster, par, monkeypatch), (case, par.to_dict())
        seen.append(par)
        if i % 3 == 0:
            # the same graphs from a fresh synthesis: the whole step's timings come back kept
            evaluate_mod._workload.cache_clear()
            hits = kept.hits
            again = evaluate(model, cluster, par, {}, Objective(), headroom=ANY_MEMORY)
            assert again.result == e.result and kept.hits > hits
    assert len(seen) == len(configs)
    assert kept.hits > 0
    if case == "llama":
        assert {1, 3} <= {p.zero for p in seen} and any(p.cp > 1 for p in seen)
        assert any(p.dtype == "fp8" for p in seen) and any(p.vp > 1 for p in seen)
        assert any(p.zero == 3 and p.pp > 1 for p in seen)      # the node-level replay
    if case == "mixtral":
        assert any(p.ep > 1 for p in seen)


def _charge_event_by_event(spans, lo: float, hi: float, waiting: str) -> dict[str, float]:  # noqa: ANN001
    """The breakdown's original charge: events sorted with their category names, each stretch
    to the first active category."""
    events = []
    for s, e, cat in spans:
        s, e = max(s, lo), min(e, hi)
        if e > s:
            events += [(s, 1, cat), (e, -1, cat)]
    events.sort()
    out = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    active = dict.fromkeys(_CHARGE_ORDER, 0)
    prev = lo
    for t, delta, cat in events + [(hi, 0, "other")]:
        if t > prev:
            for kind in _CHARGE_ORDER:
                if active[kind]:
                    out[_CHARGED_TO[kind]] += t - prev
                    break
            else:
                out[waiting] += t - prev
            prev = t
        active[cat] += delta
    return out


def test_charge_equals_the_event_by_event_charge() -> None:
    rng = random.Random(5)
    for trial in range(300):
        spans = []
        for _ in range(rng.randrange(0, 60)):
            # coarse times: many spans start and end at the same instants
            s = rng.randrange(0, 40) * 0.125 if trial % 2 else rng.random() * 5
            spans.append((s, s + rng.choice((0.0, 0.125, 0.5, rng.random())), rng.choice(_CHARGE_ORDER)))
        lo, hi = rng.choice(((0.0, 5.0), (0.3, 4.1), (1.0, 1.0)))
        waiting = rng.choice(("idle", "pipeline_bubble"))
        assert charge(spans, lo, hi, waiting) == _charge_event_by_event(spans, lo, hi, waiting)
