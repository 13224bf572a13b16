"""Build the release wheel with profile-guided optimisation (``make build PGO=1``).

    .venv/bin/python scripts/pgo_wheel.py [--out dist] [--train core httpx ...]

Two builds, each in a cargo target directory of its own (``pgo-gen`` and ``pgo-use`` under
``$CARGO_TARGET_DIR``, else ``target/``) so the plain release build's cache stays valid:

1. an instrumented release wheel (``-Cprofile-generate``), unpacked under ``pgo/site``
   there (the venv's own build is left alone; the venv gets the ``test`` extra's
   packages);
2. the training run, with that package first on the path: the test suite's directories
   named by ``--train`` (by default the core, asyncio, keyed, policy, ASGI, ledger, LLM
   transport and README tests: every layer's common calls and its edge cases; not the
   benchmarks, whose figures would then be trained for);
3. the training's profiles merged by ``llvm-profdata``, and the release wheel built from
   them (``-Cprofile-use``) into ``--out``.

LLVM then lays out each function's common path apart from its rare paths and compiles
the rare code for size, so a call touches fewer lines of code: the LLM transport's
loopback call adds about a quarter fewer last-level code misses
(``benches/results/transport_pgo35.md``).

``llvm-profdata`` must read the raw profiles of rustc's LLVM and write an index that
rustc's LLVM reads, so its LLVM is from 19 (raw format 10) up to rustc's own: the first
found of ``$LLVM_PROFDATA``, rustup's ``llvm-tools`` component (``rustup component add
llvm-tools``), ``llvm-profdata-N`` on PATH for the highest such N (Debian: ``apt-get
install llvm-19``), or a plain ``llvm-profdata`` of such a version. Without one it stops
before building anything. The flags are passed in ``CARGO_ENCODED_RUSTFLAGS`` after the
environment's own (``CARGO_ENCODED_RUSTFLAGS``, else ``RUSTFLAGS``); rustflags set in a
cargo config file are not applied to these builds (cargo reads them only when neither
variable is set). A training test that fails is reported, not fatal: training is not
testing, and ``make test`` tests the wheel this builds. A training run that did not end
(killed, timed out) is fatal: its main process wrote no profile.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ("core", "aio", "keyed", "policy", "asgi", "ledger", "httpx", "docs")
OLDEST_LLVM = 19  # raw profile format 10, still what rustc's LLVM 22 writes
RUSTC = os.environ.get("RUSTC", "rustc")


class Failed(Exception):
    """A step failed: its message is printed and the script exits 1."""


def run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=cwd, env=env)
    if done.returncode != 0:
        raise Failed(f"{Path(cmd[0]).name} exited {done.returncode}: {' '.join(cmd)}")


def output(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise Failed(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def rustc_llvm_major() -> int:
    out = output([RUSTC, "-vV"])
    m = re.search(r"^LLVM version: (\d+)", out, re.M)
    if m is None:
        raise Failed(f"{RUSTC} -vV names no LLVM version:\n{out}")
    return int(m.group(1))


def rustup_profdata() -> str | None:
    """rustup's ``llvm-tools`` component's llvm-profdata, when it is installed."""
    sysroot = output([RUSTC, "--print", "sysroot"]).strip()
    host = subprocess.run(
        [RUSTC, "--print", "host-tuple"], capture_output=True, text=True
    ).stdout.strip()
    tool = Path(sysroot, "lib", "rustlib", host, "bin", "llvm-profdata")
    return str(tool) if host and tool.is_file() else None


def llvm_version(tool: str) -> int | None:
    """The LLVM major version a tool prints, None when it prints none (or cannot run)."""
    try:
        done = subprocess.run([tool, "--version"], capture_output=True, text=True)
    except OSError:
        return None
    m = re.search(r"LLVM version (\d+)", done.stdout)
    return int(m.group(1)) if m and done.returncode == 0 else None


def find_profdata(llvm: int, rustup: str | None) -> str:
    """The path of an llvm-profdata that speaks rustc's profile formats (LLVM ``llvm``):
    ``$LLVM_PROFDATA``, else ``rustup``'s, else the newest ``llvm-profdata-N`` on PATH
    with N from ``llvm`` down to 19, else a plain ``llvm-profdata`` of such a version."""
    fits = range(OLDEST_LLVM, llvm + 1)
    if env := os.environ.get("LLVM_PROFDATA"):
        if llvm_version(env) not in fits:
            raise Failed(
                f"LLVM_PROFDATA={env} is not an llvm-profdata of LLVM {OLDEST_LLVM} to {llvm} "
                f"(it says {llvm_version(env)})"
            )
        return env
    if rustup:
        return rustup
    for major in reversed(fits):
        if found := shutil.which(f"llvm-profdata-{major}"):
            return found
    if (plain := shutil.which("llvm-profdata")) and llvm_version(plain) in fits:
        return plain
    raise Failed(
        f"no llvm-profdata for rustc's LLVM {llvm} (needs LLVM {OLDEST_LLVM} to "
        f"{llvm}): `rustup component add llvm-tools`, `apt-get install llvm-{OLDEST_LLVM}`, "
        "or LLVM_PROFDATA=/path/to/llvm-profdata; `make build` without PGO=1 needs none"
    )


REQUIRES = re.compile(r"Requires-Dist:\s*([^;]+?)\s*;\s*(.+)")
ONLY_EXTRA = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]""")


def extra_requirements(metadata: str, extra: str) -> list[str]:
    """The requirements of one extra (``test``), from a wheel's METADATA; an entry whose
    marker says more than its extra is refused rather than dropped or misread."""
    needs = []
    for line in metadata.splitlines():
        m = REQUIRES.fullmatch(line.strip())
        if m is None:
            continue
        marker = m[2].strip()
        named = ONLY_EXTRA.search(marker)
        if named is None or named[1] != extra:
            continue
        if ONLY_EXTRA.fullmatch(marker) is None:
            raise Failed(f"a marker this script does not read: {line.strip()!r}")
        needs.append(m[1])
    return needs


def cargo_env(target: Path, flag: str) -> dict[str, str]:
    """The environment of a build into ``target`` with ``flag`` after the user's flags,
    passed encoded so that no path is split at its spaces."""
    env = dict(os.environ)
    if encoded := env.pop("CARGO_ENCODED_RUSTFLAGS", ""):
        flags = encoded.split("\x1f")
    else:
        flags = env.get("RUSTFLAGS", "").split()
    env.pop("RUSTFLAGS", None)
    env["CARGO_ENCODED_RUSTFLAGS"] = "\x1f".join([*flags, flag])
    env["CARGO_TARGET_DIR"] = str(target)
    return env


def maturin(out: Path, target: Path, flag: str) -> Path:
    """A release wheel built with ``flag`` added, alone in ``out``; its path."""
    shutil.rmtree(out, ignore_errors=True)
    build = [str(Path(sys.executable).parent / "maturin"), "build", "--release", "--quiet"]
    cmd = [*build, "--out", str(out), "--interpreter", sys.executable]
    run(cmd, cwd=ROOT, env=cargo_env(target, flag))
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        raise Failed(f"expected one wheel in {out}, found {wheels}")
    return wheels[0]


def train(site: Path, profiles: Path, dirs: list[str]) -> list[Path]:
    """The training run over ``tests/<dirs>`` with the package in ``site`` first on the
    path; the profiles it wrote (its main process's among them)."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}  # a missing service skips
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["LLVM_PROFILE_FILE"] = str(profiles / "%m-%p.profraw")
    probe = "import ratequeue._ratequeue as m; print(m.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT / "tests", env=env, capture_output=True, text=True
    )
    if where.returncode != 0 or not Path(where.stdout.strip()).is_relative_to(site):
        raise Failed(
            "the training would not import the instrumented build: "
            f"{where.stdout.strip() or where.stderr.strip()}"
        )
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *dirs]
    print("+", " ".join(tests), flush=True)
    pytest = subprocess.Popen(tests, cwd=ROOT / "tests", env=env)
    code = pytest.wait()
    # A run that did not end (a timeout's or watchdog's os._exit, a kill) wrote no profile
    # of its main process: a training without it is no training.
    main_profiles = [p for p in profiles.glob(f"*-{pytest.pid}.profraw") if p.stat().st_size]
    if code not in (0, 1) or not main_profiles:
        raise Failed(f"the training run did not end (pytest exit {code}, no profile of its own)")
    if code == 1:
        print("pgo_wheel: some training tests failed (the profile is still used)", flush=True)
    return sorted(profiles.glob("*.profraw"))


def build(out: Path, dirs: list[str]) -> Path:
    for d in dirs:
        if not (ROOT / "tests" / d).is_dir():
            raise Failed(f"tests/{d} is not a directory")
    profdata = find_profdata(rustc_llvm_major(), rustup_profdata())
    if llvm_version(profdata) is None:
        raise Failed(f"{profdata} --version names no LLVM version")
    base = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target").resolve()
    work = base / "pgo"
    # The build's own processes (build scripts, proc macros) are instrumented too: their
    # profiles go apart from the training's.
    built, trained = work / "build-profiles", work / "profiles"
    for folder in (built, trained):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

    gen = maturin(work / "gen-wheel", base / "pgo-gen", f"-Cprofile-generate={built}")
    # The instrumented package runs unpacked, first on the path: the venv keeps its own
    # build whatever happens here (it gets only the test extra's packages).
    site = work / "site"
    shutil.rmtree(site, ignore_errors=True)
    with zipfile.ZipFile(gen) as wheel:
        wheel.extractall(site)
    (meta,) = site.glob("*.dist-info/METADATA")
    needs = extra_requirements(meta.read_text(), "test")
    run([sys.executable, "-m", "pip", "install", "--quiet", *needs])
    profiles = train(site, trained, dirs)
    merged = work / "merged.profdata"
    run([profdata, "merge", "-o", str(merged), *map(str, profiles)])

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    final = maturin(work / "use-wheel", base / "pgo-use", f"-Cprofile-use={merged}")
    shutil.copy2(final, out / final.name)
    return out / final.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dist")
    ap.add_argument("--train", nargs="+", default=list(TRAIN), metavar="TESTS_DIR")
    args = ap.parse_args()
    try:
        wheel = build(args.out.resolve(), args.train)
    except Failed as e:
        sys.exit(f"pgo_wheel: {e}")
    print(f"pgo_wheel: {wheel} (trained on tests/{', tests/'.join(args.train)})")


if __name__ == "__main__":
    main()
