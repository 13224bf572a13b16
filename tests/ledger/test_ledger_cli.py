"""``ratequeue quota``: show, usage, export and compensate against SQLite and Redis."""

from __future__ import annotations

import atexit
import csv
import io
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ledger_backends import shared_redis, stop_shared_redis
from ratequeue.__main__ import main
from ratequeue.ledger import Plan, RedisLedger, SqliteLedger

atexit.register(stop_shared_redis)


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "quota.db")
    led = SqliteLedger(path)
    for a in ("acme", "beta"):
        led.set_plan(a, Plan("pro", tokens=1000, calls=50))
    for i in range(5):
        led.charge(f"r{i}", "acme", input_tokens=100, output_tokens=20, model="gpt", parent_id="u1")
    led.charge("b0", "beta", input_tokens=10)
    led.close()
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["quota", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_show(db: str, capsys) -> None:
    code, out, _ = run(capsys, "--db", db, "show", "acme")
    assert code == 0
    assert "plan pro" in out
    line = next(x for x in out.splitlines() if x.startswith("tokens"))
    assert line.split()[:6] == ["tokens", "1000", "600", "0", "0", "400"]
    assert "60.0%" in line


def test_usage_table_pages(db: str, capsys) -> None:
    code, out, _ = run(capsys, "--db", db, "usage", "acme", "--limit", "3")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["time", "(UTC)", "request", "parent"]
    assert len(lines) == 6 and [x.split()[1] for x in lines[2:5]] == ["r0", "r1", "r2"]
    cursor = lines[-1].split("--cursor ")[1]
    code, out, _ = run(capsys, "--db", db, "usage", "acme", "--limit", "3", "--cursor", cursor)
    assert code == 0 and "more:" not in out and len(out.splitlines()) == 4


def test_export_csv(db: str, capsys, tmp_path: Path) -> None:
    code, out, _ = run(capsys, "--db", db, "export", "acme")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 5 and {r["parent_id"] for r in rows} == {"u1"}
    assert sum(int(r["input_tokens"]) for r in rows) == 500
    target = tmp_path / "out.csv"
    code, _, err = run(
        capsys,
        "--db",
        db,
        "export",
        "acme",
        "--out",
        str(target),
        "--since",
        "2000-01-01T00:00:00",
        "--until",
        str(time.time() + 60),
    )
    assert code == 0 and "wrote 5 rows" in err and len(target.read_text().splitlines()) == 6


def test_compensate_dry_run_then_real_then_rerun(db: str, capsys) -> None:
    code, out, _ = run(capsys, "--db", db, "compensate", "pm-1", "--dry-run", "--no-progress")
    assert code == 0 and "would change 2" in out
    assert "tokens  610            500" in out  # usage removed, bonus 2 x 250
    led = SqliteLedger(db)
    assert led.balance("acme").used["tokens"] == 600
    led.close()
    code, out, _ = run(capsys, "--db", db, "compensate", "pm-1", "--no-progress")
    assert code == 0 and "changed 2" in out
    code, out, err = run(capsys, "--db", db, "compensate", "pm-1", "--progress")
    assert code == 0 and "already done 2" in out and "100.0%" in err
    led = SqliteLedger(db)
    b = led.balance("acme")
    assert b.used["tokens"] == 0 and b.bonus["tokens"] == 250
    led.close()


def test_compensate_credit_for_listed_accounts(db: str, capsys, tmp_path: Path) -> None:
    listed = tmp_path / "accounts.txt"
    listed.write_text("beta\n\n")
    code, out, _ = run(
        capsys,
        "--db",
        db,
        "compensate",
        "c",
        "--credit",
        "0.25",
        "--account",
        "acme",
        "--accounts-file",
        str(listed),
        "--no-progress",
    )
    assert code == 0 and "changed 2" in out
    led = SqliteLedger(db)
    assert led.balance("acme").used["tokens"] == 350
    assert led.balance("beta").used["tokens"] == 0  # never negative
    led.close()


def test_errors_are_messages_not_tracebacks(db: str, capsys) -> None:
    code, _, err = run(capsys, "--db", db, "show", "nobody")
    assert code == 1 and "no plan" in err
    with pytest.raises(SystemExit) as e:
        main(["quota", "show", "acme"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["quota", "--db", db + ".missing", "show", "acme"])
    assert e.value.code == 2
    assert "no ledger file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["quota", "--db", db, "compensate", "c", "--bonus", "-1"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["quota", "--db", db, "usage", "acme", "--since", "yesterday"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["quota", "--db", db, "usage", "acme", "--cursor", "nonsense"])
    assert e.value.code == 2


def test_redis_ledger_from_the_command_line(capsys) -> None:
    server = shared_redis()
    import redis

    name = f"cli-{time.monotonic_ns()}"
    led = RedisLedger(redis.Redis.from_url(server.url), name=name)
    led.set_plan("acme", Plan("pro", tokens=100))
    led.charge("r", "acme", input_tokens=42)
    led.close()
    code, out, _ = run(capsys, "--redis", server.url, "--name", name, "show", "acme")
    assert code == 0 and "42" in out
    code, out, _ = run(
        capsys, "--redis", server.url, "--name", name, "compensate", "x", "--no-progress"
    )
    assert code == 0 and "changed 1" in out


def test_the_installed_command(db: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ratequeue", "quota", "--db", db, "show", "beta"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0 and "beta" in r.stdout
