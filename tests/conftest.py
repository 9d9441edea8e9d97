"""Shared fixtures: small models and a helper to run the CLI in-process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stage_cosim.cli import main
from stage_cosim.model import ModelConfig

STANDIN = Path(__file__).parent / "standins" / "astra_sim_standin.py"


@pytest.fixture
def gpt_small() -> ModelConfig:
    """A GPT in Korthikanti's form (unfused attention, 4h MLP, tied embeddings)."""
    return ModelConfig.build("gpt-small", "gpt", layers=8, hidden=1024, heads=16, vocab=51200,
                             max_seq=2048, attention="unfused")


@pytest.fixture
def llama_small() -> ModelConfig:
    return ModelConfig.build("llama-small", "llama", layers=8, hidden=1024, ffn=2816, heads=16,
                             kv_heads=4, vocab=32000, max_seq=4096)


@pytest.fixture
def run_cli(capsys):
    """Run ``stage-cosim`` in this process; returns (exit status, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def standin(tmp_path) -> str:
    """An executable that plays ASTRA-sim's binary (tests/standins/astra_sim_standin.py)."""
    exe = tmp_path / "astra_standin"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} \"$@\"\n")
    exe.chmod(0o755)
    return str(exe)
