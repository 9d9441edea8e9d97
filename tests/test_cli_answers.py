"""Honest answers from the command line: one number per question, nothing lost, nothing raw,
and a report a planner can act on."""

from __future__ import annotations

import errno
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

GiB = 1 << 30
SMALL = ["--model", "llama3-8b", "--layers", "4", "--seq-len", "1024"]
PIPELINED = [*SMALL, "--tp", "2", "--pp", "4", "--dp", "2", "--global-batch", "32", "--cluster", "dgx-h100:16"]


# -- one number per question --------------------------------------------------------------------

@pytest.mark.parametrize("network", ["calibrated", "astra"])
def test_timeline_does_not_change_the_result(run_cli, tmp_path, network) -> None:
    """Recording a timeline must not change what is simulated: the same JSON, byte for byte,
    with the pipeline (the configuration where the node-level and pass-level paths differ in
    how they charge the pipeline's sends)."""
    code, plain, err = run_cli("simulate", *PIPELINED, "--network-model", network, "--json")
    assert code == 0, err
    tl = tmp_path / "tl.json"
    code, recorded, err = run_cli("simulate", *PIPELINED, "--network-model", network, "--json", "--timeline", str(tl))
    assert code == 0, err
    assert recorded == plain
    events = json.loads(tl.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 2, 3}      # one track per stage
    # and the text report is the same too (the breakdown columns included)
    code, text, _ = run_cli("simulate", *PIPELINED, "--network-model", network)
    code, text_tl, _ = run_cli("simulate", *PIPELINED, "--network-model", network, "--timeline", str(tl))
    assert text_tl.startswith(text.rstrip("\n"))


def _entry(step: float, par: dict, breakdown: dict, mem_gib: float = 10.0) -> dict:
    par = {"dp": 8, "tp": 2, "pp": 1, "micro_batch": 1, "zero": 1, "sp": True, "recompute": "none", **par}
    bd = {"compute": 0.0, "exposed_tp": 0.0, "exposed_dp": 0.0, **breakdown}
    point = {k: par[k] for k in ("tp", "pp", "micro_batch", "zero", "sp", "recompute")}
    return {"point": point, "config": {"parallel": par}, "step_time_s": step, "score": step, "mfu": 0.4,
            "peak_memory_bytes": int(mem_gib * GiB), "breakdown": bd}


def _doc(top: list[dict], proven: bool = False, feasible: int = 100, evaluations: int = 30) -> dict:
    return {"best": top[0], "top": top, "best_by_dtype": {}, "proven_optimal": proven, "method": "differential_evolution",
            "evaluations": evaluations, "space_size": 500, "interrupted": False, "infeasible": {},
            "feasible": feasible, "unexplored": 0 if proven else feasible - evaluations}


def test_optimize_report_folds_equivalent_variants_and_explains_ties(capsys) -> None:
    """Hand-built rankings: #2 = #1 with rc=selective and the same figures is folded into #1's
    row; #2 is then the first configuration that differs; a difference below the shown
    precision is said as a tie, with what differs in configuration."""
    from stage_cosim.cli.optimize_cmd import print_report
    from stage_cosim.search.evaluate import Objective

    a = _entry(8.16241, {}, {"compute": 7.6702, "exposed_tp": 0.459, "exposed_dp": 0.03321})
    a_rc = _entry(8.16241, {"recompute": "selective"}, {"compute": 7.6702, "exposed_tp": 0.459, "exposed_dp": 0.03321})
    b = _entry(8.16243, {"zero": 2}, {"compute": 7.6702, "exposed_tp": 0.459, "exposed_dp": 0.03323}, mem_gib=9.0)
    print_report(_doc([a, a_rc, b]), Objective("step-time"), 5)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit() and line[3:5] == "dp"]
    assert len(rows) == 2 and "(also: rc=selective)" in rows[0] and "zero2" in rows[1]
    assert "1 equivalent variant folded" in out
    why = next(line for line in out.splitlines() if line.startswith("why #1 beats #2"))
    assert "tie within the shown precision" in why and "zero2 (#1: zero1)" in why
    # not proven: said in the verdict and counted (feasible, not simulated)
    assert "not proven optimal" in out.splitlines()[0]
    assert "not proven optimal: 70 of 100 structurally feasible configurations not simulated" in out


def test_optimize_report_why_names_the_categories(capsys) -> None:
    from stage_cosim.cli.optimize_cmd import print_report
    from stage_cosim.search.evaluate import Objective

    a = _entry(8.1624, {}, {"compute": 7.6702, "exposed_tp": 0.459, "exposed_dp": 0.0332})
    b = _entry(8.2012, {"micro_batch": 2}, {"compute": 7.6702, "exposed_tp": 0.459, "exposed_dp": 0.0720})
    print_report(_doc([a, b], proven=True), Objective("step-time"), 5)
    out = capsys.readouterr().out
    why = next(line for line in out.splitlines() if line.startswith("why #1 beats #2"))
    assert why == "why #1 beats #2 (+0.0388 s per step; #2 has mb2 (#1: mb1)): exposed dp +0.0388 s"
    assert "proven optimum" in out and "not proven" not in out


@pytest.mark.slow
def test_optimize_counts_what_it_left_unexplored(run_cli) -> None:
    """The JSON's and the text's count of unexplored configurations: the structurally feasible
    distinct configurations of the space (enumerated here) less those simulated."""
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.model import get_preset
    from stage_cosim.search.space import canonical, check, default_space

    args = ["optimize", "--model", "llama3-8b", "--layers", "4", "--cluster", "dgx-h100:16", "--global-batch", "32",
            "--seq-len", "1024", "--budget", "10", "--quiet"]
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    doc = json.loads(out)
    cluster = resolve_cluster("dgx-h100:16")
    space = default_space(get_preset("llama3-8b").with_overrides(layers=4), cluster, 32, 1024)
    distinct = {json.dumps(canonical(space, p), sort_keys=True): canonical(space, p) for p in space.points()}
    checked = (check(space, p, cluster) for p in distinct.values())      # (config or None, broken rule)
    feasible = sum(config is not None for config, _rule in checked)
    assert not doc["proven_optimal"] and doc["feasible"] == feasible
    assert doc["unexplored"] == feasible - doc["evaluations"] > 0
    code, text, _ = run_cli(*args)
    assert f"not proven optimal: {feasible - doc['evaluations']:,} of {feasible:,}" in text
    assert next(line for line in text.splitlines() if line.startswith("why #1 beats #2")).split(":", 1)[1].strip()


TINY_MODEL = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1024,
              "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1024,
              "max_position_embeddings": 1024}


def _explore_spec(tmp_path: Path, baseline_budget: int | None) -> Path:
    spec = tmp_path / "spec.yaml"
    doc = {"model_config": TINY_MODEL, "baseline": "dgx-h100:8", "global_batch": 1, "seq_len": 256,
           "variables": {"gpu.hbm_GBps": {"min": 2000, "max": 6000}}, "cost": {"base": 1000, "gpu.hbm_GBps": 1},
           "points": 2, "candidates": 4, "inner_budget": 4, "reuse_top": 3}
    if baseline_budget is not None:
        doc["baseline_budget"] = baseline_budget
    spec.write_text(yaml.safe_dump(doc))
    return spec


@pytest.mark.slow
def test_explore_says_whether_the_baseline_is_proven(run_cli, tmp_path) -> None:
    """By default the baseline is searched as optimize searches it: here (a small space) the
    exhaustive optimum of the baseline cluster, found by an exhaustive search of its own, and the
    report says so, however small the candidates' inner budget; with a baseline budget below the
    space it says it is not proven and how much it left."""
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.model.hf import model_from_hf_dict
    from stage_cosim.search.optimize import OptimizeSettings, optimize
    from stage_cosim.search.space import default_space

    cluster = resolve_cluster("dgx-h100:8")
    truth = optimize(default_space(model_from_hf_dict(TINY_MODEL, "model_config"), cluster, 1, 256), cluster,
                     OptimizeSettings())
    assert truth.proven_optimal
    code, out, err = run_cli("explore", str(_explore_spec(tmp_path, None)), "--json", "--quiet")
    assert code == 0, err
    base = json.loads(out)["baseline"]
    assert base["proven_optimal"] and base["unexplored"] == 0
    assert base["step_time_s"] == pytest.approx(truth.best.score, rel=1e-12)
    code, text, _ = run_cli("explore", str(_explore_spec(tmp_path, None)), "--quiet")
    assert "the baseline's proven optimum" in text
    code, out, err = run_cli("explore", str(_explore_spec(tmp_path, 2)), "--json", "--quiet")
    assert code == 0, err
    base = json.loads(out)["baseline"]
    assert not base["proven_optimal"] and 0 < base["unexplored"] < truth.feasible
    code, text, _ = run_cli("explore", str(_explore_spec(tmp_path, 2)), "--quiet")
    assert f"not proven optimal: the best the inner searches found, {base['unexplored']:,} structurally" in text
    assert "a larger baseline_budget explores more" in text


# -- nothing lost, nothing raw --------------------------------------------------------------------

def _one_line(code: int, err: str, param: str) -> None:
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {param}:"), err


@pytest.mark.parametrize("name, param", [("nodir/x.json", "timeline"), (".", "timeline"), ("t.txt", "timeline")])
def test_simulate_timeline_checked_first(run_cli, tmp_path, name, param) -> None:
    target = tmp_path / name
    code, out, err = run_cli("simulate", *SMALL, "--tp", "2", "--cluster", "dgx-h100:2", "--timeline", str(target))
    _one_line(code, err, param)
    assert out == "" and sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["simulate", "optimize", "explore"])
@pytest.mark.parametrize("name", ["out.txt", "nodir/p.png", "."])
def test_plots_checked_first(run_cli, tmp_path, command, name) -> None:
    """--plot is refused before any work (an unsupported format, a missing folder, a folder):
    nothing printed, nothing written."""
    args = {"simulate": ["simulate", *SMALL, "--tp", "2", "--cluster", "dgx-h100:2"],
            "optimize": ["optimize", *SMALL[:4], "--cluster", "dgx-h100:8", "--global-batch", "8", "--seq-len", "512",
                         "--budget", "3"],
            "explore": ["explore", str(tmp_path / "missing-spec.yaml")]}[command]
    code, out, err = run_cli(*args, "--plot", str(tmp_path / name))
    _one_line(code, err, "plot")
    assert out == "" and sorted(tmp_path.iterdir()) == []


def test_synth_out_checked_first(run_cli) -> None:
    if not Path("/proc/self").exists():
        pytest.skip("needs /proc (a folder nobody can create files in)")
    code, out, err = run_cli("synth", *SMALL, "--out", "/proc/stage-cosim-test")
    _one_line(code, err, "out")


def test_a_failed_write_loses_no_result(run_cli, tmp_path, monkeypatch) -> None:
    """The result is printed first; a write that fails afterwards (a full disk) is the one
    error line and exit status 2."""
    import stage_cosim.adapters.roofline.timeline as timeline
    import stage_cosim.cli.optimize_cmd as optimize_cmd

    def full_disk(*args, **kw) -> None:  # noqa: ANN002, ANN003
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(timeline, "write_timeline", full_disk)
    code, out, err = run_cli("simulate", *PIPELINED, "--json", "--timeline", str(tmp_path / "tl.json"))
    assert json.loads(out)["step_time_s"] > 0
    _one_line(code, err, "timeline")
    assert "No space left on device" in err
    monkeypatch.setattr(optimize_cmd, "save_figure", full_disk)
    code, out, err = run_cli("optimize", *SMALL[:4], "--cluster", "dgx-h100:8", "--global-batch", "8",
                             "--seq-len", "512", "--budget", "3", "--quiet", "--plot", str(tmp_path / "p.png"))
    assert out.startswith("best: ")
    _one_line(code, err, "plot")


def test_cluster_count_zero_refused(run_cli) -> None:
    code, _, err = run_cli("simulate", *SMALL, "--tp", "8", "--cluster", "dgx-h100:0")
    _one_line(code, err, "cluster")
    assert "positive" in err


def test_cluster_yaml_missing_field(run_cli, tmp_path) -> None:
    c = tmp_path / "c.yaml"
    c.write_text("name: x\nnum_gpus: 8\ngpu: H100-SXM\nscale_up: {gpus_per_domain: 8, bandwidth_GBps: 450}\n"
                 "scale_out: {bandwidth_GBps: 50, latency_ns: 2000}\n")
    code, _, err = run_cli("simulate", *SMALL, "--tp", "8", "--cluster", str(c))
    _one_line(code, err, "cluster.scale_up.latency_ns")
    assert err.startswith("error: cluster.scale_up.latency_ns: is required") and "TypeError" not in err
    c.write_text("name: x\nnum_gpus: 8\ngpu: {base: H100-SXM, hbm_GBps: fast}\n"
                 "scale_up: {gpus_per_domain: 8, bandwidth_GBps: 450, latency_ns: 700}\n"
                 "scale_out: {bandwidth_GBps: .nan, latency_ns: 2000}\n")
    code, _, err = run_cli("simulate", *SMALL, "--tp", "8", "--cluster", str(c))
    _one_line(code, err, "cluster.gpu.hbm_GBps")


@pytest.mark.slow
def test_serve_port_in_use_one_line() -> None:
    """No line of gRPC's own logging before the error, and no pointer to gRPC's settings."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "stage_cosim", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: port: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_learned_positions_bound_training_sequences(run_cli) -> None:
    gpt2 = str(Path(__file__).parent / "data" / "hf" / "gpt2" / "config.json")
    code, _, err = run_cli("simulate", "--model", gpt2, "--seq-len", "2048", "--global-batch", "1")
    _one_line(code, err, "seq-len")
    assert "1024" in err
    code, _, err = run_cli("synth", "--model", gpt2, "--seq-len", "1025", "--out", "unused")
    _one_line(code, err, "seq-len")


def test_rope_beyond_max_positions_warns_once(run_cli) -> None:
    code, out, err = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", "--seq-len", "16384",
                             "--cluster", "dgx-h100:1")
    assert code == 0 and "step time" in out
    assert err.count("\n") == 1 and err.startswith("warning: seq-len 16,384 exceeds llama3-8b's "
                                                   "max_position_embeddings (8,192)")
    code, _, err = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", "--seq-len", "8192",
                           "--cluster", "dgx-h100:1")
    assert code == 0 and err == ""


def test_synth_counts_every_file(run_cli, tmp_path) -> None:
    out = tmp_path / "t"
    code, text, err = run_cli("synth", *SMALL, "--tp", "2", "--pp", "2", "--dp", "2", "--cp", "2", "--global-batch", "8",
                              "--out", str(out))
    assert code == 0, err
    files = list(out.iterdir())
    assert len(files) == 2 * 2 * 2 * 2 + 2          # a trace per rank, the groups, the manifest
    assert f"wrote {len(files)} files, " in text
    assert f"{sum(f.stat().st_size for f in files) / 2**20:.1f} MiB" in text
    assert "16 ranks (dp2 tp2 cp2(p2p) pp2)" in text


# -- a report a planner can act on --------------------------------------------------------------

def test_simulate_report_names_model_cluster_and_memory(run_cli) -> None:
    """Llama 3 8B, unsharded, no ZeRO: weights 2, gradients 4 and Adam 12 bytes per parameter
    (mixed precision), against the H100's 80 GiB; Meta's published count is 8.03 B."""
    from stage_cosim.model import get_preset

    params = get_preset("llama3-8b").param_count()
    assert params / 1e9 == pytest.approx(8.03, abs=0.005)
    code, out, err = run_cli("simulate", "--model", "llama3-8b", "--seq-len", "256", "--global-batch", "8",
                             "--dp", "8", "--cluster", "dgx-h100:8")
    assert code == 0, err
    assert "model            llama3-8b: 8.03 B parameters" in out and "active" not in out.split("\n")[0]
    assert "cluster          dgx-h100: 8 x H100-SXM (80 GiB HBM)" in out
    lines = out.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("memory per GPU")))
    cols = lines[head + 1].split()
    row = dict(zip(cols, lines[head + 2].split()))
    for category, per_param in (("weights", 2), ("gradients", 4), ("optimizer", 12)):
        assert float(row[category]) == pytest.approx(per_param * params / GiB, abs=0.006), category
    total = float(row["total"])
    assert row["of"] == f"{100 * total / 80:.0f}%"
    code, out, _ = run_cli("simulate", "--model", "mixtral-8x7b", "--layers", "2", "--seq-len", "256",
                           "--global-batch", "8", "--dp", "8", "--ep", "8", "--cluster", "dgx-h100:8")
    assert code == 0 and "B active per token" in out.splitlines()[0]


def test_simulate_does_not_fit_shows_why(run_cli) -> None:
    code, out, _ = run_cli("simulate", "--model", "llama3-70b", "--layers", "20", "--seq-len", "1024", "--global-batch",
                           "1", "--cluster", "dgx-h100:1")
    assert code == 0 and "DOES NOT FIT" in out
    lines = out.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("memory per GPU")))
    row = dict(zip(lines[head + 1].split(), lines[head + 2].split()))
    assert float(row["total"]) > 80 and int(row["of"].rstrip("%")) > 100


def test_training_time_and_cost(run_cli) -> None:
    """N tokens take N / (tokens per step) steps of the simulated step; the cost is the GPU-hours
    at the price."""
    args = ["simulate", *SMALL, "--tp", "2", "--dp", "4", "--global-batch", "8", "--cluster", "dgx-h100:8"]
    code, out, err = run_cli(*args, "--json", "--train-tokens", "2T", "--price", "2.5")
    assert code == 0, err
    doc = json.loads(out)
    step, gpus = doc["step_time_s"], 8
    steps = 2e12 / (8 * 1024)
    run = doc["training_run"]
    assert run["steps"] == pytest.approx(steps, rel=1e-12)
    assert run["seconds"] == pytest.approx(steps * step, rel=1e-9)
    assert run["cost"] == pytest.approx(steps * step / 3600 * gpus * 2.5, rel=1e-9)
    code, out, _ = run_cli(*args, "--train-tokens", "2T", "--price", "2.5")
    assert f"{steps:,.0f} steps" in out and f"${steps * step / 3600 * gpus * 2.5:,.0f} at $2.5/GPU-h" in out
    for bad, param in ((["--train-tokens", "-3"], "train-tokens"), (["--train-tokens", "lots"], "train-tokens"),
                       (["--price", "nan"], "price"), (["--price", "0"], "price")):
        code, _, err = run_cli(*args, *bad)
        _one_line(code, err, param)


def test_simulate_plot_per_stage(run_cli, tmp_path) -> None:
    png = tmp_path / "stages.png"
    code, out, err = run_cli("simulate", *PIPELINED, "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in out


# -- every rank, cheaply --------------------------------------------------------------------------

def _workload(kw: dict, cluster: str):
    from stage_cosim.hardware import resolve_cluster
    from stage_cosim.model import get_preset
    from stage_cosim.parallel import ParallelConfig
    from stage_cosim.workload import synthesize

    par = ParallelConfig(**kw)
    return synthesize(get_preset("llama3-8b").with_overrides(layers=4), par), resolve_cluster(cluster)


@pytest.mark.parametrize("kw, cluster, proven", [
    (dict(tp=2, dp=2, pp=2, global_batch=8, seq_len=1024, sp=True, zero=1), "dgx-h100:8", True),
    (dict(tp=2, dp=8, pp=2, global_batch=16, seq_len=1024, zero=3), "dgx-h100:32", True),
    # stage 0's pipeline sends: rank 0 -> 6 stays in its NVLink domain, rank 2 -> 8 crosses
    # to the next: the ranks of a stage are not copies of each other
    (dict(tp=2, dp=3, pp=4, global_batch=12, seq_len=1024), "dgx-h100:24", False),
])
def test_every_rank_replays_one_per_stage_where_proven(kw, cluster, proven) -> None:
    """--full's answer is the per-rank replay's, to the last bit, whether it replays one rank
    per stage (where every rank is proven a copy of its stage's) or all of them."""
    from stage_cosim.adapters.roofline.simulate import simulate, simulate_every_rank

    w, c = _workload(kw, cluster)
    every, _, programs = simulate_every_rank(w, c)
    full, rep, full_programs = simulate(w, c, symmetric=False)
    assert every.config["ranks_replayed"] == (w.parallel.pp if proven else w.world_size) == len(programs)
    assert every.step_time_s == full.step_time_s
    for a, p in enumerate(full_programs):
        assert rep.finish[a] == every.roles[w.role_of(p.rank)].finish_s


def test_full_cli_reports_the_replay(run_cli) -> None:
    code, out, err = run_cli("simulate", *PIPELINED, "--full")
    assert code == 0, err
    assert "4 of 16 ranks replayed (each stands for its pipeline stage: proven exact for every rank)" in out


def test_a_serving_search_states_one_proof() -> None:
    """Every feasible layout simulated is a proof whatever method visited them; otherwise the
    count of feasible layouts never simulated (never "not proven, 0 unexplored")."""
    from stage_cosim.search.evaluate import Evaluation, Objective
    from stage_cosim.search.optimize import OptimizeResult
    from stage_cosim.search.serving import proof

    def result(feasible: int | None, evaluated: int, interrupted: bool = False) -> OptimizeResult:
        evs = [Evaluation({"tp": i}, None, True, None, 1.0, {}) for i in range(evaluated)]
        return OptimizeResult(Objective(), evs, False, {}, 50, "differential_evolution", interrupted,
                              feasible=feasible)

    assert proof(result(3, 3)) == (True, 0)
    assert proof(result(5, 3)) == (False, 2)
    assert proof(result(3, 3, interrupted=True))[0] is False
    assert proof(result(None, 3)) == (False, None)
