"""Build the release wheel with profile-guided optimisation (``make build PGO=1``).

    .venv/bin/python scripts/pgo_wheel.py [--out dist] [--train core httpx ...]

Three steps, each in a cargo target directory of its own (``target/pgo-gen``,
``target/pgo-use``) so the plain release build's cache stays valid:

1. an instrumented release wheel (``-Cprofile-generate``), unpacked under ``target/pgo``
   (the venv's own build is left alone; it gets the ``test`` extra's packages);
2. the training run, with that package first on the path: the test suite's directories
   named by ``--train`` (by default the core, asyncio, keyed, policy, ASGI, ledger, LLM
   transport and README tests: every layer's common calls and its edge cases; not the
   benchmarks, whose figures would then be trained for);
3. the profiles merged by ``llvm-profdata`` and the release wheel built from them
   (``-Cprofile-use``) into ``--out``.

LLVM lays out each function's common path contiguously and its rare paths apart, so a call
touches fewer cache lines of code: on the LLM transport's loopback row this cuts the added
last-level code misses per call by about a quarter (``benches/results/``, session 35).

``llvm-profdata`` must read the raw profiles of rustc's LLVM and write an index that
rustc's LLVM reads: the first found of ``$LLVM_PROFDATA``, rustup's ``llvm-tools``
component (``rustup component add llvm-tools``), or ``llvm-profdata-N`` on PATH for the
highest N from rustc's LLVM major down to 19 (Debian: ``apt-get install llvm-19``).
Without one it stops before building anything. A training test that fails is reported,
not fatal: training is not testing, and ``make test`` tests the wheel this builds.
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


def run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, text=True, cwd=cwd, env=env)


def rustc_llvm_major() -> int:
    out = subprocess.run(["rustc", "-vV"], check=True, capture_output=True, text=True).stdout
    m = re.search(r"^LLVM version: (\d+)", out, re.M)
    if m is None:
        sys.exit(f"pgo_wheel: rustc -vV names no LLVM version:\n{out}")
    return int(m.group(1))


def find_profdata(llvm: int) -> str:
    """The path of an llvm-profdata that speaks rustc's profile formats, or exit saying why."""
    if env := os.environ.get("LLVM_PROFDATA"):
        return env
    sysroot = subprocess.run(
        ["rustc", "--print", "sysroot"], check=True, capture_output=True, text=True
    ).stdout.strip()
    host = subprocess.run(
        ["rustc", "--print", "host-tuple"], capture_output=True, text=True
    ).stdout.strip()
    if host:
        tool = Path(sysroot, "lib", "rustlib", host, "bin", "llvm-profdata")
        if tool.is_file():
            return str(tool)
    for major in range(llvm, OLDEST_LLVM - 1, -1):
        if found := shutil.which(f"llvm-profdata-{major}"):
            return found
    plain = shutil.which("llvm-profdata")
    if plain:
        out = subprocess.run([plain, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"LLVM version (\d+)", out)
        if m and OLDEST_LLVM <= int(m.group(1)) <= llvm:
            return plain
    sys.exit(
        f"pgo_wheel: no llvm-profdata for rustc's LLVM {llvm} (needs LLVM {OLDEST_LLVM} to "
        f"{llvm}): `rustup component add llvm-tools`, `apt-get install llvm-{OLDEST_LLVM}`, "
        "or LLVM_PROFDATA=/path/to/llvm-profdata; `make build` without PGO=1 needs none"
    )


def maturin(out: Path, target: str, rustflags: str) -> Path:
    """A release wheel built with ``rustflags`` added, alone in ``out``; its path."""
    shutil.rmtree(out, ignore_errors=True)
    flags = " ".join(f for f in (os.environ.get("RUSTFLAGS", ""), rustflags) if f)
    env = {**os.environ, "RUSTFLAGS": flags, "CARGO_TARGET_DIR": str(ROOT / "target" / target)}
    build = [str(Path(sys.executable).parent / "maturin"), "build", "--release", "--quiet"]
    run([*build, "--out", str(out), "--interpreter", sys.executable], cwd=ROOT, env=env)
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        sys.exit(f"pgo_wheel: expected one wheel in {out}, found {wheels}")
    return wheels[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dist")
    ap.add_argument("--train", nargs="+", default=list(TRAIN), metavar="TESTS_DIR")
    args = ap.parse_args()
    for d in args.train:
        if not (ROOT / "tests" / d).is_dir():
            sys.exit(f"pgo_wheel: tests/{d} is not a directory")
    profdata = find_profdata(rustc_llvm_major())
    work = ROOT / "target" / "pgo"
    raw = work / "raw"
    shutil.rmtree(raw, ignore_errors=True)
    raw.mkdir(parents=True)

    gen = maturin(work / "gen-wheel", "pgo-gen", f"-Cprofile-generate={raw}")
    # The instrumented package runs unpacked, first on the path: the venv keeps its own
    # build whatever happens here (it gets only the test extra's packages).
    site = work / "site"
    shutil.rmtree(site, ignore_errors=True)
    with zipfile.ZipFile(gen) as wheel:
        wheel.extractall(site)
    (meta,) = site.glob("*.dist-info/METADATA")
    test_extra = re.compile(r"Requires-Dist:\s*([^;]+?)\s*;\s*extra\s*==\s*['\"]test['\"]")
    extra = [m[1] for line in meta.read_text().splitlines() if (m := test_extra.fullmatch(line))]
    run([sys.executable, "-m", "pip", "install", "--quiet", *extra])
    env = {k: v for k, v in os.environ.items() if k != "CI"}  # a missing service skips
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["LLVM_PROFILE_FILE"] = str(raw / "%m-%p.profraw")
    probe = "import ratequeue._ratequeue as m; print(m.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    if not Path(where).is_relative_to(site):
        sys.exit(f"pgo_wheel: the training would import {where}, not the instrumented build")
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.train]
    print("+", " ".join(tests), flush=True)
    trained = subprocess.run(tests, cwd=ROOT / "tests", env=env, text=True)
    if trained.returncode not in (0, 1):  # 1: some tests failed; anything else: no run
        sys.exit(f"pgo_wheel: the training run stopped (pytest exit {trained.returncode})")
    if trained.returncode == 1:
        print("pgo_wheel: some training tests failed (the profile is still used)", flush=True)
    profiles = sorted(raw.glob("*.profraw"))
    if not profiles:
        sys.exit(f"pgo_wheel: the training run wrote no profile into {raw}")
    merged = work / "merged.profdata"
    run([profdata, "merge", "-o", str(merged), *map(str, profiles)])

    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.whl"):
        old.unlink()
    final = maturin(work / "use-wheel", "pgo-use", f"-Cprofile-use={merged}")
    shutil.copy2(final, args.out / final.name)
    print(f"pgo_wheel: {args.out / final.name} (trained on tests/{', tests/'.join(args.train)})")


if __name__ == "__main__":
    main()
