"""The frameworks ``--emit`` writes for, and the one-line refusal of what one cannot express
(shared by the emitters: :mod:`megatron`, :mod:`nemo`, :mod:`torchtitan`)."""

from __future__ import annotations

from stage_cosim.errors import UserError

TARGETS = ("megatron", "nemo", "torchtitan")
# The frameworks' own names, for the one-line refusals and the headers.
FRAMEWORKS = {"megatron": "Megatron-LM", "nemo": "NeMo 2", "torchtitan": "torchtitan"}


def refuse(target: str, rule: str) -> UserError:
    return UserError("emit", f"{FRAMEWORKS[target]} {rule}")
