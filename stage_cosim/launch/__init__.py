"""A parallel configuration as the launch arguments of a training framework (``--emit``).

* ``megatron``: Megatron-LM ``pretrain_gpt.py`` arguments, the model's dimensions included;
* ``nemo``: NeMo 2 recipe overrides (``nemo llm pretrain --factory <recipe> key=value ...``);
* ``torchtitan``: the keys of a torchtitan job's TOML file, for its FSDP layouts.

What a framework cannot express (a schedule it lacks, a model feature it has no flag for) is
refused in one line naming the framework and the setting, rather than emitted approximately.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stage_cosim.errors import UserError
from stage_cosim.launch.frameworks import FRAMEWORKS, TARGETS, refuse
from stage_cosim.model.config import ModelConfig
from stage_cosim.parallel import ParallelConfig

__all__ = ["FRAMEWORKS", "TARGETS", "Launch", "emit", "refuse"]


@dataclass(frozen=True)
class Launch:
    """One configuration's launch arguments for one framework."""

    target: str
    header: str                                   # what the arguments are for (a comment line)
    arguments: tuple[str, ...] = ()               # megatron: argv tokens; nemo: key=value overrides
    toml: dict[str, dict[str, Any]] = field(default_factory=dict)   # torchtitan: sections

    def text(self) -> str:
        """As pasted: a comment, then one argument (flag and values) per line, continued with
        a backslash; or the TOML sections."""
        lines = [f"# {self.header}"]
        if self.toml:
            for section, keys in self.toml.items():
                lines.append(f"[{section}]")
                # JSON's strings, integers, booleans and arrays are TOML's
                lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
                lines.append("")
            return "\n".join(lines).rstrip("\n")
        groups: list[list[str]] = []
        for token in self.arguments:
            if token.startswith("--") or self.target == "nemo" or not groups:
                groups.append([token])
            else:
                groups[-1].append(token)
        shown = [" ".join(_quoted(t) for t in g) for g in groups]
        lines += [s + (" \\" if i < len(shown) - 1 else "") for i, s in enumerate(shown)]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"target": self.target, "framework": FRAMEWORKS[self.target], "header": self.header}
        if self.toml:
            doc["toml"] = self.toml
        else:
            doc["arguments"] = list(self.arguments)
        return doc


def _quoted(token: str) -> str:
    """A token as a shell reads it back unchanged (patterns and layouts hold * | ( ) [ ])."""
    import shlex

    return shlex.quote(token)


def emit(target: str, model: ModelConfig, parallel: ParallelConfig, *, fp8_recipe: str | None = None) -> Launch:
    """``parallel`` training ``model`` as ``target``'s launch arguments. ``fp8_recipe``: the
    recipe the GPU resolved where the configuration leaves it to the GPU (fp8_recipe None)."""
    if target not in TARGETS:
        raise UserError("emit", f"must be one of {', '.join(TARGETS)}, got {target!r}")
    parallel.check_against(model)
    recipe = parallel.fp8_recipe or fp8_recipe
    if parallel.dtype == "fp8" and recipe is None:
        raise refuse(target, "needs the FP8 recipe: give --fp8-recipe")
    degrees = (f"dp{parallel.dp} tp{parallel.tp}" + (f" cp{parallel.cp}" if parallel.cp > 1 else "")
               + f" pp{parallel.pp}" + (f" vp{parallel.vp}" if parallel.vp > 1 else "")
               + (f" ep{parallel.ep} expert-tp{parallel.expert_tp}" if model.is_moe else ""))
    on = f"{model.name}, {degrees} on {parallel.world_size:,} GPUs"
    if target == "megatron":
        from stage_cosim.launch.megatron import megatron_args

        return Launch(target, f"Megatron-LM pretrain_gpt.py arguments: {on}",
                      tuple(megatron_args(model, parallel, recipe)))
    if target == "nemo":
        from stage_cosim.launch.nemo import nemo_overrides

        factory = "'RECIPE(performance_mode=True)'" if parallel.tp_comm_overlap else "RECIPE"
        note = (" (tp_comm_overlap: the recipe's performance mode adds the MegatronCommOverlapCallback that sets up "
                "its Userbuffers)" if parallel.tp_comm_overlap else "")
        return Launch(target, f"NeMo 2 overrides of a {model.name} recipe (nemo llm pretrain --factory {factory} ...): "
                              f"{on}{note}", tuple(nemo_overrides(model, parallel, recipe)))
    from stage_cosim.launch.torchtitan import torchtitan_toml

    return Launch(target, f"torchtitan job TOML keys (merge into the {model.name} job's file): {on}",
                  toml=torchtitan_toml(model, parallel))
