"""The frameworks ``--emit`` writes for, and the one-line refusal of what one cannot express
(shared by the emitters: :mod:`megatron`, :mod:`nemo`, :mod:`torchtitan`)."""

from __future__ import annotations

from stage_cosim.errors import UserError

TARGETS = ("megatron", "nemo", "torchtitan")
# The frameworks' own names, for the one-line refusals and the headers.
FRAMEWORKS = {"megatron": "Megatron-LM", "nemo": "NeMo 2", "torchtitan": "torchtitan"}
# The pipeline schedules a search for a framework's launch (``optimize --emit``) tries, by the
# search space's one-chunk names (with virtual stages, their chunked forms): those whose both
# forms the framework runs, so that the best found is one its launch can express. Megatron-Core
# (Megatron-LM, NeMo 2) runs 1F1B and interleaved 1F1B only; torchtitan runs ZB-V and DualPipeV
# but not their one-chunk forms.
SEARCHED_SCHEDULES = {"megatron": ("1f1b",), "nemo": ("1f1b",), "torchtitan": ("1f1b",)}


def refuse(target: str, rule: str) -> UserError:
    return UserError("emit", f"{FRAMEWORKS[target]} {rule}")
