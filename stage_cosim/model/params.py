"""A model's parameter counts, total and active, with what each one counts.

Publishers count "active" parameters two ways. Mistral (Mixtral 8x7B: 12.9B of 46.7B) and
Qwen (Qwen3-30B-A3B: 3.3B of 30.5B) count everything a token uses, the input embedding table
included; DeepSeek (V3: 37B of 671B; V2-Lite: 2.4B of 15.7B) and OpenAI (gpt-oss-120b: 5.13B of
116.83B) leave the input embedding table out. ``active`` here is the first, and
``active_without_embedding`` the second, so both published figures can be read off.

Multi-token-prediction modules are in neither count, as published totals leave them out
(DeepSeek-V3's 671B of the 685B it released); ``mtp`` is their size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from stage_cosim.model.config import ModelConfig

CONVENTION = ("total: every parameter trained, the multi-token-prediction modules (mtp) left out, as published "
              "totals leave them out; active: the parameters one token uses (attention, dense and shared-expert "
              "MLPs, its top-k routed experts, router, norms, the output layer and the input embedding table), "
              "as Mistral and Qwen publish it; active_without_embedding: the same less the input embedding table, "
              "as DeepSeek and OpenAI publish it")


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    active: int
    active_without_embedding: int
    embedding: int          # the input embedding table (and learned positions)
    mtp: int                # multi-token-prediction modules, in neither count
    # what ``active`` counts
    active_counts_embedding: bool = True
    active_counts_mtp: bool = False

    def to_dict(self) -> dict:
        return {**asdict(self), "convention": CONVENTION}


def parameter_counts(model: ModelConfig) -> ParameterCounts:
    active = model.active_param_count()
    embedding = model.vocab * model.hidden + (model.max_seq * model.hidden if model.position == "learned" else 0)
    return ParameterCounts(total=model.param_count(), active=active, active_without_embedding=active - embedding,
                           embedding=embedding, mtp=model.mtp_param_count())


def describe(counts: ParameterCounts) -> str:
    """One line: "671.03 B parameters, 37.55 B active per token (36.63 B without the input
    embedding; MTP modules, 11.61 B, not counted)"."""
    text = f"{counts.total / 1e9:,.2f} B parameters"
    notes = []
    if counts.active != counts.total:
        text += f", {counts.active / 1e9:,.2f} B active per token"
        notes.append(f"{counts.active_without_embedding / 1e9:,.2f} B without the input embedding")
    if counts.mtp:
        notes.append(f"MTP modules, {counts.mtp / 1e9:,.2f} B, not counted")
    return text + (f" ({'; '.join(notes)})" if notes else "")
