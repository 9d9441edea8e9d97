"""The training blocks a search shares between configurations (``training_blocks``' cache).

A search binds the model's compiled blocks to each configuration's numbers many thousand
times; the cache keeps what configurations share (the model's layer kinds and switches, each
padded copy of the model, each policy's compiled blocks, each block bound to its numbers).
Caching must change nothing: here every block's costs, and every lower bound (one
configuration at a time and many at once), with the cache are equal (==, to the bit) to those
of calls that share nothing, on random configurations of a dense model (cp, FP8), a
Mixture-of-Experts one, one with sliding-window layers between global ones and one with latent
attention and a dense first layer; and the cache is read (compiled once per policy, the
model's switches once) rather than rebuilt.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import numpy as np
import pytest

from stage_cosim import workload
from stage_cosim.model.config import ModelConfig
from stage_cosim.search.bound import StepBound
from stage_cosim.search.compiled import CompiledBound
from stage_cosim.sharding.numeric import compiled_blocks
from stage_cosim.workload import precision_for, training_blocks
from tests.test_search_bound import _sample

# (the sliding-window and latent-attention models in the slow tier: compiling their policies is
# what costs)
CASES = (("llama", 24), ("mixtral", 24), pytest.param("gpt-oss", 16, marks=pytest.mark.slow),
         pytest.param("deepseek", 12, marks=pytest.mark.slow))


@lru_cache(maxsize=None)
def _configs(case: str, n: int) -> tuple:
    """(model, cluster, random feasible configurations of a few sharding policies)."""
    model, cluster, configs = _sample(case, n, seed=5, policies=3)
    assert len(configs) >= n // 2
    return model, cluster, tuple(configs)


class _Counting(dict):
    """A cache that counts its hits by the kind of entry (the key's first item)."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: Counter = Counter()

    def get(self, key, default=None):  # noqa: ANN001, ANN201
        hit = super().get(key, default)
        if hit is not None:
            self.hits[key[0]] += 1
        return hit


def _uncached(monkeypatch) -> None:
    """Make every ``training_blocks`` call (the bounds' included) share nothing."""
    original = workload.training_blocks
    monkeypatch.setattr(workload, "training_blocks",
                        lambda model, par, precision, cache=None: original(model, par, precision))


def _same_blocks(a, b) -> None:
    """The same compiled blocks bound to equal costs (every float ==)."""
    pairs = [(a.embedding, b.embedding), (a.head, b.head), *zip(a.layers, b.layers)]
    assert len(a.layers) == len(b.layers)
    for (block_a, costs_a), (block_b, costs_b) in pairs:
        assert block_a is block_b
        assert costs_a == costs_b


@pytest.mark.parametrize("case, n", CASES)
def test_cached_blocks_are_the_uncached_ones_and_the_cache_is_read(case: str, n: int, monkeypatch) -> None:
    model, cluster, configs = _configs(case, n)
    compiles, switches = Counter(), Counter()
    monkeypatch.setattr(workload, "compiled_blocks",
                        lambda arch, policy: compiles.update([policy]) or compiled_blocks(arch, policy))
    plain = ModelConfig.switches
    monkeypatch.setattr(ModelConfig, "switches", lambda self: switches.update([id(self)]) or plain(self))
    cache = _Counting()
    for par in configs:
        precision = precision_for(par, cluster.gpu)
        cached = training_blocks(model, par, precision, cache=cache)
        _same_blocks(cached, training_blocks(model, par, precision))
        # a second call with the same numbers is the first's, costs objects and all
        again = training_blocks(model, par, precision, cache=cache)
        assert all(x[1] is y[1] for x, y in zip(again.layers, cached.layers))
    n = len(configs)
    # uncached: one compilation lookup and one switches() per call; cached: one per policy, one in all
    policies = sum(1 for key in cache if key[0] == "compiled")
    # one per sharding policy: what the configurations' ShardingPolicy is made of
    assert policies == len({(precision_for(p, cluster.gpu), p.sp, p.zero, p.recompute, p.grad_reduce_dtype,
                             p.moe_token_dispatcher if model.is_moe else None, p.cp_ring, p.cp_a2a,
                             p.cp_load_balance or p.cp == 1) for p in configs})
    assert sum(compiles.values()) == n + policies
    assert sum(switches.values()) == n + 1
    assert cache.hits["arch"] == 2 * n - 1 and cache.hits["compiled"] == 2 * n - policies
    # the second call of each configuration finds every block bound (embedding, head, each layer kind)
    kinds = len(set(zip(model.layer_kinds(), model.layer_windows())))
    assert cache.hits["costs"] >= n * (2 + kinds)
    if case == "gpt-oss":
        assert kinds == 2           # sliding-window and global layers: bound apart


@pytest.mark.parametrize("case, n", CASES)
def test_bounds_with_the_cache_are_the_uncached_ones(case: str, n: int, monkeypatch) -> None:
    model, cluster, configs = _configs(case, n)
    cached = StepBound(model, cluster)
    bounds = [cached(par) for par in configs]
    many = CompiledBound(model, cluster)(configs)
    _uncached(monkeypatch)
    uncached = StepBound(model, cluster)
    assert [uncached(par) for par in configs] == bounds
    assert np.array_equal(CompiledBound(model, cluster)(configs), many)


def test_a_cache_serves_one_model() -> None:
    model, cluster, configs = _configs("llama", 24)
    cache: dict = {}
    par = configs[0]
    training_blocks(model, par, precision_for(par, cluster.gpu), cache=cache)
    other = model.with_overrides(hidden=model.hidden * 2)
    with pytest.raises(ValueError, match="one model"):
        training_blocks(other, par, precision_for(par, cluster.gpu), cache=cache)


@pytest.mark.parametrize("case, n", CASES[:2])
def test_bounds_with_caches_emptied_at_every_group_are_the_kept_ones(case: str, n: int, monkeypatch) -> None:
    """A search keeps its bounds' caches within limits (each emptied past its limit, one group
    of blocks kept): with limits so small that every cache is emptied at almost every group, and
    the configurations bounded in their given order and in reverse (groups dropped and bound
    again), every bound is the one of a bound that keeps everything, to the bit."""
    from stage_cosim.search import bound as bound_module
    from stage_cosim.search import compiled as compiled_module

    model, cluster, configs = _configs(case, n)
    kept_one = StepBound(model, cluster)
    kept = [kept_one(par) for par in configs]
    kept_bound = CompiledBound(model, cluster)
    kept_many = kept_bound(configs)
    monkeypatch.setattr(bound_module, "CACHE_LIMIT", 2)
    monkeypatch.setattr(bound_module, "TRAINING_LIMIT", 1)
    monkeypatch.setattr(compiled_module, "CACHE_LIMIT", 2)
    monkeypatch.setattr(compiled_module, "GROUPS_KEPT", 1)
    small = StepBound(model, cluster)
    assert [small(par) for par in configs] == kept
    assert [small(par) for par in reversed(configs)] == kept[::-1]
    many = CompiledBound(model, cluster)
    assert np.array_equal(many(configs), kept_many)
    assert np.array_equal(many(configs[::-1]), kept_many[::-1])
    # one group kept, and the caches emptied (what the last groups added is left)
    assert len(many._groups) == 1 and len(many.bound._training) <= 2
    assert len(many.bound._blocks) < len(kept_bound.bound._blocks)
    assert len(many.streams._rows) < len(kept_bound.streams._rows)


def test_groups_are_bound_together_alike_ones_in_turn() -> None:
    """CompiledBound.order: every position once, each group's configurations in one run."""
    model, cluster, configs = _configs("mixtral", 24)
    configs = list(configs) * 2
    order = CompiledBound.order(configs)
    assert sorted(order) == list(range(len(configs)))
    keys = [CompiledBound.group_key(configs[j]) for j in order]
    runs = [k for j, k in enumerate(keys) if j == 0 or k != keys[j - 1]]
    assert len(runs) == len(set(keys))
