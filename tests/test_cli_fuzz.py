"""A fuzz test of the command line: random flag values and files on every command.

Every outcome must be a result (exit 0, something on stdout, at most warnings on stderr) or
the one-line ``error: <parameter>: <rule>`` with exit status 2 and nothing on stdout and
nothing left on disk; never a traceback, another exit status, or a hang. Seeded and bounded
(tiny models, a few cases per command) so that it runs in a couple of minutes; set
``STAGE_COSIM_FUZZ_CASES`` to run more.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
from pathlib import Path

import pytest
import yaml

from stage_cosim.cli import main

SEED = int(os.environ.get("STAGE_COSIM_FUZZ_SEED", "13"))
CASES = int(os.environ.get("STAGE_COSIM_FUZZ_CASES", "20"))     # per command and kind of mutation
CASE_TIMEOUT_S = 120

ERROR_LINE = re.compile(r"error: [A-Za-z0-9_.\-\[\]]+: \S[^\n]*\n")
# values for flags: sizes, signs, types, not-a-numbers, the empty string
VALUES = ("0", "-3", "1", "2", "3", "4096", "1e3", "2.5", "-0.5", "nan", "inf", "-inf", "abc", "", "1,2", "0x10")
TINY = ["--model", "llama3-8b", "--layers", "2", "--hidden", "256", "--ffn", "512", "--heads", "4", "--kv-heads", "2",
        "--vocab", "512"]
TRAIN = [*TINY, "--seq-len", "128", "--global-batch", "4"]


def _flags(base: list[str]) -> list[str]:
    return [a for a in base if a.startswith("--")]


class Run:
    """Runs one command line in this process and checks its outcome."""

    def __init__(self, capsys, tmp: Path) -> None:  # noqa: ANN001
        self.capsys, self.tmp = capsys, tmp

    def __call__(self, args: list[str], outputs: tuple[Path, ...] = (), results: tuple[int, ...] = (0,)) -> int:
        """``results``: the exit statuses that come with a result (validate's 1: problems found)."""
        before = {p: p.exists() for p in outputs}
        siblings = {p.parent: set(p.parent.iterdir()) if p.parent.is_dir() else set() for p in outputs}

        def hang(*_):  # noqa: ANN002
            raise TimeoutError(f"no answer in {CASE_TIMEOUT_S} s")

        old = signal.signal(signal.SIGALRM, hang)
        signal.alarm(CASE_TIMEOUT_S)
        try:
            code = main([str(a) for a in args])
        except BaseException as exc:   # a traceback is what the user would have seen
            pytest.fail(f"{type(exc).__name__}: {exc} <- stage-cosim {' '.join(map(str, args))}")
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        out, err = self.capsys.readouterr()
        where = f"<- stage-cosim {' '.join(map(repr, args))}"
        errors = [line for line in err.splitlines() if not line.startswith("warning: ")]
        if code in results:
            assert out.strip() and (code or not errors), f"exit {code} with {err!r} {where}"
        else:
            assert code == 2, f"exit {code}: {err!r} {where}"
            assert ERROR_LINE.fullmatch(err), f"not one error line: {err!r} {where}"
            assert out == "", f"output before the error: {out[:200]!r} {where}"
            for p, existed in before.items():
                assert p.exists() == existed, f"{p} left behind {where}"
            for parent, names in siblings.items():   # no temporary or partial files either
                assert not parent.is_dir() or set(parent.iterdir()) <= names | {p for p in outputs if before[p]}, f"files left {where}"
        return code


@pytest.fixture
def run(capsys, tmp_path) -> Run:
    return Run(capsys, tmp_path)


def _files(tmp: Path) -> dict[str, Path]:
    """Paths a flag that takes a file may be given: missing, empty, malformed, of the wrong kind,
    a folder, and places nothing can be written."""
    (tmp / "dir").mkdir(exist_ok=True)
    files = {"missing": tmp / "missing.json", "dir": tmp / "dir", "empty": tmp / "empty.json",
             "garbage": tmp / "garbage.json", "list": tmp / "list.yaml", "binary": tmp / "binary.et"}
    files["empty"].write_text("")
    files["garbage"].write_text("{not: [json")
    files["list"].write_text("[1, 2, 3]\n")
    files["binary"].write_bytes(bytes(range(256)) * 4)
    if Path("/proc/self").exists():
        files["unwritable"] = Path("/proc/stage-cosim-fuzz/x")
    return files


def _mutations(rng: random.Random, base: list[str], value_flags: list[str], n: int) -> list[list[str]]:
    """``n`` command lines: ``base`` with one or two of ``value_flags`` given random values."""
    out = []
    for _ in range(n):
        args = list(base)
        for flag in rng.sample(value_flags, k=min(len(value_flags), rng.choice((1, 1, 2)))):
            value = rng.choice(VALUES)
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        out.append(args)
    return out


COMMANDS = {
    "synth": (["synth", *TRAIN],
              ["--tp", "--pp", "--dp", "--cp", "--vp", "--micro-batch", "--global-batch", "--seq-len", "--zero",
               "--layers", "--hidden", "--heads", "--kv-heads", "--vocab", "--recompute", "--schedule", "--dtype",
               "--pp-layers", "--axis-order", "--cp-comm", "--phase", "--batch", "--input-len", "--format"]),
    "simulate": (["simulate", *TRAIN],
                 ["--tp", "--pp", "--dp", "--vp", "--micro-batch", "--global-batch", "--seq-len", "--zero", "--cluster",
                  "--network-model", "--train-tokens", "--price", "--max-seq", "--head-dim", "--phase", "--batch",
                  "--context-len", "--kv-cache-dtype", "--weight-dtype", "--moe-imbalance", "--ffn", "--dataset-splits",
                  "--active-chunks"]),
    "optimize": (["optimize", *TINY, "--cluster", "dgx-h100:8", "--global-batch", "8", "--seq-len", "128",
                  "--budget", "3", "--quiet"],
                 ["--global-batch", "--seq-len", "--budget", "--top", "--price", "--objective", "--headroom", "--seed",
                  "--cluster", "--dtype", "--network-model"]),
    "serve-sim": (["serve-sim", *TINY, "--cluster", "dgx-h100:1", "--rate", "20", "--num-requests", "8",
                   "--input-len", "32", "--output-len", "4"],
                  ["--rate", "--num-requests", "--input-len", "--output-len", "--tp", "--max-num-seqs",
                   "--chunk-tokens", "--kv-block-size", "--hbm-utilization", "--step-overhead", "--slo-ttft",
                   "--slo-tpot", "--seed", "--length-spread", "--lengths", "--step-resolution"]),
    "astra-sim export": (["astra-sim", "export", *TRAIN],
                         ["--tp", "--dp", "--pp", "--dataset-splits", "--active-chunks", "--collective-implementation",
                          "--compute", "--global-batch", "--seq-len"]),
    "models": (["models"], ["--json"]),
    "clusters": (["clusters"], ["--json"]),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_random_flag_values(run, tmp_path, command) -> None:
    rng = random.Random(f"{SEED}-{command}")
    base, flags = COMMANDS[command]
    out = tmp_path / "out"
    if command in ("synth", "astra-sim export"):
        base = [*base, "--out", str(out)]
    for args in _mutations(rng, base, flags, CASES):
        if run(args, outputs=(out,)) == 0 and out.exists():
            import shutil

            shutil.rmtree(out)
        # a timeline or a plot in the mix: outputs the command checks before its work
    files = _files(tmp_path)
    for args in _mutations(rng, base, flags, max(1, CASES // 2)):
        if command == "simulate":
            kind = rng.choice(sorted(files))
            flag = rng.choice(["--timeline", "--plot", "--model", "--cluster", "--traces"])
            args = [*args, flag, str(files[kind])]
        run(args, outputs=(out,))


def test_random_output_paths(run, tmp_path) -> None:
    """Every output flag against every kind of bad path: refused before the work, in one line."""
    files = _files(tmp_path)
    bad = [files["dir"], files["missing"].parent / "nodir" / "x.png", files["garbage"], tmp_path / "plot.txt"]
    if "unwritable" in files:
        bad.append(files["unwritable"])
    for path in bad:
        for args in (["simulate", *TRAIN, "--timeline", path], ["simulate", *TRAIN, "--plot", path],
                     ["optimize", *TINY, "--cluster", "dgx-h100:8", "--global-batch", "8", "--seq-len", "128",
                      "--budget", "2", "--quiet", "--plot", path],
                     ["explore", files["missing"], "--plot", path]):
            if path == files["garbage"] and "--timeline" in args:
                continue       # an existing file is a valid timeline to replace
            assert run(args, outputs=(path,)) == 2
        for command in (["synth", *TRAIN], ["astra-sim", "export", *TRAIN]):
            if path.is_dir():
                (path / "keep").write_text("x")       # a non-empty folder needs --force
            # (a name with a suffix, or missing folders above, make a valid --out)
            if run([*command, "--out", path], outputs=(path,)) == 0:
                import shutil

                shutil.rmtree(path)


SPEC = {"model_config": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                         "max_position_embeddings": 512},
        "baseline": "dgx-h100:8", "global_batch": 1, "seq_len": 128,
        "variables": {"gpu.hbm_GBps": {"min": 2000, "max": 4000}}, "cost": {"base": 1000, "gpu.hbm_GBps": 1},
        "points": 2, "candidates": 2, "inner_budget": 3, "reuse_top": 2}
SPEC_VALUES = (0, -1, 2.5, float("nan"), float("inf"), "abc", "", None, [1, 2], {"a": 1}, True, 10**12)
# Settings the work grows with linearly (layers built, micro-batches replayed, searches run):
# there a huge value is a long run, not a wrong one, so they get a large but quick one.
LINEAR = {"num_hidden_layers", "global_batch", "points", "candidates", "inner_budget", "baseline_budget", "reuse_top", "seq_len",
          "num_gpus", "budget"}


def _value(rng: random.Random, key: str) -> object:
    v = rng.choice(SPEC_VALUES)
    return 64 if v == 10**12 and key.rsplit(".", 1)[-1] in LINEAR else v


@pytest.mark.slow
def test_random_explore_specs(run, tmp_path) -> None:
    rng = random.Random(f"{SEED}-explore")
    spec = tmp_path / "spec.yaml"
    # where a value goes: a path of keys (a variable's name holds a dot)
    keys = [(k,) for k in sorted(SPEC)] + [("mode",), ("budget",), ("seed",), ("dtype",), ("objective",),
                                            ("variables", "gpu.hbm_GBps", "min"), ("variables", "gpu.hbm_GBps"),
                                            ("variables", "scale_up.bandwidth_GBps"), ("cost", "gpu.hbm_GBps"),
                                            ("model_config", "num_hidden_layers"), ("model_config", "hidden_size"),
                                            ("model_config", "model_type"), ("serving",), ("fp8_recipe",)]
    for _ in range(max(2, CASES // 2)):
        doc = json.loads(json.dumps(SPEC))
        *path, last = rng.choice(keys)
        where = doc
        for part in path:
            where = where[part] if isinstance(where.get(part), dict) else where.setdefault(part, {})
        where[last] = _value(rng, last)
        spec.write_text(yaml.safe_dump(doc))
        run(["explore", spec, "--quiet", "--json"])
    for name, path in _files(tmp_path).items():
        if name != "unwritable":
            run(["explore", path, "--quiet"])


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fuzz-traces")
    assert main(["synth", *TRAIN, "--tp", "2", "--pp", "2", "--out", str(d / "t"), "--quiet"]) == 0
    assert main(["astra-sim", "export", *TRAIN, "--tp", "2", "--out", str(d / "run")]) == 0
    return d


def test_random_trace_files(run, tmp_path, traces, capsys) -> None:
    """validate, simulate --traces and astra-sim replay on trace sets with a file cut short,
    filled with garbage, emptied or missing, and on paths that are no trace set at all."""
    import shutil

    capsys.readouterr()
    rng = random.Random(f"{SEED}-traces")
    files = _files(tmp_path)
    for _ in range(max(2, CASES // 2)):
        broken = tmp_path / f"t{rng.randrange(10**6)}"
        shutil.copytree(traces / "t", broken)
        victim = rng.choice(sorted(broken.iterdir()))
        how = rng.choice(["truncate", "garbage", "empty", "delete"])
        if how == "delete":
            victim.unlink()
        else:
            data = victim.read_bytes()
            victim.write_bytes({"truncate": data[:len(data) // 2], "garbage": bytes(rng.randrange(256) for _ in range(64)),
                                "empty": b""}[how])
        run(["validate", broken], results=(0, 1))
        run(["simulate", "--traces", broken, "--cluster", "dgx-h100:4"])
    for path in files.values():
        run(["validate", path], results=(0, 1))
        run(["simulate", "--traces", path, "--cluster", "dgx-h100:4"])
    d = traces / "run"
    good = {"--workload-configuration": str(d / "traces" / "workload"), "--system-configuration": d / "system.json",
            "--network-configuration": d / "network.yml", "--remote-memory-configuration": d / "memory.json",
            "--comm-group-configuration": d / "comm_groups.json"}
    for flag in good:
        for path in files.values():
            args = {**good, flag: str(path) if flag != "--workload-configuration" else str(path)}
            run(["astra-sim", "replay", *[x for kv in args.items() for x in map(str, kv)]])
    for extra in (["--logging-folder", str(files["binary"])], ["--logging-folder", "/proc/stage-cosim-fuzz"],
                  ["--num-queues-per-dim", "nan"], ["--comm-scale", "2"], ["--json", "--full"]):
        run(["astra-sim", "replay", *[x for kv in good.items() for x in map(str, kv)], *extra])


def test_random_model_and_cluster_files(run, tmp_path) -> None:
    """Hugging Face configs and cluster descriptions with a random key given a random value."""
    rng = random.Random(f"{SEED}-files")
    model = dict(SPEC["model_config"])
    cluster = {"name": "x", "num_gpus": 1, "gpu": {"base": "H100-SXM"},
               "scale_up": {"gpus_per_domain": 8, "bandwidth_GBps": 450, "latency_ns": 700},
               "scale_out": {"bandwidth_GBps": 50, "latency_ns": 2000}}
    cfg, cl = tmp_path / "config.json", tmp_path / "c.yaml"
    for _ in range(CASES):
        m = dict(model)
        key = rng.choice(sorted(m) + ["rope_scaling", "tie_word_embeddings", "hidden_act", "num_local_experts"])
        m[key] = _value(rng, key)
        cfg.write_text(json.dumps(m))
        c = json.loads(json.dumps(cluster))
        part = rng.choice(["gpu", "scale_up", "scale_out", None])
        field = rng.choice(["bandwidth_GBps", "latency_ns", "gpus_per_domain", "hbm_GBps", "bf16_tflops", "topology",
                            "switch_radix", "oversubscription", "planes", "in_network_reduction"])
        if part == "scale_out" and rng.random() < 0.3:      # a tiered network, then its fields at random
            c[part]["topology"] = rng.choice(["fat-tree", "rail-optimized", "rail-only"])
        value = _value(rng, field)
        if part is None:
            c[rng.choice(["num_gpus", "gpu", "name", "scale_up"])] = value
        elif rng.random() < 0.2:
            c[part].pop(next(iter(c[part]), None), None)       # a field left out
        else:
            c[part][field] = value
        cl.write_text(yaml.safe_dump(c))
        run(["simulate", "--model", cfg, "--seq-len", "128", "--global-batch", "1", "--cluster", "dgx-h100:1"])
        run(["simulate", *TRAIN, "--cluster", cl])
    run(["simulate", *TRAIN, "--cluster", "dgx-h100:0"])


@pytest.mark.parametrize("args, line", [
    (["simulate", "--tp", "1e3"], "error: tp: '1e3' is not a valid integer\n"),
    (["simulate", "--tp"], "error: tp: needs a value\n"),
    (["simulate", "--network-model", "fast"], "error: network-model: 'fast' is not one of 'calibrated', 'astra'\n"),
    (["synth", *TINY], "error: out: is required\n"),
    (["explore"], "error: spec: is required\n"),
    (["simulate", "--frobnicate"], None), (["frobnicate"], None), (["simulate", "extra-argument"], None),
    (["astra-sim", "replay"], None),
])
def test_click_usage_errors_are_one_line(run, capsys, args, line) -> None:
    """click's own usage errors in the form of every other: ``error: <parameter>: <rule>``."""
    import stage_cosim.cli as cli

    assert run(args) == 2
    if line is not None:
        cli.main(args)
        assert capsys.readouterr().err == line


OPTIMIZE = ["optimize", *TINY, "--cluster", "dgx-h100:8", "--global-batch", "8", "--seq-len", "128", "--budget", "2"]


@pytest.mark.parametrize("args, param", [
    (["--top", "0"], "top"), (["--top", "-3"], "top"), (["--price", "nan"], "price"), (["--price", "-1"], "price"),
    (["--objective", "cost", "--price", "inf"], "price"), (["--seed", "-3"], "seed"), (["--headroom", "nan"], "headroom"),
])
def test_optimize_refuses_meaningless_settings(run, capsys, args, param) -> None:
    """Settings that would print a header with no rows, or "$nan per million tokens"."""
    import stage_cosim.cli as cli

    assert run([*OPTIMIZE, *args]) == 2
    cli.main([*OPTIMIZE, *args])
    assert capsys.readouterr().err.startswith(f"error: {param}: ")
