"""GPU descriptions: one self-contained record per GPU preset, ``data/gpus/<name>.yaml``.

A record holds the vendor's figures (dense tensor-core peaks per number format, HBM capacity and
bandwidth, NVLink bandwidth and domain, NIC bandwidth, architecture, SM count) and the model's
efficiencies, each with its source: which fit, table or microbenchmark gave it, or "hand-set
default". The efficiencies are keyed by software profile: ``default`` holds every parameter;
a profile whose release runs another kernel library may hold its own values of some of them
(the torchtitan profile's attention is PyTorch's FlashAttention-2 backend, not cuDNN's fused
attention), which :meth:`GPU.for_software` puts over the default set. GPUs of one calibration
family (same silicon generation, same kernels) carry the same sets. ``benchmarks/calibrate.py
--write`` rewrites the records' efficiencies through :func:`render_record`, which every shipped
record reads back as (a test holds it).

A hypothetical GPU is just another description: every field can be overridden.

Dense tensor-core peaks per number format: BF16 (every GPU), FP8 (Hopper on: per-tensor and
blockwise-scaled FP8 GEMMs), MXFP8 (Blackwell: block-scaled tensor cores, 32-element E8M0
scales) and FP4 (Blackwell; published, not yet used by a training recipe here). A format a GPU
lacks is None.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from stage_cosim.errors import UserError, require

# Tensor-core generation. Ampere and Hopper FP8 GEMMs take both operands K-major only (TN), so
# FP8 training keeps transposed copies of its operands for the backward GEMMs; Blackwell's
# read either layout. The serving parts of other generations and vendors: NVIDIA Ada (L40S),
# AMD CDNA2 (MI250) and CDNA3 (MI300X, MI325X) matrix cores, Intel Gaudi's matrix engines.
ARCHES = ("ampere", "hopper", "blackwell", "ada", "cdna2", "cdna3", "gaudi")
# Who makes each architecture (the listings name it; an efficiency borrowed across vendors
# is the weakest assumption a record makes).
VENDOR_OF_ARCH = {"ampere": "NVIDIA", "hopper": "NVIDIA", "blackwell": "NVIDIA", "ada": "NVIDIA",
                  "cdna2": "AMD", "cdna3": "AMD", "gaudi": "Intel"}
# Matmul number formats -> the GPU field holding their dense peak.
MATMUL_PEAKS = {"bf16": "bf16_tflops", "fp8": "fp8_tflops", "mxfp8": "mxfp8_tflops", "fp4": "fp4_tflops"}


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float            # dense peak
    fp8_tflops: float | None
    hbm_GiB: float                # capacity
    hbm_GBps: float               # bandwidth, 10^9 B/s
    nvlink_GBps: float            # per direction, 10^9 B/s
    scaleout_GBps: float | None   # NIC bandwidth per GPU, 10^9 B/s
    matmul_efficiency: float
    matmul_half_flops: float
    attention_efficiency: float
    memory_efficiency: float
    kernel_overhead_us: float
    scale_up_efficiency: float
    scale_out_efficiency: float
    # Non-tensor-core throughput (norms, softmax, optimizer): the FP32 CUDA-core rate, which is
    # 1/16 of the dense BF16 tensor rate on A100, H100 and B200 when not given.
    vector_tflops: float | None = None
    # Dense peaks of the block-scaled formats (None: the GPU has no such tensor cores).
    mxfp8_tflops: float | None = None
    fp4_tflops: float | None = None
    arch: str = "hopper"
    # FP8 GEMMs reach their own fraction of the FP8 peak (quantized operands, scale handling,
    # a higher rate to feed), with their own small-GEMM falloff. These defaults are the values
    # the GPU records mark "hand-set default" (for a GPU built without a record); families with
    # measured FP8 runs (H100) or FP8 microbenchmarks (B200) have fitted values there.
    fp8_matmul_efficiency: float = 0.6
    fp8_matmul_half_flops: float = 4e9
    # Keys per query at which a fused attention kernel runs at half its rate: each query tile
    # pays a fixed prologue and epilogue (load Q, rescale and write O) besides its loop over
    # the keys, so short key ranges (the chunks of ring attention) run slower.
    attention_half_keys: float = 64.0
    # Streaming multiprocessors, and the rows of work one FlashAttention thread block takes
    # (a tile of 128 queries forward, of 128 keys backward, for the head dimensions up to 256
    # of FlashAttention-2 on Ampere and Hopper and FlashAttention-3's BF16 kernels from 65 up):
    # a fused attention kernel whose tiles are fewer than the SMs leaves the rest idle. 0 SMs:
    # not known, occupancy not modelled.
    sm_count: int = 0
    attention_block_rows: int = 128
    # The shipped record this GPU's efficiencies come from (a preset, or the preset a cluster
    # file's GPU takes as its base; None: none), whose software profiles' own sets
    # :meth:`for_software` applies.
    record: str | None = None

    def __post_init__(self) -> None:
        for f in ("bf16_tflops", "hbm_GiB", "hbm_GBps", "nvlink_GBps"):
            require(getattr(self, f) > 0, f"gpu.{f}", f"must be positive, got {getattr(self, f)!r}")
        for f in ("fp8_tflops", "mxfp8_tflops", "fp4_tflops"):
            v = getattr(self, f)
            require(v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0), f"gpu.{f}",
                    f"must be positive (or absent: no such tensor cores), got {v!r}")
        for f in ("matmul_efficiency", "attention_efficiency", "memory_efficiency", "scale_up_efficiency",
                  "scale_out_efficiency", "fp8_matmul_efficiency"):
            v = getattr(self, f)
            require(0 < v <= 1, f"gpu.{f}", f"must be in (0, 1], got {v!r}")
        require(self.matmul_half_flops >= 0, "gpu.matmul_half_flops", "must be non-negative")
        require(self.fp8_matmul_half_flops >= 0, "gpu.fp8_matmul_half_flops", "must be non-negative")
        require(self.kernel_overhead_us >= 0, "gpu.kernel_overhead_us", "must be non-negative")
        require(self.arch in ARCHES, "gpu.arch", f"must be one of {', '.join(ARCHES)}, got {self.arch!r}")
        require(self.attention_half_keys >= 0, "gpu.attention_half_keys", "must be non-negative")
        require(self.sm_count >= 0, "gpu.sm_count", f"must be non-negative, got {self.sm_count!r}")
        require(self.attention_block_rows > 0, "gpu.attention_block_rows",
                f"must be positive, got {self.attention_block_rows!r}")
        require(self.record is None or (isinstance(self.record, str) and self.record in gpu_records()), "gpu.record",
                f"must name a GPU preset (the record its efficiencies come from), got {self.record!r}")

    @property
    def vector_peak_tflops(self) -> float:
        return self.vector_tflops if self.vector_tflops else self.bf16_tflops / 16

    def peak_tflops(self, fmt: str) -> float | None:
        """Dense tensor-core peak of a matmul number format (None: not supported)."""
        return getattr(self, MATMUL_PEAKS[fmt])

    @property
    def fp8_transposes(self) -> bool:
        """Whether FP8 GEMMs need transposed operand copies (TN-only FP8 tensor cores)."""
        return self.arch != "blackwell"

    @property
    def vendor(self) -> str:
        return VENDOR_OF_ARCH[self.arch]

    @property
    def memory_bytes(self) -> int:
        return int(self.hbm_GiB * (1 << 30))

    def with_overrides(self, **kw: Any) -> "GPU":
        known = {f.name for f in fields(self)}
        for k in kw:
            if k not in known:
                raise UserError(f"gpu.{k}", f"is not a GPU field (fields: {', '.join(sorted(known))})")
        return replace(self, **kw)

    def for_software(self, software: str | None) -> "GPU":
        """This GPU as ``software`` (a software profile's name; None: the default) runs it: the
        profile's own efficiencies from the GPU's record, over each value that is still the
        record's default (a value a user or an exploration set stays as set)."""
        own = software_efficiencies(self.record, software) if self.record else {}
        if not own:
            return self
        default = gpu_records()[self.record]["efficiencies"]["default"]
        changes = {k: v for k, v in own.items() if getattr(self, k) == float(default[k]["value"])}
        return replace(self, **changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the records -----------------------------------------------------------------------------------

# The efficiencies every record's set holds, each as {value, source}.
EFFICIENCIES = ("matmul_efficiency", "matmul_half_flops", "attention_efficiency", "memory_efficiency",
                "kernel_overhead_us", "scale_up_efficiency", "scale_out_efficiency", "fp8_matmul_efficiency",
                "fp8_matmul_half_flops", "attention_half_keys")
# The source of an efficiency no table or microbenchmark pins.
HAND_SET = "hand-set default"
# The source prefix of an efficiency taken from another family because no measurement of the
# GPU pins it ("uncalibrated: borrowed from A100 ..."): the GPU's reports say so.
UNCALIBRATED = "uncalibrated"
# A record's keys in the order render_record writes them, with the comment it writes beside each
# (None: no comment; a key absent from a record is not written). Every GPU field but the
# efficiencies may appear; `part`, `announced`, `scale_up_domain` and `calibration_family`
# describe the part without being GPU fields.
_LAYOUT: dict[str, str | None] = {
    "name": None,
    "part": "the data sheet's name (and the microbenchmark tables')",
    "announced": "year-month its vendor announced it (orders the listings)",
    "arch": "generation: ampere hopper blackwell ada cdna2 cdna3 gaudi",
    "sm_count": "SMs (AMD: compute units; 0: not known)",
    "bf16_tflops": "dense tensor-core peak, 10^12 FLOP/s",
    "fp8_tflops": "per number format (null: no such tensor cores)",
    "mxfp8_tflops": None,
    "fp4_tflops": None,
    "vector_tflops": "non-tensor-core (FP32 CUDA-core) rate; null: bf16_tflops / 16",
    "hbm_GiB": "HBM capacity",
    "hbm_GBps": "HBM bandwidth, 10^9 B/s",
    "nvlink_GBps": "scale-up link per GPU per direction, 10^9 B/s",
    "scale_up_domain": "GPUs in one scale-up domain",
    "scaleout_GBps": "NIC bandwidth per GPU, 10^9 B/s (null: not given)",
    "attention_block_rows": "rows of work per FlashAttention thread block",
    "calibration_family": "its GPUs carry the same efficiencies",
    "efficiencies": "per software profile; default: every profile's",
}
_REQUIRED = ("name", "part", "announced", "arch", "sm_count", "bf16_tflops", "hbm_GiB", "hbm_GBps", "nvlink_GBps",
             "scale_up_domain", "calibration_family", "efficiencies")
_COMMENT_COLUMN = 32


def _records_dir():
    return resources.files("stage_cosim.hardware").joinpath("data", "gpus")


def _flatten(sets: Any, where: str) -> dict[str, dict[str, dict[str, Any]]]:
    """A record file's efficiencies (per profile, groups of values sharing one source) as
    profile -> parameter -> {value, source}."""
    # (a profile's name is checked against the software profiles where both are known: the
    # profiles are a layer above the hardware; tests hold the shipped records to them)
    if not isinstance(sets, dict) or list(sets)[:1] != ["default"]:
        raise ValueError(f"{where}: efficiencies must open with the `default` set, got {sets!r}")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for profile, groups in sets.items():
        flat: dict[str, dict[str, Any]] = {}
        for group in groups if isinstance(groups, list) else [None]:
            if not isinstance(group, dict) or not isinstance(group.get("source"), str) or not group["source"]:
                raise ValueError(f"{where}: efficiencies.{profile} must be a list of groups, each a "
                                 f"`source: <text>` and its parameters, got {group!r}")
            for k, v in group.items():
                if k == "source":
                    continue
                if k not in EFFICIENCIES or k in flat:
                    raise ValueError(f"{where}: efficiencies.{profile}.{k}: unknown or given twice")
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"{where}: efficiencies.{profile}.{k} must be a number, got {v!r}")
                flat[k] = {"value": v, "source": group["source"]}
        missing = [k for k in EFFICIENCIES if k not in flat]
        if missing and profile == "default":
            raise ValueError(f"{where}: efficiencies.{profile} lacks {', '.join(missing)}")
        if not flat:
            raise ValueError(f"{where}: efficiencies.{profile} holds no efficiencies")
        out[profile] = {k: flat[k] for k in EFFICIENCIES if k in flat}
    return out


def parse_record(text: str, where: str) -> dict[str, Any]:
    """A GPU record's text as a mapping, its efficiencies as profile -> parameter -> {value,
    source} (ValueError naming what is wrong where it is not a record)."""
    rec = yaml.safe_load(text)
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a mapping")
    unknown = [k for k in rec if k not in _LAYOUT]
    missing = [k for k in _REQUIRED if k not in rec]
    if unknown or missing:
        raise ValueError(f"{where}: unknown keys {unknown}, missing keys {missing}")
    return rec | {"efficiencies": _flatten(rec["efficiencies"], where)}


@lru_cache(maxsize=1)
def gpu_records() -> dict[str, dict[str, Any]]:
    """Every shipped GPU record, by preset name, in the order they were announced."""
    out = {}
    for path in _records_dir().iterdir():
        if not path.name.endswith(".yaml"):
            continue
        rec = parse_record(path.read_text(), f"hardware/data/gpus/{path.name}")
        if rec["name"] != path.name.removesuffix(".yaml"):
            raise ValueError(f"hardware/data/gpus/{path.name}: names {rec['name']!r}, not its file's name")
        out[rec["name"]] = rec
    return dict(sorted(out.items(), key=lambda kv: (str(kv[1]["announced"]), kv[0])))


def _number(v: Any) -> float | None:
    return None if v is None else float(v)


def gpu_from_record(rec: dict[str, Any]) -> GPU:
    """The GPU a record describes, with its ``default`` efficiencies."""
    kw: dict[str, Any] = {}
    for f in fields(GPU):
        if f.name in rec:
            v = rec[f.name]
            kw[f.name] = v if f.type in ("str", "int") else _number(v)
    kw.update({k: float(v["value"]) for k, v in rec["efficiencies"]["default"].items()})
    return GPU(**kw, record=rec["name"])


def get_gpu(name: str) -> GPU:
    records = gpu_records()
    if name not in records:
        raise UserError("gpu", f"unknown GPU {name!r} (known: {', '.join(records)})")
    return gpu_from_record(records[name])


def gpu_names() -> list[str]:
    return list(gpu_records())


def software_efficiencies(name: str, software: str | None) -> dict[str, float]:
    """The efficiencies GPU preset ``name``'s record holds for software profile ``software``
    besides its default set (empty: none, or no such record)."""
    rec = gpu_records().get(name)
    if rec is None or software is None or software == "default":
        return {}
    return {k: float(v["value"]) for k, v in rec["efficiencies"].get(software, {}).items()}


def family_efficiencies(family: str) -> dict[str, float]:
    """The efficiency values every GPU of calibration ``family`` carries (its records' ``default``
    set), where a fit of the family starts; ValueError where the family's records disagree."""
    sets = {name: {k: float(v["value"]) for k, v in rec["efficiencies"]["default"].items()}
            for name, rec in gpu_records().items() if rec["calibration_family"] == family}
    if not sets:
        raise ValueError(f"no GPU record of calibration family {family!r}")
    first = next(iter(sets.values()))
    if any(s != first for s in sets.values()):
        raise ValueError(f"the GPU records of calibration family {family!r} ({', '.join(sets)}) carry different "
                         f"efficiencies")
    return first


def uncalibrated(name: str) -> dict[str, str]:
    """The efficiencies of GPU preset ``name`` that no measurement of its own family pins
    (parameter -> the source that says where they were borrowed from); empty for a calibrated
    GPU, or a name without a record (a hypothetical GPU states its own values)."""
    rec = gpu_records().get(name)
    if rec is None:
        return {}
    return {k: v["source"] for k, v in rec["efficiencies"]["default"].items()
            if v["source"].startswith(UNCALIBRATED)}


def calibration_warning(gpu: GPU) -> str | None:
    """One line for a report where ``gpu``'s efficiencies are borrowed, not measured: which
    ones and from where (None when every one is calibrated)."""
    borrowed = uncalibrated(gpu.name)
    if not borrowed:
        return None
    by_source: dict[str, list[str]] = {}
    for k, src in borrowed.items():
        by_source.setdefault(src.removeprefix(UNCALIBRATED).lstrip(": "), []).append(k)
    what = "; ".join(f"{', '.join(ks)} {src}" for src, ks in by_source.items())
    return (f"GPU {gpu.name}: {len(borrowed)} of {len(EFFICIENCIES)} efficiencies are uncalibrated "
            f"(no microbenchmark of this GPU pins them): {what}")


def _scalar(v: Any) -> str:
    """``v`` as YAML: plain where that reads back as ``v`` (in a block mapping), else quoted."""
    if isinstance(v, str):
        try:
            plain = "#" not in v and ": " not in v and yaml.safe_load(f"k: {v}") == {"k": v}
        except yaml.YAMLError:
            plain = False
        return v if plain else json.dumps(v, ensure_ascii=False)   # JSON's strings are YAML's double-quoted
    return yaml.safe_dump(v).removesuffix("\n...\n").strip()


def render_record(rec: dict[str, Any], header: str = "") -> str:
    """A record's text as the shipped files hold it: ``header`` (comment lines), then every key in
    one order with its comment, the efficiencies in groups of one source each (in the order of
    their first parameter). ``parse_record`` of the text gives ``rec`` back."""
    lines = [header.rstrip("\n")] if header.strip() else []
    for key, comment in _LAYOUT.items():
        if key not in rec:
            continue
        if key == "efficiencies":
            lines.append(f"{'efficiencies:':<{_COMMENT_COLUMN}}# {comment}")
            for profile, values in rec[key].items():
                lines.append(f"  {profile}:")
                groups: dict[str, list[str]] = {}
                for k in EFFICIENCIES:
                    if k in values:
                        groups.setdefault(values[k]["source"], []).append(k)
                for source, names in groups.items():
                    lines.append(f"    - source: {_scalar(source)}")
                    lines += [f"      {k + ':':<23}{_scalar(values[k]['value'])}" for k in names]
            continue
        line = f"{key}: {_scalar(rec[key])}"
        lines.append(f"{line:<{_COMMENT_COLUMN}}# {comment}" if comment else line)
    return "\n".join(lines) + "\n"


def record_header(text: str) -> str:
    """The comment lines a record's text opens with (what render_record keeps)."""
    head = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        head.append(line)
    return "\n".join(head) + ("\n" if head else "")
