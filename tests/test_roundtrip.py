"""Our traces read back: ``synth`` and ``astra-sim export`` output simulated with ``--traces``
give the step time of the direct simulation (within 0.5 %, both network models), and
``astra-sim replay`` of an export gives the astra model's times to the nanosecond.

The grid is the list below; a new parallelism (cp, ep …) is one more entry.
"""

from __future__ import annotations

import json

import pytest

from stage_cosim.adapters.astra_sim.export import AstraSettings, export
from stage_cosim.adapters.roofline.simulate import simulate, simulate_traces
from stage_cosim.hardware import resolve_cluster
from stage_cosim.parallel import ParallelConfig
from stage_cosim.trace.writer import atomic_directory, write_traces
from stage_cosim.workload import synthesize

GRID = [
    ("llama", dict(dp=2, tp=2, pp=2)),
    ("llama", dict(dp=2, tp=2, pp=2, sp=True, zero=1, recompute="selective")),
    ("llama", dict(dp=1, tp=2, pp=2, vp=2, recompute="full")),
    ("llama", dict(dp=4, tp=1, pp=1, zero=3)),
    ("llama", dict(dp=1, tp=1, pp=4, schedule="gpipe")),
    ("llama", dict(dp=4, tp=2, pp=2, sp=True, zero=2)),          # 16 GPUs: two network dimensions
    ("gpt", dict(dp=2, tp=1, pp=2)),                              # tied embeddings across stages
    ("gpt", dict(dp=1, tp=2, pp=4, vp=2)),
    ("llama", dict(dp=1, tp=2, cp=2, pp=2)),                      # the cp ring: sends between cp ranks
    ("llama", dict(dp=2, tp=1, cp=4, pp=1, cp_comm="all-gather", zero=1)),
    ("llama", dict(dp=1, tp=1, cp=4, pp=2, cp_comm="a2a+p2p", cp_a2a_size=2, recompute="full")),
    ("moe", dict(dp=4, tp=2, pp=2, ep=4, sp=True)),                # all-to-alls over the expert groups
    ("moe", dict(dp=4, tp=1, pp=1, ep=2, zero=1)),
]
IDS = [f"{fam}-" + "-".join(f"{k}{v}" for k, v in cfg.items()) for fam, cfg in GRID]
TOL = 0.005


def _case(family, cfg, gpt_small, llama_small):  # noqa: ANN001, ANN202
    if family == "moe":
        model = llama_small.with_overrides(layers=8, num_experts=8, moe_router_topk=2)
    else:
        model = (gpt_small if family == "gpt" else llama_small).with_overrides(layers=8)
    dp, pp = cfg.get("dp", 1), cfg.get("pp", 1)
    par = ParallelConfig(global_batch=4 * dp * pp, seq_len=256, **cfg)
    w = synthesize(model, par)
    return w, resolve_cluster(f"dgx-h100:{par.world_size}")


@pytest.mark.parametrize("family, cfg", GRID, ids=IDS)
def test_synth_traces_read_back(gpt_small, llama_small, tmp_path, family, cfg) -> None:
    """No durations in synth's traces: each kernel is timed from num_ops, tensor_size, op_kind."""
    w, cluster = _case(family, cfg, gpt_small, llama_small)
    out = tmp_path / "traces"
    with atomic_directory(out, force=False) as d:
        write_traces(w, d)
        from stage_cosim.manifest import build_manifest

        (d / "manifest.json").write_text(json.dumps(build_manifest(w, fmt="chakra", prefix="workload",
                                                                   groups_file="comm_groups.json", files=0,
                                                                   bytes_written=0)))
    for model in ("calibrated", "astra"):
        direct = simulate(w, cluster, model)[0].step_time_s
        back = simulate_traces(out, cluster, model)[0]
        assert back.step_time_s == pytest.approx(direct, rel=TOL), model
        assert back.config["compute"] == "GPU model"


@pytest.mark.parametrize("family, cfg", GRID, ids=IDS)
def test_export_reads_back(gpt_small, llama_small, tmp_path, run_cli, family, cfg) -> None:
    w, cluster = _case(family, cfg, gpt_small, llama_small)
    settings = AstraSettings(preferred_dataset_splits=2)
    d = tmp_path / "run"
    export(w, cluster, d, settings=settings)
    astra = simulate(w, cluster, "astra", astra_settings=settings)[0]
    calibrated = simulate(w, cluster)[0].step_time_s
    back = simulate_traces(d, cluster, "calibrated")[0]
    assert back.step_time_s == pytest.approx(calibrated, rel=TOL)
    assert back.config["compute"] == "trace durations"
    # the astra model charges the export's own whole-microsecond durations: equal to the ns
    back = simulate_traces(d / "traces", cluster, "astra", astra_settings=settings)[0]
    assert round(back.step_time_s * 1e9) == round(astra.step_time_s * 1e9)
    code, out, err = run_cli("astra-sim", "replay", f"--workload-configuration={d}/traces/workload",
                             f"--system-configuration={d}/system.json", f"--network-configuration={d}/network.yml",
                             f"--remote-memory-configuration={d}/memory.json",
                             f"--comm-group-configuration={d}/comm_groups.json", "--json")
    assert code == 0, err
    replayed = json.loads(out)
    assert replayed["max_finished_cycles"] == round(astra.step_time_s * 1e9)
    for role in astra.roles:
        assert replayed["finished_cycles"][w.mesh.rank(pp=role.stage)] == round(role.finish_s * 1e9)


def test_trace_locations(run_cli, tmp_path, llama_small) -> None:
    """An export's run directory, its traces/ folder, and traces with the group file given
    elsewhere all read the same (the issue's "no <prefix>.<rank>.et files" and "communicator
    group N is not in the group file")."""
    w, cluster = _case("llama", dict(dp=2, tp=2, pp=2), None, llama_small)
    d = tmp_path / "run"
    export(w, cluster, d)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (d / "comm_groups.json").rename(moved / "groups.json")
    base = ["simulate", "--cluster", "dgx-h100:8", "--json"]
    results = []
    for where in ([str(d), "--comm-groups", str(moved / "groups.json")],
                  [str(d / "traces"), "--comm-groups", str(moved / "groups.json")]):
        code, out, err = run_cli(*base, "--traces", *where)
        assert code == 0, err
        results.append(json.loads(out)["step_time_s"])
        code, out, err = run_cli("validate", *where)
        assert code == 0 and out.startswith("ok: 8 ranks"), out + err
    (moved / "groups.json").rename(d / "comm_groups.json")
    for where in (str(d), str(d / "traces")):
        code, out, err = run_cli(*base, "--traces", where)
        assert code == 0, err
        results.append(json.loads(out)["step_time_s"])
        code, out, _ = run_cli("validate", where)
        assert code == 0 and "no deadlock under" in out and "system.json" in out
    assert len(set(results)) == 1
    code, _, err = run_cli("validate", str(tmp_path))
    assert code == 2 and err.startswith("error: traces:") and "no <prefix>.<rank>.et" in err
