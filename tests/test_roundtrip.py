"""Our traces read back: ``synth`` and ``astra-sim export`` output simulated with ``--traces``
give the step time of the direct simulation (``synth``'s with the calibrated model up to the order
of floating-point sums, otherwise within 0.5 %), and
``astra-sim replay`` of an export gives the astra model's times to the nanosecond.

The grid is the list below; a new parallelism (cp, ep …) is one more entry.
"""

from __future__ import annotations

import json

import pytest

from stage_cosim.adapters.astra_sim.export import AstraSettings, export
from stage_cosim.adapters.simulate import simulate, simulate_traces
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
        direct = simulate(w, cluster, model).result.step_time_s
        back = simulate_traces(out, cluster, model).result
        # the calibrated model times the same graphs (measured: 1e-14 apart); the astra model
        # differs by up to 0.1 % read back
        assert back.step_time_s == pytest.approx(direct, rel=1e-9 if model == "calibrated" else TOL), model
        assert back.config["compute"] == "GPU model"


@pytest.mark.parametrize("family, cfg", GRID, ids=IDS)
def test_export_reads_back(gpt_small, llama_small, tmp_path, run_cli, family, cfg) -> None:
    w, cluster = _case(family, cfg, gpt_small, llama_small)
    settings = AstraSettings(preferred_dataset_splits=2)
    d = tmp_path / "run"
    export(w, cluster, d, settings=settings)
    astra = simulate(w, cluster, "astra", astra_settings=settings).result
    calibrated = simulate(w, cluster).result.step_time_s
    back = simulate_traces(d, cluster, "calibrated").result
    assert back.step_time_s == pytest.approx(calibrated, rel=TOL)
    assert back.config["compute"] == "trace durations"
    # the astra model charges the export's own whole-microsecond durations: equal to the ns
    back = simulate_traces(d / "traces", cluster, "astra", astra_settings=settings).result
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


# -- the astra model reads a run directory's own system and network -------------------------------------

K16 = ["--model", "llama3-8b", "--layers", "4", "--cluster", "dgx-h100:16", "--tp", "2", "--pp", "2", "--dp", "4",
       "--global-batch", "16", "--seq-len", "1024"]


def test_astra_reads_the_run_directorys_system(run_cli, tmp_path) -> None:
    """``simulate --traces RUN --network-model astra`` runs RUN/system.json and RUN/network.yml,
    as the binary does, not the command line's defaults; flags given explicitly override the
    file's fields."""
    from astra_inputs import BINARY, run_binary, replay_args

    d = tmp_path / "k16"
    code, _, err = run_cli("astra-sim", "export", *K16, "--dataset-splits", "16", "--active-chunks", "2", "--out", str(d))
    assert code == 0, err

    def step(*args: str) -> int:
        code, out, err = run_cli("simulate", *args, "--network-model", "astra", "--json")
        assert code == 0, err
        return round(json.loads(out)["step_time_s"] * 1e9)

    from_files = step("--traces", str(d), "--cluster", "dgx-h100:16")
    code, out, err = run_cli(*replay_args(d), "--json")
    assert code == 0, err
    assert from_files == json.loads(out)["max_finished_cycles"]
    assert from_files == step(*K16, "--dataset-splits", "16", "--active-chunks", "2")
    assert from_files != step(*K16)                          # the defaults (4 splits, 1 chunk) differ
    if BINARY:
        real = run_binary(d, 16)
        assert isinstance(real, dict) and max(end.finished for end in real.values()) == from_files
    # an explicit flag overrides the file's field, the others stay the file's
    assert step("--traces", str(d), "--cluster", "dgx-h100:16", "--dataset-splits", "4") == \
        step(*K16, "--dataset-splits", "4", "--active-chunks", "2")


# -- traces the simulator would deadlock on ---------------------------------------------------------------

def _deadlocking(tmp_path, llama_small):  # noqa: ANN001, ANN202
    """A plain trace directory (no system or network file): the tied-embedding order the issue
    found (the last stage's embedding all-reduce ahead of its last backward send)."""
    import shutil

    from test_astra_replay import _tied_workload, _undo_the_flush

    w, cluster = _tied_workload(pp=2, vp=1)
    d = tmp_path / "run"
    export(w, cluster, d)
    _undo_the_flush(d / "traces" / "workload.1.et")
    plain = tmp_path / "plain"
    shutil.copytree(d / "traces", plain)
    shutil.copy(d / "comm_groups.json", plain / "comm_groups.json")
    return plain


def test_validate_without_files_still_finds_deadlocks(run_cli, tmp_path, llama_small) -> None:
    from stage_cosim.trace import et_def_pb2 as pb
    from test_traces import _rewrite

    plain = _deadlocking(tmp_path, llama_small)
    code, out, err = run_cli("validate", str(plain))
    assert code == 1 and "deadlock" in out and "tied_grad_ar" in out and "nominal network" in out, out + err
    # with a MEM_LOAD node too: refused for it (the simulator aborts whatever the system), never "ok"
    _rewrite(plain / "workload.0.et", lambda ns: setattr(next(n for n in ns if n.type == pb.COMP_NODE), "type",
                                                         pb.MEM_LOAD_NODE))
    code, out, err = run_cli("validate", str(plain))
    assert code == 1 and "MEM_LOAD" in out and not out.startswith("ok"), out + err


def test_calibrated_model_warns_on_traces_astra_sim_deadlocks_on(run_cli, tmp_path, llama_small) -> None:
    """The calibrated model overlaps communication streams as real clusters do and finishes
    these traces; it says on stderr that ASTRA-sim would not, naming the ranks and nodes. The
    astra model refuses them in one line."""
    plain = _deadlocking(tmp_path, llama_small)
    code, out, err = run_cli("simulate", "--traces", str(plain), "--cluster", "dgx-h100:2", "--json")
    assert code == 0 and json.loads(out)["step_time_s"] > 0
    assert err.startswith("warning: ASTRA-sim would never finish these traces") and "rank 1 node" in err
    assert "tied_grad_ar" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli("simulate", "--traces", str(plain), "--cluster", "dgx-h100:2", "--network-model", "astra")
    assert code == 2 and err.startswith("error: traces: deadlock") and len(err.strip().splitlines()) == 1


# -- traces from another generator: no op_kind ------------------------------------------------------------

def test_foreign_traces_are_timed_by_op_type(tmp_path) -> None:
    """A trace without our op_kind attribute (PyTorch operator and kernel names, num_ops and
    tensor_size only): GEMMs at the tensor-core rate, attention at the attention rate, other named
    ops memory-bound on their tensor_size, an unnamed node by its arithmetic intensity. Each time
    is the closed form from the GPU's calibrated parameters (compute.py's roofline)."""
    from stage_cosim.trace.chakra import TraceNode, write_trace_file

    cluster = resolve_cluster("dgx-h100:1")
    g = cluster.gpu
    overhead, bw = g.kernel_overhead_us * 1e-6, g.hbm_GBps * 1e9 * g.memory_efficiency
    peak = g.bf16_tflops * 1e12
    n = 4096
    gemm_f, gemm_b = 2 * n ** 3, 3 * n * n * 2
    attn_f, attn_b = 4 * 2048 * 2048 * 128 * 32, 4 * 2048 * 128 * 32 * 2
    soft_f, soft_b = 5 * n * n, 2 * n * n * 2
    nodes = [("aten::mm", gemm_f, gemm_b), ("aten::_scaled_dot_product_flash_attention", attn_f, attn_b),
             ("aten::softmax", soft_f, soft_b), ("node3", gemm_f, gemm_b), ("node4", soft_f, soft_b)]
    expected = [
        gemm_f / (peak * g.matmul_efficiency * gemm_f / (gemm_f + g.matmul_half_flops)) + overhead,
        attn_f / (peak * g.attention_efficiency) + overhead,
        soft_b / bw + overhead,            # memory-bound: 5 FLOP per element does not reach the vector ridge
        gemm_f / (peak * g.matmul_efficiency * gemm_f / (gemm_f + g.matmul_half_flops)) + overhead,
        soft_b / bw + overhead,
    ]
    kinds = {"is_cpu_op": "bool_val", "num_ops": "uint64_val", "tensor_size": "uint64_val"}
    trace = [TraceNode(i, name, 4, [i - 1] if i else [], [], 0, {"is_cpu_op": False, "num_ops": f, "tensor_size": b},
                       kinds) for i, (name, f, b) in enumerate(nodes)]
    (tmp_path / "t").mkdir()
    write_trace_file(tmp_path / "t" / "foreign.0.et", trace)
    for model in ("calibrated", "astra"):
        got = simulate_traces(tmp_path / "t", cluster, model).result
        assert got.config["compute"] == "GPU model"
        assert got.step_time_s == pytest.approx(sum(expected), rel=1e-6 if model == "calibrated" else 1e-5), model
