"""The tools live in ``ratequeue.cli`` and ``ratequeue.testing``; their old paths
(``ratequeue.demo``, ``ratequeue.loadtest``, ``ratequeue.mock_provider``) still give the
same objects for one release, each with a DeprecationWarning that points at the line
importing it; ``python -m ratequeue`` and the ``ratequeue`` script run every subcommand."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import ratequeue as rq
from ratequeue import testing
from ratequeue.cli import demo, loadtest
from ratequeue.cli.main import main
from ratequeue.testing import _mock_provider

ROOT = Path(__file__).resolve().parent.parent
while not (ROOT / "pyproject.toml").exists():
    ROOT = ROOT.parent

MOVED = [
    ("ratequeue.demo", "run", demo.run, "ratequeue.cli.demo.run"),
    ("ratequeue.demo", "lab_demo", demo.lab_demo, "ratequeue.cli.demo.lab_demo"),
    ("ratequeue.loadtest", "run_loadtest", loadtest.run_loadtest, "ratequeue.cli.loadtest"),
    ("ratequeue.loadtest", "_make_limiter", loadtest._make_limiter, "ratequeue.cli.loadtest"),
    ("ratequeue.mock_provider", "MockProvider", testing.MockProvider, "ratequeue.testing"),
    ("ratequeue.mock_provider", "MAX_BODY", testing.MAX_BODY, "ratequeue.testing.MAX_BODY"),
    ("ratequeue.mock_provider", "serve", _mock_provider.serve, "python -m ratequeue mock-"),
]


def test_the_new_paths_import_without_a_warning() -> None:
    code = (
        "import ratequeue.cli, ratequeue.cli.main, ratequeue.cli.demo, ratequeue.cli.loadtest\n"
        "from ratequeue.testing import ManualClock, MockProvider"
    )
    run = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert testing.ManualClock is rq.ManualClock


@pytest.mark.parametrize(("old", "name", "obj", "hint"), MOVED)
def test_an_old_path_gives_the_same_object_with_a_warning_at_the_caller(
    old: str, name: str, obj: object, hint: str
) -> None:
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated") as caught:
        got = getattr(importlib.import_module(old), name)
    assert got is obj
    assert len(caught) == 1
    assert caught[0].filename == __file__  # stacklevel: the line that used the old path
    assert hint in str(caught[0].message)


def test_from_import_of_an_old_path_warns() -> None:
    with pytest.warns(DeprecationWarning, match="use ratequeue.testing.MockProvider"):
        from ratequeue.mock_provider import MockProvider
    assert MockProvider is testing.MockProvider
    with pytest.warns(DeprecationWarning, match="ratequeue.cli.demo.BurstResult"):
        from ratequeue.demo import BurstResult
    assert BurstResult is demo.BurstResult


def test_an_old_path_refuses_a_name_it_never_had() -> None:
    import ratequeue.loadtest as old

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match=r"'ratequeue\.loadtest' has no attribute 'nope'"):
            _ = old.nope
        with pytest.raises(AttributeError):
            _ = old.__wrapped__


def test_star_import_of_an_old_path_gives_its_names() -> None:
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning):
        exec("from ratequeue.loadtest import *", namespace)
    assert namespace["run_loadtest"] is loadtest.run_loadtest


def test_the_script_entry_point_is_the_cli() -> None:
    entry = re.search(r'^ratequeue = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert entry is not None
    module, _, attr = entry.group(1).partition(":")
    assert getattr(importlib.import_module(module), attr) is main
    assert importlib.import_module("ratequeue.__main__").main is main


def test_python_dash_m_runs_every_subcommand() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ratequeue", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for command in ("demo", "lab", "loadtest", "mock-provider", "quota"):
        assert command in out
        sub = subprocess.run(
            [sys.executable, "-m", "ratequeue", command, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert sub.returncode == 0, sub.stderr
        assert f"usage: ratequeue {command}" in sub.stdout


def test_python_dash_m_runs_the_burst_demo_without_a_warning() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-W",
            "error::DeprecationWarning",
            "-m",
            "ratequeue",
            "demo",
            "--burst-only",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "max_wait=5 s" in run.stdout
    assert run.stderr == ""


def test_the_mock_provider_subcommand_serves_and_stops(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mock-provider", "--rpm", "60", "--port", "0", "--duration", "0.2"]) == 0
    banner, stats = capsys.readouterr().out.splitlines()
    assert banner.startswith("mock provider on http://127.0.0.1:")
    assert json.loads(stats)["requests"] == 0
