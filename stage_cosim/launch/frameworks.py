"""The frameworks ``--emit`` writes for, the one-line refusal of what one cannot express (shared
by the emitters: :mod:`megatron`, :mod:`nemo`, :mod:`torchtitan`), and what of a search's
choices each can launch (:data:`LAUNCHABLE`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from stage_cosim.errors import UserError

TARGETS = ("megatron", "nemo", "torchtitan")
# The frameworks' own names, for the one-line refusals and the headers.
FRAMEWORKS = {"megatron": "Megatron-LM", "nemo": "NeMo 2", "torchtitan": "torchtitan"}


def refuse(target: str, rule: str) -> UserError:
    return UserError("emit", f"{FRAMEWORKS[target]} {rule}")


@dataclass(frozen=True)
class Launchable:
    """What of a training search's choices a framework's launch expresses, so that a search for
    its launch (``optimize --emit``) answers with a configuration the emitter writes rather than
    one it refuses. The emitters' refusals stay the final check; this is each refusal that a
    searched value causes, said before the search.

    ``values``: per search dimension (the search space's names and values), the values it
    launches; a dimension not named, every value. ``rules``: combinations of values it cannot
    launch although it launches each value, as ``(rule, holds)``: ``holds`` of a point (the
    search's canonical form, where e.g. sp is off wherever tp is 1) says whether it launches."""

    values: Mapping[str, tuple[Any, ...]]
    rules: tuple[tuple[str, Callable[[dict[str, Any]], bool]], ...] = field(default=())


def _no_one_chunk_zero_bubble(point: dict[str, Any]) -> bool:
    # (the canonical point names the chunked form where vp > 1: zb-v, dualpipev)
    return point.get("schedule") not in ("zb-h1", "dualpipe")


def _expert_tp_is_1_or_tp(point: dict[str, Any]) -> bool:
    return point.get("expert_tp", 1) in (1, point.get("tp", 1))


# Megatron-Core (which Megatron-LM and NeMo 2 run) has no zero-bubble or DualPipe schedule: the
# search's 1f1b, which with virtual stages is interleaved 1F1B. Its recomputation modes are the
# search's (per-op checkpointing, torchtitan's, is not searched).
_MEGATRON_CORE = {"schedule": ("1f1b",)}
LAUNCHABLE: dict[str, Launchable] = {
    "megatron": Launchable(_MEGATRON_CORE),
    # NeMo's recipes have no field for hierarchical context parallelism's group sizes
    "nemo": Launchable({**_MEGATRON_CORE, "cp_comm": ("p2p", "all-gather", "a2a")}),
    # torchtitan: FSDP2 (ZeRO 2 or 3) for data parallelism, tensor parallelism always with the
    # sequence sharded (sp; the search turns it off where tp is 1), keys and values passed round
    # the ring or gathered, BF16 (its float8 converters are not emitted), full or no activation
    # checkpointing (it has no Megatron-style selective mode); ZB-V and DualPipeV but not their
    # one-chunk forms (zb-h1, dualpipe); expert layers sharded by tp or not at all.
    "torchtitan": Launchable(
        {"sp": (True,), "zero": (2, 3), "cp_comm": ("p2p", "all-gather"), "dtype": ("bf16",),
         "recompute": ("none", "full")},
        (("has no zb-h1 or dualpipe schedule (their V forms, with vp 2: zb-v, dualpipev)",
          _no_one_chunk_zero_bubble),
         ("expert tensor parallelism is 1 or tp", _expert_tp_is_1_or_tp))),
}
