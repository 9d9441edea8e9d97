"""Pass templates kept from one workload to the next (a search's candidates).

A search synthesizes thousands of configurations whose stages hold the same passes: the
schedules of one layout share their forward and backward, ZeRO 1 and 2 and recomputation that
keeps nothing more leave the passes alone. Generating a template (and the tensor-parallel
overlap's rewrite, the zero-bubble split, DualPipe's F&B) is most of what building a stage
costs. Inside :func:`reuse_templates`, a template is kept under everything
:func:`~stage_cosim.schedule.templates.pass_template` reads of its blocks (each step's
structure, its costs in the pass's phase, the block labels, which blocks are of one kind), the
degrees and the switches, and a workload asking for an equal one gets the kept one.

It is the one a fresh build makes, row for row: a block of a kind generated before (here or in
another stage) is a copy of that one's rows, rebound to its place, which are the rows
generating it gives (the same steps bound to the same numbers, entered the same way); so
whether a kept template's blocks were copies or generated changes nothing in its rows, exits,
sinks or segments. The blocks it was built from are kept with it, so the block kinds its
segments name by identity stay theirs. Derived templates (split, F&B) are kept by the
templates they derive from.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from stage_cosim.schedule.templates import PassTemplate, pass_template, split_backward, two_batch

LIMIT = 32          # kept templates (a few MB each with the tensor-parallel overlap's rows)

_depth = 0
_kept: OrderedDict[Any, tuple[PassTemplate, tuple]] = OrderedDict()
_derived: OrderedDict[tuple, tuple[tuple, Any]] = OrderedDict()
_signatures: dict[tuple[int, str], tuple[Any, tuple]] = {}


class HashedKey:
    """A key hashed once: keys that hold a whole pass's or graph's costs (up to hundreds of
    thousands of entries) would otherwise be hashed again at every lookup. Equal keys compare in
    full."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashedKey) and self._hash == other._hash and self.parts == other.parts


@contextmanager
def reuse_templates() -> Iterator[None]:
    """Inside, stages' pass templates are kept and reused (they stay kept between uses, up to
    :data:`LIMIT`)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def clear() -> None:
    _kept.clear()
    _derived.clear()
    _signatures.clear()


def _signature(compiled: Any, phase: str) -> tuple:
    """What ``pass_template`` reads of a compiled block in ``phase``: every step's structure,
    the block's exits, its FP8 precision and modules."""
    found = _signatures.get((id(compiled), phase))
    if found is not None and found[0] is compiled:
        return found[1]
    sb = compiled.sharded
    steps = sb.fwd if phase == "fwd" else sb.bwd
    sig = (tuple((st.index, st.name, st.phase, st.kind, st.category, st.deps, st.collective, st.axes, st.matmul,
                  st.prologue, st.first_microbatch, st.peer, st.pair, st.key_share) for st in steps),
           sb.fwd_exit if phase == "fwd" else sb.bwd_exit, sb.policy.precision, sb.fp8_modules)
    if len(_signatures) > 256:
        _signatures.clear()
    _signatures[(id(compiled), phase)] = (compiled, sig)
    return sig


def _remember(store: OrderedDict, key: Any, value: Any) -> None:
    store[key] = value
    while len(store) > LIMIT:
        store.popitem(last=False)


def cached_pass_template(insts: list, phase: str, degrees: dict[str, int], tp_overlap: bool = False,
                         first: bool = False, shared: dict | None = None) -> PassTemplate:
    """:func:`~stage_cosim.schedule.templates.pass_template`, kept inside :func:`reuse_templates`."""
    if not _depth:
        return pass_template(insts, phase, degrees, tp_overlap, first=first, shared=shared)
    kinds = [(id(i.compiled), id(i.costs)) for i in insts]
    key = HashedKey((phase, first, tp_overlap, tuple(sorted(degrees.items())),
                tuple((_signature(i.compiled, phase), i.costs.fwd if phase == "fwd" else i.costs.bwd, i.costs.keys,
                       i.label) for i in insts),
                tuple(kinds.index(k) for k in kinds)))
    found = _kept.get(key)
    if found is not None:
        _kept.move_to_end(key)
        return found[0]
    template = pass_template(insts, phase, degrees, tp_overlap, first=first, shared=shared)
    # (held by the template: whoever holds it holds the blocks its segments name by identity)
    template.blocks_of = tuple((i.compiled, i.costs) for i in insts)
    _remember(_kept, key, (template, template.blocks_of))
    return template


def _derive(fn: Callable, *templates: PassTemplate) -> Any:
    if not _depth:
        return fn(*templates)
    key = (fn.__name__, *(id(t) for t in templates))
    found = _derived.get(key)
    if found is not None and all(a is b for a, b in zip(found[0], templates)):
        _derived.move_to_end(key)
        return found[1]
    out = fn(*templates)
    _remember(_derived, key, (templates, out))
    return out


def cached_split_backward(t: PassTemplate) -> tuple[PassTemplate, PassTemplate]:
    """:func:`~stage_cosim.schedule.templates.split_backward`, kept by the template it splits."""
    return _derive(split_backward, t)


def cached_two_batch(first: PassTemplate, second: PassTemplate) -> PassTemplate:
    """:func:`~stage_cosim.schedule.templates.two_batch`, kept by the templates it pairs."""
    return _derive(two_batch, first, second)
