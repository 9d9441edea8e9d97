"""No silent answers: an input the tool cannot honour is refused in one line (or answered as
such), never run as something else, and a result it prints is whole."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from astra_inputs import coll, p2p, replay_args, system, write_inputs
from stage_cosim.adapters.astra_sim.astra_system import COLLECTIVES
from stage_cosim.hardware.network import NetworkDim

HF = Path(__file__).parent / "data" / "hf"
SMALL = ["--model", "llama3-8b", "--layers", "2", "--seq-len", "256"]


def _one_line_error(code: int, err: str, parameter: str) -> None:
    assert code == 2, err
    assert err.startswith(f"error: {parameter}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


# -- sizes: refused up front, with the limit --------------------------------------------------------

@pytest.mark.parametrize("command", ["simulate", "synth", "astra-sim export"])
def test_micro_batch_zero_is_refused_not_run_as_one(run_cli, tmp_path, command) -> None:
    out = tmp_path / "out"
    extra = [] if command == "simulate" else ["--out", str(out)]
    code, stdout, err = run_cli(*command.split(), *SMALL, "--micro-batch", "0", *extra)
    _one_line_error(code, err, "micro-batch")
    assert "0" in err and stdout == "" and not out.exists()


def test_micro_batch_zero_is_refused_by_the_library() -> None:
    from stage_cosim import api
    from stage_cosim.errors import UserError

    with pytest.raises(UserError) as exc:
        api.simulate({"model": "llama3-8b", "layers": 2, "seq_len": 256, "micro_batch": 0})
    assert exc.value.parameter == "micro-batch"


def test_a_world_beyond_the_limit_is_refused_with_the_limit(run_cli) -> None:
    """A billion ranks: refused at once, naming the largest world the tool simulates (2^20
    ranks), instead of growing past gigabytes of memory."""
    code, _, err = run_cli("simulate", "--cluster", "dgx-h100:1000000000", "--dp", "1000000000")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert "1,000,000,000" in err and f"{2 ** 20:,}" in err
    # a cluster alone, or a parallel configuration alone, is refused the same way
    code, _, err = run_cli("simulate", "--cluster", "dgx-h100:2097152")
    _one_line_error(code, err, "cluster")
    assert f"{2 ** 20:,}" in err
    code, _, err = run_cli("optimize", "--cluster", "dgx-h100:2097152", "--global-batch", "8", "--seq-len", "256")
    _one_line_error(code, err, "cluster")
    code, _, err = run_cli("synth", "--tp", "8", "--dp", "262144", "--out", "unused")
    _one_line_error(code, err, "dp")
    assert "2,097,152" in err and f"{2 ** 20:,}" in err


# -- optimize: no feasible configuration is an answer (exit 1) with its reasons --------------------

LLAMA_405B_PARAMS = (126 * (2 * 16384 * 16384 + 2 * 16384 * 8 * 128      # q, o; k, v (8 kv heads of 128)
                            + 3 * 16384 * 53248 + 2 * 16384)              # SwiGLU MLP; two RMSNorms
                     + 2 * 128256 * 16384 + 16384)                         # untied embedding and head; final norm


def test_optimize_without_a_feasible_configuration_exits_1_with_the_reasons(run_cli) -> None:
    """Llama 3.1 405B on 8 H100s: its weights (bf16, 2 B), gradients (fp32, 4 B) and Adam state
    (fp32 master, m, v: 12 B) alone need 18 B per parameter; however sharded, 8 GPUs of 80 GiB
    (2 % headroom) cannot hold them: at least ceil(18 P / (0.98 * 80 GiB)) GPUs."""
    assert LLAMA_405B_PARAMS == 405_853_388_800
    need = math.ceil(18 * LLAMA_405B_PARAMS / (0.98 * 80 * 2 ** 30))
    assert need == 87
    code, out, err = run_cli("optimize", "--model", "llama3.1-405b", "--cluster", "dgx-h100:8",
                             "--global-batch", "8", "--seq-len", "4096", "--quiet")
    assert code == 1, err
    assert "no feasible configuration" in out
    assert f"needs >= {need} GPUs" in out and "the cluster has 8" in out
    *reasons, memory = out.split("infeasible, by rule:", 1)[1].strip().splitlines()
    assert reasons and all(re.match(r"\s*\d+\s+\S", line) for line in reasons)     # a count per rule
    assert any(line.split(None, 1)[1] == "does not fit in memory" for line in reasons)
    assert memory.startswith(f"memory: needs >= {need} GPUs")
    code, js, _ = run_cli("optimize", "--model", "llama3.1-405b", "--cluster", "dgx-h100:8",
                          "--global-batch", "8", "--seq-len", "4096", "--quiet", "--json")
    doc = json.loads(js)
    assert code == 1 and doc["best"] is None and doc["memory_needs_gpus"] == need


def test_serving_search_without_a_feasible_layout_exits_1_with_the_reasons_grouped(run_cli) -> None:
    """Llama 3.1 405B serving on 2 H100s: its bf16 weights alone (2 B x 405.9 B parameters =
    756 GiB) exceed the 160 GiB of the two GPUs, so no layout leaves room for a KV cache. That is
    an answer (exit 1, text and JSON alike, as the training search), and the layouts that fail
    for that one reason are counted on one line, not one line per layout."""
    assert 2 * LLAMA_405B_PARAMS > 2 * 80 * 2 ** 30
    args = ("optimize", "--phase", "serve", "--model", "llama3.1-405b", "--cluster", "dgx-h100:2",
            "--slo-ttft", "0.5", "--num-requests", "20", "--quiet")
    code, out, err = run_cli(*args)
    assert code == 1 and "no feasible serving layout" in err and "Traceback" not in err
    reasons = out.split("infeasible, by rule:", 1)[1].strip().splitlines()
    kv = [line for line in reasons if "no KV cache" in line]
    assert len(kv) == 1 and not any(" on tp" in line for line in reasons), reasons
    code, js, _ = run_cli(*args, "--json")
    doc = json.loads(js)
    assert code == 1 and doc["best"] is None and sum(doc["infeasible"].values()) > 0


def test_optimize_interrupted_before_any_result_does_not_claim_infeasibility(run_cli, monkeypatch) -> None:
    """A Ctrl-C during the first simulation: nothing was found yet, which is not the same as
    nothing being feasible."""
    import stage_cosim.search.optimize as opt

    def interrupted(*_args, **_kw):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(opt, "evaluate", interrupted)
    code, out, err = run_cli("optimize", *SMALL, "--cluster", "dgx-h100:8", "--global-batch", "8", "--quiet")
    assert code == 130, err
    assert "no feasible" not in out + err
    assert "interrupted" in out and "before any" in out


# -- Mixture-of-Experts families ----------------------------------------------------------------------

MODELLED_MOE = "deepseek_v2, deepseek_v3, gpt_oss, jamba, llama4, llama4_text, mixtral, qwen2_moe, qwen3_moe, qwen3_next"


@pytest.mark.parametrize("config, family", [
    ({"model_type": "olmoe", "num_experts": 64}, "olmoe"),
    ({"architectures": ["PhimoeForCausalLM"], "num_local_experts": 16}, "phimoe"),
    ({"model_type": "dbrx", "architectures": ["DbrxForCausalLM"]}, "dbrx"),
    ({"model_type": "granitemoe", "num_local_experts": 16}, "granitemoe"),
])
def test_an_unmodelled_moe_family_is_named_beside_the_modelled_ones(run_cli, tmp_path, config, family) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, _, err = run_cli("simulate", "--model", str(path))
    _one_line_error(code, err, "model")
    assert f"the {family} Mixture-of-Experts family is not modelled" in err
    assert f"(modelled Mixture-of-Experts families: {MODELLED_MOE})" in err


# -- ASTRA-sim: an all-reduce the binary aborts on (Assertion chunk_size > 0) -------------------------

def _lbw_run(tmp_path: Path, size: int) -> Path:
    """Switch 2 x Ring 4, all-reduce [direct, halvingDoubling], localBWAware, 3 splits.

    The binary's chunk: C = size // 3, raised to the 8 ranks when smaller. localBWAware
    reduce-scatters over the Switch (direct: C // 2 left), then all-reduces over the Ring with
    halvingDoubling: its messages halve (C'//2, C'//4) and, at the turn, halve once more before
    doubling back: 2 * (C' // 8), 0 bytes whenever C' < 8, i.e. C < 16: every size below 48."""
    impls = {c: ("direct", "halvingDoubling") for c in COLLECTIVES}
    dims = [NetworkDim("Switch", 2, 50, 500), NetworkDim("Ring", 4, 50, 500)]
    sysconf = system(preferred_dataset_splits=3, collective_optimization="localBWAware", implementations=impls)
    return write_inputs(tmp_path / f"run{size}", {r: [coll(0, 0, size)] for r in range(8)}, dims, sysconf)


@pytest.mark.parametrize("size", [1, 23, 24, 47])
def test_all_reduce_the_binary_aborts_on_is_refused(run_cli, tmp_path, size) -> None:
    d = _lbw_run(tmp_path, size)
    code, out, err = run_cli("validate", str(d))
    assert code == 1, out + err
    assert "node 0" in out and "halvingDoubling" in out and "ALL_REDUCE" in out and "0-byte" in out
    code, out, err = run_cli(*replay_args(d), "--json")
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert "halvingDoubling" in err and "0-byte" in err


def test_the_smallest_such_all_reduce_the_binary_runs_is_replayed(run_cli, tmp_path) -> None:
    d = _lbw_run(tmp_path, 48)
    code, out, err = run_cli("validate", str(d))
    assert code == 0, out + err
    code, out, err = run_cli(*replay_args(d), "--json")
    assert code == 0, err


def test_halving_doubling_all_gather_half_sends_the_binarys_sizes() -> None:
    """The binary's halvingDoubling all-reduce over 4 ranks of a 12-byte chunk: it sends 6 and
    3 bytes reducing, then 12 // 8 * 2 = 2 and 4 bytes gathering (not 3 and 6)."""
    from stage_cosim.adapters.astra_sim.astra_phases import _halving_doubling_blocks
    from stage_cosim.adapters.astra_sim.astra_system import ALL_REDUCE

    blocks = _halving_doubling_blocks(ALL_REDUCE, 4, 12, lambda m: 0)
    assert [b.size for b in blocks] == [6, 3, 2, 4]


# -- ASTRA-sim: a result whose finished lines are incomplete is never parsed --------------------------

def _standin_run_dir(tmp_path: Path, ranks: int) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "network.yml").write_text(f"topology: [ Switch ]\nnpus_count: [ {ranks} ]\n")
    return d


def test_results_lost_on_exit_are_rerun(tmp_path, standin, monkeypatch) -> None:
    """The binary's double free on exit can kill it before its log prints every result: the
    first run here prints 6 of 8 finished lines and aborts; the rerun is whole and is the one
    returned (rank r of the stand-in finishes at 1000 (r + 1) cycles)."""
    from stage_cosim.adapters.astra_sim.run import run

    d = _standin_run_dir(tmp_path, 8)
    monkeypatch.setenv("STANDIN_MODE", "drop-on-exit-once")
    done = run(standin, d, 8)
    assert sorted(done.output.finished_ns) == list(range(8))
    assert done.output.finished_ns[7] == 8000


def test_a_run_that_lost_every_result_on_exit_is_rerun(tmp_path, standin, monkeypatch) -> None:
    """Seen on the real binary (5 in 300 runs of a tied-embedding pp3 dp2 export): the abort or
    segfault of its double free on exit can come before the log printed any rank's line. The run
    is repeated, not reported as a crash of the simulation (which would die so on every run)."""
    from stage_cosim.adapters.astra_sim.run import run

    d = _standin_run_dir(tmp_path, 8)
    monkeypatch.setenv("STANDIN_MODE", "drop-all-on-exit-once")
    done = run(standin, d, 8)
    assert sorted(done.output.finished_ns) == list(range(8)) and "run again" in done.warning


def test_results_lost_on_every_run_are_one_line(tmp_path, standin, monkeypatch) -> None:
    from stage_cosim.adapters.astra_sim.run import AstraSimError, run

    d = _standin_run_dir(tmp_path, 8)
    monkeypatch.setenv("STANDIN_MODE", "drop-on-exit")
    with pytest.raises(AstraSimError) as exc:
        run(standin, d, 8)
    assert exc.value.kind == "incomplete" and "\n" not in str(exc.value)
    assert "6 of 8" in str(exc.value) and "SIGABRT" in str(exc.value)


# -- validate: the world size is the run's, not the files' ---------------------------------------------

def _four_ranks(tmp_path: Path) -> Path:
    ranks = {0: [coll(0, 0, 1 << 20, pg="1")], 1: [coll(0, 0, 1 << 20, pg="1")],
             2: [p2p(0, 5, 3, 1 << 20)], 3: [p2p(0, 6, 2, 1 << 20)]}
    d = write_inputs(tmp_path / "run", ranks, [NetworkDim("Ring", 4, 50, 500)], groups={"1": [0, 1], "2": [2, 3]})
    (d / "traces" / "workload.3.et").unlink()
    return d


def test_validate_reports_a_missing_rank_file_from_the_network_file(run_cli, tmp_path) -> None:
    d = _four_ranks(tmp_path)
    code, out, err = run_cli("validate", str(d))
    assert code == 1
    assert out.strip().splitlines() == [f"{d / 'traces' / 'workload.3.et'}: missing (the run has 4 ranks, from "
                                        f"{d / 'network.yml'}: one trace per network rank)"], out
    assert "is not a rank" not in out


def test_validate_reads_the_world_size_from_the_manifest(run_cli, tmp_path) -> None:
    d = _four_ranks(tmp_path)
    (d / "network.yml").unlink()
    (d / "manifest.json").write_text(json.dumps({"ranks": 4}))
    code, out, _ = run_cli("validate", str(d))
    assert code == 1 and "workload.3.et: missing (the run has 4 ranks" in out and "is not a rank" not in out


# -- positions, figures, progress and plots -------------------------------------------------------------

def test_export_warns_beyond_the_models_positions_as_simulate_does(run_cli, tmp_path) -> None:
    code, _, err = run_cli("astra-sim", "export", "--model", "llama3-8b", "--layers", "1", "--seq-len", "16384",
                           "--cluster", "dgx-h100:1", "--out", str(tmp_path / "run"))
    assert code == 0, err
    assert ("warning: seq-len 16,384 exceeds llama3-8b's max_position_embeddings (8,192)" in err)
    assert err.count("max_position_embeddings") == 1


TINY = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1024,
        "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1024, "max_position_embeddings": 1024}


def _explore_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "model_config": {**TINY, "_name_or_path": "tiny-llama"}, "baseline": "dgx-h100:8", "global_batch": 1,
        "seq_len": 256,
        "variables": {"gpu.hbm_GBps": {"min": 2000, "max": 6000}}, "cost": {"base": 1000, "gpu.hbm_GBps": 1.37},
        "points": 2, "candidates": 4, "inner_budget": 4, "reuse_top": 3}))
    return spec


def test_explore_progress_has_a_total(run_cli, tmp_path, monkeypatch) -> None:
    """Two scipy runs (points 2) of one variable with candidates 4: popsize max(4, 4 // 4) = 4,
    maxiter max(1, 4 // 4 - 1) = 1; scipy's population is max(5, 4 * 1) = 5 members, rounded up
    to a power of two (8) for its Sobol start, evaluated at the start and once per generation:
    2 * 8 * 2 = 32 evaluations, and 2 for the sensitivity (+-10 % around the baseline): 34."""
    import stage_cosim.cli.explore_cmd as explore_cmd

    bars: list[dict] = []

    class Bar:
        def __init__(self, **kw) -> None:  # noqa: ANN003
            self.kw, self.n = kw, 0
            bars.append(self.__dict__)

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *exc) -> None:  # noqa: ANN002
            pass

        def update(self, k: int) -> None:
            self.n += k

        def __getattr__(self, name: str):  # noqa: ANN204
            return lambda *a, **k: None

    monkeypatch.setattr(explore_cmd, "tqdm", Bar)
    code, _, err = run_cli("explore", str(_explore_spec(tmp_path)), "--quiet")
    assert code == 0, err
    assert len(bars) == 1 and bars[0]["kw"].get("total") == 34
    assert 0 < bars[0]["n"] <= 34


def test_explore_prints_rounded_figures(run_cli, tmp_path, monkeypatch) -> None:
    import stage_cosim.cli.explore_cmd as explore_cmd

    figures = _capture_figure(monkeypatch, explore_cmd)
    code, out, err = run_cli("explore", str(_explore_spec(tmp_path)), "--quiet", "--plot", str(tmp_path / "f.png"))
    assert code == 0, err
    assert figures[0].axes[0].get_title().startswith("tiny-llama: ")       # the model's name
    values = re.findall(r"gpu\.hbm_GBps=([0-9.e+-]+)", out)
    assert values
    for v in values:
        digits = v.split("e")[0].replace(".", "").lstrip("0").rstrip("0") if "." in v else v.rstrip("0")
        assert len(digits) <= 3, v           # three significant digits


def _capture_figure(monkeypatch, module) -> list:  # noqa: ANN001
    figures: list = []
    monkeypatch.setattr(module, "save_figure", lambda fig, path: figures.append(fig))
    return figures


def test_optimize_plot_legend_clears_the_bars_and_title_names_the_model(monkeypatch, tmp_path) -> None:
    import stage_cosim.cli.optimize_cmd as optimize_cmd

    def entry(dp: int, tp: int, compute: float, comm: float) -> dict:
        par = {"dp": dp, "tp": tp, "pp": 1, "micro_batch": 1, "zero": 1, "sp": False, "recompute": "none"}
        return {"point": {"tp": tp}, "config": {"parallel": par, "model": {"name": "Meta-Llama-3-8B"}},
                "step_time_s": compute + comm, "score": compute + comm, "mfu": 0.4,
                "peak_memory_bytes": 1 << 30, "breakdown": {"compute": compute, "exposed_tp": comm, "exposed_dp": 0.1}}

    figures = _capture_figure(monkeypatch, optimize_cmd)
    doc = {"top": [entry(8, 1, 1.0, 0.0), entry(4, 2, 0.9, 0.3), entry(2, 4, 0.8, 0.6), entry(1, 8, 0.7, 0.9)]}
    optimize_cmd.plot_top(doc, tmp_path / "p.png")
    fig = figures[0]
    ax = fig.axes[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [lg for lg in (ax.get_legend(), *fig.legends) if lg is not None]
    assert len(legends) == 1
    legend = legends[0].get_window_extent(renderer)
    assert len(ax.patches) == 4 * 3                    # 4 configurations x 3 categories
    for bar in ax.patches:
        assert not legend.overlaps(bar.get_window_extent(renderer)), "the legend covers a bar"
    assert ax.get_title().startswith("Meta-Llama-3-8B")


def test_a_config_files_model_is_named_by_its_folder_not_its_family(run_cli, monkeypatch, tmp_path) -> None:
    import stage_cosim.files as files

    config = str(HF / "Meta-Llama-3-8B" / "config.json")
    code, out, err = run_cli("simulate", "--model", config, "--layers", "2", "--seq-len", "256", "--json")
    assert code == 0, err
    assert json.loads(out)["config"]["model"]["name"] == "Meta-Llama-3-8B"
    figures = _capture_figure(monkeypatch, files)     # (plot_stages imports it when called)
    code, _, err = run_cli("simulate", "--model", config, "--layers", "2", "--seq-len", "256",
                           "--plot", str(tmp_path / "s.png"))
    assert code == 0, err
    assert figures[0].axes[0].get_title().startswith("Meta-Llama-3-8B:")


def test_the_mfu_line_is_short_and_the_convention_is_in_json(run_cli) -> None:
    code, out, err = run_cli("simulate", *SMALL)
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("MFU / HFU"))
    assert len(line) <= 80 and "backward" not in line, line
    code, js, _ = run_cli("simulate", *SMALL, "--json")
    assert "backward = 2x forward" in json.loads(js)["flop_convention"]


def test_explore_interrupted_says_so_and_exits_130(run_cli, tmp_path: Path, monkeypatch) -> None:
    """A Ctrl-C during the exploration: the best so far is printed as such and the exit status
    is 130, as optimize's, never 0 as if the exploration had finished."""
    import stage_cosim.search.explore as explore

    def interrupted(*_args, **_kw):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(explore, "_minimize_step", interrupted)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "model": "llama3-8b", "baseline": "dgx-h100:8", "global_batch": 8, "seq_len": 1024,
        "variables": {"gpu.hbm_GBps": {"values": [3350, 4800]}}, "cost": {"base": 15000, "gpu.hbm_GBps": 1.5},
        "mode": "pareto", "points": 2, "candidates": 2, "inner_budget": 4, "baseline_budget": 4, "reuse_top": 1}))
    code, out, _ = run_cli("explore", str(spec), "--quiet")
    assert code == 130 and "(interrupted: best so far)" in out
