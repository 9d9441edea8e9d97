"""The command line: outputs, and bad input as one line, exit status 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SMALL = ["--model", "llama3-8b", "--layers", "4", "--seq-len", "256"]


def test_models_lists_presets(run_cli) -> None:
    code, out, _ = run_cli("models")
    assert code == 0 and "llama3.1-405b" in out and "405.85B" in out
    # columns line up whatever a name's length; a hybrid's mixers counted by kind: Jamba-v0.1's
    # attention every 8th layer from layer 4 (attn_layer_period 8, attn_layer_offset 4) of 32
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert len({row.index(" llama ") if " llama " in row else row.index(" gpt ") for row in rows.values()
                if " llama " in row or " gpt " in row}) == 1
    assert rows["jamba-v0.1"].endswith("mamba 28 + attention 4")


def test_synth_writes_traces_and_manifest(run_cli, tmp_path) -> None:
    out = tmp_path / "t"
    code, stdout, err = run_cli("synth", *SMALL, "--tp", "2", "--pp", "2", "--dp", "2", "--global-batch", "8",
                                "--sp", "--out", str(out))
    assert code == 0, err
    files = sorted(p.name for p in out.iterdir())
    assert files == ["comm_groups.json", "manifest.json"] + sorted(f"workload.{r}.et" for r in range(8))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["ranks"] == 8 and len(manifest["roles"]) == 2
    role = manifest["roles"][0]
    assert set(role["peak_memory_bytes"]) >= {"weights", "gradients", "optimizer", "activations", "total"}
    assert set(role["comm_bytes"]) == {"tp", "dp", "pp"}
    assert manifest["parallel"]["sp"] is True
    code, stdout, _ = run_cli("validate", str(out))
    assert code == 0 and stdout.startswith("ok: 8 ranks")


def test_synth_refuses_non_empty_out(run_cli, tmp_path) -> None:
    out = tmp_path / "t"
    out.mkdir()
    (out / "keep").write_text("x")
    code, _, err = run_cli("synth", *SMALL, "--out", str(out))
    assert code == 2 and "--force" in err and (out / "keep").exists()
    code, _, err = run_cli("synth", *SMALL, "--out", str(out), "--force")
    assert code == 0 and not (out / "keep").exists()


@pytest.mark.parametrize("args, param", [
    (["--tp", "3"], "tp:"),
    (["--pp", "4", "--vp", "2", "--global-batch", "4"], "pp:"),
    (["--pp", "2", "--pp-layers", "1,2"], "pp-layers:"),
    (["--pp", "2", "--pp-layers", "a,b"], "pp-layers:"),
    (["--dp", "2", "--micro-batch", "2", "--global-batch", "6"], "global-batch:"),
    (["--model", "nope"], "model:"),
    (["--hidden", "0"], "hidden:"),
    (["--seq-len", "-5"], "seq-len:"),
    (["--zero", "5"], "zero:"),
])
def test_bad_input_one_line_exit_2(run_cli, tmp_path, args, param) -> None:
    out = tmp_path / "t"
    code, stdout, err = run_cli("synth", *SMALL, *args, "--out", str(out))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and param in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_malformed_hf_config_cli(run_cli, tmp_path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text("{broken")
    code, _, err = run_cli("synth", "--model", str(cfg), "--out", str(tmp_path / "o"))
    assert code == 2 and err.startswith("error: model:") and not (tmp_path / "o").exists()


def test_validate_reports_problems(run_cli, tmp_path) -> None:
    out = tmp_path / "t"
    assert run_cli("synth", *SMALL, "--dp", "2", "--out", str(out))[0] == 0
    (out / "workload.1.et").write_bytes((out / "workload.0.et").read_bytes()[:-7])
    code, stdout, err = run_cli("validate", str(out))
    assert code == 2 and "truncated" in err  # unreadable file: a user error, one line


def test_python_dash_m(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "stage_cosim", "synth", "--tp", "7", "--out", str(tmp_path / "x")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: tp:") and "Traceback" not in proc.stderr


SIM_KEYS = {"step_time_s", "tokens_per_s", "mfu", "hfu", "peak_memory_bytes", "memory_capacity_bytes",
            "fits_in_memory", "breakdown", "config"}


def test_simulate_json_and_timeline(run_cli, tmp_path) -> None:
    tl = tmp_path / "timeline.json"
    code, out, err = run_cli("simulate", *SMALL, "--tp", "2", "--pp", "2", "--dp", "2", "--global-batch", "8",
                             "--cluster", "dgx-h100", "--json", "--timeline", str(tl))
    assert code == 0, err
    doc = json.loads(out)
    assert SIM_KEYS <= set(doc)
    assert doc["step_time_s"] > 0 and 0 < doc["mfu"] < 1 and doc["config"]["parallel"]["tp"] == 2
    assert sum(doc["breakdown"].values()) == pytest.approx(doc["step_time_s"], rel=1e-9)
    events = json.loads(tl.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert slices and {e["pid"] for e in slices} == {0, 1}          # one process per simulated rank
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"compute", "comm:tp", "comm:dp"} <= threads


def test_simulate_summary(run_cli) -> None:
    code, out, err = run_cli("simulate", *SMALL, "--tp", "2", "--dp", "4", "--global-batch", "8", "--cluster", "dgx-h100:8")
    assert code == 0, err
    assert "step time" in out and "MFU" in out and "peak memory" in out


def test_simulate_traces_directory(run_cli, tmp_path) -> None:
    out = tmp_path / "t"
    assert run_cli("synth", *SMALL, "--tp", "2", "--pp", "2", "--global-batch", "4", "--out", str(out))[0] == 0
    code, stdout, err = run_cli("simulate", "--traces", str(out), "--cluster", "dgx-h100:4", "--json")
    assert code == 0, err
    from_traces = json.loads(stdout)
    code, stdout, _ = run_cli("simulate", *SMALL, "--tp", "2", "--pp", "2", "--global-batch", "4",
                              "--cluster", "dgx-h100:4", "--json", "--full")
    direct = json.loads(stdout)
    # the same graphs, read back from disk: the same step time (compute from num_ops/tensor_size),
    # up to the order of floating-point sums
    assert from_traces["step_time_s"] == pytest.approx(direct["step_time_s"], rel=1e-9)


@pytest.mark.parametrize("args, param", [
    (["--cluster", "dgx-h100:16", "--dp", "1"], "cluster:"),
    (["--cluster", "nope:8"], "cluster:"),
    (["--cluster", "dgx-h100:x"], "cluster:"),
    (["--network-model", "magic"], "network-model"),
])
def test_simulate_bad_input(run_cli, args, param) -> None:
    code, _, err = run_cli("simulate", *SMALL, "--tp", "2", *args)
    assert code == 2 and err.count("\n") == 1 and param in err, err


def test_clusters_lists_presets(run_cli) -> None:
    code, out, _ = run_cli("clusters")
    assert code == 0 and "gb200-nvl72" in out and "dgx-a100" in out


def test_dp_follows_the_clusters_gpu_count(run_cli, tmp_path) -> None:
    """Without --dp, as Megatron derives it from the world size: the GPUs the cluster names over
    tp*cp*pp (16 H100 with tp 8: dp 2; a YAML file's num_gpus too); a bare preset is sized to the
    job (dp 1); a count that tp*cp*pp does not divide is one line naming dp."""
    def dp_of(*args: str) -> int:
        code, out, err = run_cli("simulate", "--model", "llama3-8b", "--layers", "2", "--json", *args)
        assert code == 0, err
        doc = json.loads(out)
        assert doc["config"]["parallel"]["world_size"] == doc["config"]["num_gpus"]
        return doc["config"]["parallel"]["dp"]

    assert dp_of("--cluster", "dgx-h100:16", "--tp", "8") == 2
    assert dp_of("--cluster", "dgx-h100:32", "--tp", "4", "--pp", "2") == 4
    assert dp_of("--cluster", "dgx-h100", "--tp", "8") == 1
    assert dp_of("--cluster", "dgx-h100:16", "--tp", "8", "--dp", "2") == 2
    code, _, err = run_cli("simulate", "--model", "llama3-8b", "--cluster", "dgx-h100:16", "--tp", "8", "--dp", "1")
    assert code == 2 and err.startswith("error: cluster:")      # an explicit --dp is never overridden
    code, _, err = run_cli("simulate", "--model", "llama3-8b", "--cluster", "dgx-h100:24", "--tp", "8", "--pp", "2")
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: dp:") and "tp*cp*pp = 16" in err


def test_api_derives_dp_from_the_cluster_request() -> None:
    from stage_cosim.api import parallel_of

    assert parallel_of({"tp": 4, "cluster": "dgx-h100:64"}).dp == 16
    assert parallel_of({"tp": 4, "cp": 2, "cluster": {"num_gpus": 64}}).dp == 8
    assert parallel_of({"tp": 4, "cluster": "dgx-h100"}).dp == 1
    assert parallel_of({"tp": 4}).dp == 1
