"""`scripts/pgo_wheel.py` (`make build PGO=1`): the parts that decide before any build.

The whole pipeline takes minutes and is run by hand (README, "Set up and run"); these
check how it finds its llvm-profdata and which packages its training run installs.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pgo_wheel.py"


@pytest.fixture(scope="module")
def pgo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pgo_wheel", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool(folder: Path, name: str, version: int | None = None) -> Path:
    """A fake executable `name` in `folder`, printing an LLVM version when asked."""
    path = folder / name
    path.write_text(f"#!/bin/sh\necho 'LLVM version {version or 0}.1.0'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def path_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH holding only a fresh folder, LLVM_PROFDATA unset."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLVM_PROFDATA", raising=False)
    return tmp_path


def test_the_newest_versioned_tool_not_past_rustcs_llvm(pgo: ModuleType, path_only: Path) -> None:
    for major in (14, 18, 19, 20, 23):
        tool(path_only, f"llvm-profdata-{major}")
    assert pgo.find_profdata(22, None) == str(path_only / "llvm-profdata-20")
    assert pgo.find_profdata(19, None) == str(path_only / "llvm-profdata-19")


def test_a_plain_tool_only_of_a_version_in_range(pgo: ModuleType, path_only: Path) -> None:
    plain = tool(path_only, "llvm-profdata", 14)  # Debian's default: too old
    tool(path_only, "llvm-profdata-18")
    with pytest.raises(pgo.Failed, match=r"no llvm-profdata for rustc's LLVM 22 .*llvm-tools"):
        pgo.find_profdata(22, None)
    tool(path_only, "llvm-profdata", 21)
    assert pgo.find_profdata(22, None) == str(plain)
    tool(path_only, "llvm-profdata", 23)  # newer than rustc's: its index may not be read
    with pytest.raises(pgo.Failed):
        pgo.find_profdata(22, None)


def test_the_environment_then_rustups_tool_come_first(
    pgo: ModuleType, path_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool(path_only, "llvm-profdata-22")
    assert pgo.find_profdata(22, "/rustup/llvm-profdata") == "/rustup/llvm-profdata"
    mine = tool(path_only, "mine", 21)
    monkeypatch.setenv("LLVM_PROFDATA", str(mine))
    assert pgo.find_profdata(22, "/rustup/llvm-profdata") == str(mine)
    # The user's choice is checked too: one too new, or not a tool at all, is refused.
    monkeypatch.setenv("LLVM_PROFDATA", str(tool(path_only, "newer", 23)))
    with pytest.raises(pgo.Failed, match=r"LLVM 19 to 22 .*it says 23"):
        pgo.find_profdata(22, None)
    monkeypatch.setenv("LLVM_PROFDATA", str(path_only / "absent"))
    with pytest.raises(pgo.Failed, match="it says None"):
        pgo.find_profdata(22, None)


def test_rustups_tool_is_looked_for_in_the_sysroot(pgo: ModuleType) -> None:
    found = pgo.rustup_profdata()
    assert found is None or (os.access(found, os.X_OK) and "rustlib" in found)


def test_the_training_installs_the_test_extra_only(pgo: ModuleType) -> None:
    metadata = "\n".join(
        [
            "Metadata-Version: 2.4",
            "Name: ratequeue",
            "Requires-Dist: numpy>=1.24 ; extra == 'numpy'",
            "Requires-Dist: pytest>=8 ; extra == 'test'",
            'Requires-Dist: httpx2>=2.12; extra == "test"',
            "Requires-Dist: hypothesis>=6.100 ; extra == 'test'",
            "Requires-Dist: pytest-benchmark>=4 ; extra == 'bench'",
            "Provides-Extra: test",
        ]
    )
    assert pgo.extra_requirements(metadata, "test") == [
        "pytest>=8",
        "httpx2>=2.12",
        "hypothesis>=6.100",
    ]
    assert pgo.extra_requirements(metadata, "lab") == []
    # A marker that says more than the extra is refused, never dropped or misread.
    odd = metadata + "\nRequires-Dist: uvloop ; sys_platform != 'win32' and extra == 'test'"
    with pytest.raises(pgo.Failed, match="marker"):
        pgo.extra_requirements(odd, "test")
    assert pgo.extra_requirements(odd, "numpy") == ["numpy>=1.24"]


def test_flags_keep_the_users_and_survive_spaces(
    pgo: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spaced = tmp_path / "a folder" / "target"
    monkeypatch.delenv("CARGO_ENCODED_RUSTFLAGS", raising=False)
    monkeypatch.setenv("RUSTFLAGS", "-Cdebuginfo=1  -Copt-level=3")
    env = pgo.cargo_env(spaced, f"-Cprofile-use={spaced}/p.profdata")
    assert "RUSTFLAGS" not in env and env["CARGO_TARGET_DIR"] == str(spaced)
    assert env["CARGO_ENCODED_RUSTFLAGS"].split("\x1f") == [
        "-Cdebuginfo=1",
        "-Copt-level=3",
        f"-Cprofile-use={spaced}/p.profdata",
    ]
    # cargo reads the encoded variable first: the user's, when set, is the one kept.
    monkeypatch.setenv("CARGO_ENCODED_RUSTFLAGS", "-Cdebuginfo=2\x1f--cfg\x1fa b")
    env = pgo.cargo_env(spaced, "-Cx")
    assert env["CARGO_ENCODED_RUSTFLAGS"].split("\x1f") == ["-Cdebuginfo=2", "--cfg", "a b", "-Cx"]


def test_the_project_wheel_names_its_test_extra(pgo: ModuleType) -> None:
    """The installed wheel's own METADATA lists what the training run needs."""
    from importlib.metadata import distribution

    needs = pgo.extra_requirements(distribution("ratequeue").read_text("METADATA") or "", "test")
    assert any(n.startswith("pytest") for n in needs) and any(n.startswith("httpx") for n in needs)
