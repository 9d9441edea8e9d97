"""The hardware records: one self-contained file per GPU (hardware/data/gpus) and per cluster
preset (hardware/data/clusters), what they hold, and how calibrate.py --write rewrites them."""

from __future__ import annotations

import copy
import shutil
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from stage_cosim.hardware.cluster import CLUSTER_PRESETS, resolve_cluster
from stage_cosim.hardware.gpu import (EFFICIENCIES, GPU, HAND_SET, family_efficiencies, get_gpu, gpu_names,
                                      gpu_records, parse_record, record_header, render_record)
from stage_cosim.validation import components as comp

ROOT = Path(__file__).resolve().parents[1]
GPUS = ROOT / "hardware" / "data" / "gpus"
CLUSTERS = ROOT / "hardware" / "data" / "clusters"
FAMILIES = {"A100": ["A100-40GB", "A100-80GB"], "H100": ["H100-SXM", "H800", "GH200", "H200"],
            "B200": ["B200", "GB200"], "MI300": ["MI300X", "MI325X"]}


def test_one_record_per_preset_in_the_order_they_were_announced() -> None:
    assert gpu_names() == ["A100-40GB", "A100-80GB", "MI250", "H100-SXM", "Gaudi2", "H800", "MI300X", "GH200", "L40S",
                           "H200", "B200", "GB200", "Gaudi3", "MI325X"]
    assert sorted(p.stem for p in GPUS.glob("*.yaml")) == sorted(gpu_names())
    # in the order of their GPUs (variants of a node, e.g. other scale-out designs, sit beside it)
    servers = ["dgx-a100", "mi250-4", "dgx-h100", "gaudi2-hls", "dgx-h800", "mi300x-8", "gh200-nvl2", "l40s-pcie-8",
               "dgx-h200", "dgx-b200", "gb200-nvl72", "gaudi3-hls", "mi325x-8"]
    assert [n for n in CLUSTER_PRESETS if n in servers] == servers
    assert sorted(p.stem for p in CLUSTERS.glob("*.yaml")) == sorted(CLUSTER_PRESETS)


@pytest.mark.parametrize("path", sorted(GPUS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_record_is_what_render_record_writes(path: Path) -> None:
    """calibrate.py --write rewrites records through render_record: a shipped record is exactly
    its rendering (header comments kept), so a rewrite changes only the values it fits."""
    text = path.read_text()
    rec = parse_record(text, path.name)
    assert render_record(rec, record_header(text)) == text
    assert parse_record(render_record(rec), path.name) == rec
    assert record_header(text).startswith("# ")      # says what the part is and where its figures come from


def test_a_record_describes_every_field_of_its_gpu() -> None:
    """Each record is self-contained: the GPU it builds is its fields and its default efficiency
    set, nothing from elsewhere (but the GPU class's defaults for what no record sets)."""
    for name, rec in gpu_records().items():
        g = get_gpu(name)
        for f in fields(GPU):
            if f.name in EFFICIENCIES:
                assert getattr(g, f.name) == rec["efficiencies"]["default"][f.name]["value"], (name, f.name)
            elif f.name in rec:
                assert getattr(g, f.name) == rec[f.name], (name, f.name)
            else:
                assert f.name in ("vector_tflops", "attention_block_rows", "record"), (name, f.name)
        assert {k for k in rec if k not in {f.name for f in fields(GPU)}} == \
            {"part", "announced", "scale_up_domain", "calibration_family", "efficiencies"}


def test_gpus_of_one_calibration_family_carry_the_same_efficiencies() -> None:
    """Values and sources alike: a fit of a family (calibrate.py --write) writes all its records."""
    assert {fam: [n for n, r in gpu_records().items() if r["calibration_family"] == fam] for fam in FAMILIES} \
        == FAMILIES
    for family, names in FAMILIES.items():
        sets = [gpu_records()[n]["efficiencies"]["default"] for n in names]
        assert all(s == sets[0] for s in sets), family
        assert family_efficiencies(family) == {k: v["value"] for k, v in sets[0].items()}
    # the microbenchmark tables name the same parts and families
    records = gpu_records()
    for part, preset in comp.PRESET_OF_GPU.items():
        assert comp.FAMILY_OF_GPU[part] == records[preset]["calibration_family"], part
        assert records[preset]["part"] == part or "not stated" in part


def test_every_efficiency_names_its_source_and_hand_set_values_agree() -> None:
    """A source is a fit (end to end, or a microbenchmark file), a derivation or the hand-set
    default. One hand-set value per parameter across all records, which is the GPU class's
    default where it has one (for a GPU built without a record)."""
    hand: dict[str, set[float]] = {}
    for name, rec in gpu_records().items():
        for k, v in rec["efficiencies"]["default"].items():
            assert v["source"].startswith(("end-to-end fit", "microbenchmark fit", "derived", HAND_SET,
                                           "uncalibrated: borrowed from")), (name, k)
            if v["source"].startswith(HAND_SET):
                hand.setdefault(k, set()).add(v["value"])
    assert all(len(v) == 1 for v in hand.values()), hand
    defaults = {f.name: f.default for f in fields(GPU) if f.name in EFFICIENCIES and isinstance(f.default, float)}
    assert set(defaults) <= set(hand)
    for k, d in defaults.items():
        assert hand[k] == {d}, k


def test_the_loader_refuses_what_is_not_a_record() -> None:
    text = (GPUS / "H100-SXM.yaml").read_text()
    with pytest.raises(ValueError, match="unknown keys"):
        parse_record(text + "colour: red\n", "x")
    with pytest.raises(ValueError, match="lacks kernel_overhead_us"):
        parse_record("\n".join(line for line in text.splitlines() if "kernel_overhead_us" not in line), "x")
    with pytest.raises(ValueError, match="holds no efficiencies"):
        parse_record(text + "  nemo-24.07:\n    - source: x\n", "x")
    with pytest.raises(ValueError, match="open with the `default` set"):
        parse_record(text.replace("  default:", "  nemo-24.07:"), "x")
    doc = yaml.safe_load(text)
    doc["efficiencies"]["default"][0].pop("source")
    with pytest.raises(ValueError, match="`source: <text>`"):
        parse_record(yaml.safe_dump(doc), "x")


def test_cluster_presets_are_records_in_a_cluster_files_fields(tmp_path) -> None:
    """Each preset file is a --cluster file but its GPU count; its links are its GPU's."""
    for name, doc in CLUSTER_PRESETS.items():
        on_disk = yaml.safe_load((CLUSTERS / f"{name}.yaml").read_text())
        assert on_disk == doc and doc["name"] == name
        gpu = get_gpu(doc["gpu"])
        rec = gpu_records()[doc["gpu"]]
        assert doc["scale_up"]["gpus_per_domain"] == rec["scale_up_domain"]
        assert doc["scale_up"]["bandwidth_GBps"] == gpu.nvlink_GBps
        assert gpu.scaleout_GBps in (None, doc["scale_out"]["bandwidth_GBps"])
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc | {"num_gpus": 2 * doc["scale_up"]["gpus_per_domain"]}))
        assert resolve_cluster(str(path)) == resolve_cluster(f"{name}:{2 * doc['scale_up']['gpus_per_domain']}")


def test_a_hypothetical_gpu_needs_no_record(tmp_path) -> None:
    """A GPU described in a cluster file, whole or as overrides of a preset, reads no record of
    its own."""
    whole = {f.name: v for f in fields(GPU) if (v := get_gpu("H100-SXM").to_dict()[f.name]) is not None}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"num_gpus": 8, "gpu": whole | {"name": "mine", "hbm_GBps": 5000.0},
                                    "scale_up": {"gpus_per_domain": 8, "bandwidth_GBps": 450, "latency_ns": 700},
                                    "scale_out": {"bandwidth_GBps": 50, "latency_ns": 2000}}))
    c = resolve_cluster(str(path))
    assert c.gpu == get_gpu("H100-SXM").with_overrides(name="mine", hbm_GBps=5000.0)


def test_calibrate_writes_a_fit_into_every_record_of_the_family(tmp_path) -> None:
    """--write: the family's records all get the fitted values, each with its source; the other
    parameters, the other families' records and every header stay as they were."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from calibrate import write_records

    shutil.copytree(GPUS, tmp_path / "gpus")
    before = {p.name: p.read_text() for p in (tmp_path / "gpus").glob("*.yaml")}
    written = write_records({"H100": ({"memory_efficiency": 0.7712, "kernel_overhead_us": 2.5},
                                      {"memory_efficiency": "microbenchmark fit: hbm_bandwidth.csv, X rows",
                                       "kernel_overhead_us": "end-to-end fit: megatron-core-0.8"},
                                      {"torchtitan-2024.12": {"attention_efficiency": (0.25, "Y rows")}})},
                            tmp_path / "gpus")
    assert sorted(p.stem for p in written) == sorted(FAMILIES["H100"])
    for path in (tmp_path / "gpus").glob("*.yaml"):
        text = path.read_text()
        assert record_header(text) == record_header(before[path.name])
        rec = parse_record(text, path.name)
        old = parse_record(before[path.name], path.name)
        if path.stem not in FAMILIES["H100"]:
            assert text == before[path.name]
            continue
        eff, was = rec["efficiencies"]["default"], copy.deepcopy(old["efficiencies"]["default"])
        assert eff["memory_efficiency"] == {"value": 0.7712,
                                            "source": "microbenchmark fit: hbm_bandwidth.csv, X rows"}
        assert eff["kernel_overhead_us"] == {"value": 2.5, "source": "end-to-end fit: megatron-core-0.8"}
        assert {k: v for k, v in eff.items() if k not in ("memory_efficiency", "kernel_overhead_us")} == \
            {k: v for k, v in was.items() if k not in ("memory_efficiency", "kernel_overhead_us")}
        assert {k: v for k, v in rec.items() if k != "efficiencies"} == \
            {k: v for k, v in old.items() if k != "efficiencies"}
        # a software profile's own set is replaced whole
        assert {k: v for k, v in rec["efficiencies"].items() if k != "default"} == \
            {"torchtitan-2024.12": {"attention_efficiency": {"value": 0.25, "source": "Y rows"}}}
    with pytest.raises(SystemExit, match="families"):
        write_records({"Z100": ({}, {}, {})}, tmp_path / "gpus")


def test_the_wheel_ships_the_records() -> None:
    """A non-editable install carries the records: their folders are packages setup.py finds
    (it lists every folder, __init__.py or not) and pyproject ships every package's YAML files."""
    from setuptools import find_namespace_packages

    found = find_namespace_packages(str(ROOT / "hardware"))
    assert {"data.gpus", "data.clusters"} <= set(found)
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_data = pyproject.split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    assert '"*" = [' in package_data and '"*.yaml"' in package_data
