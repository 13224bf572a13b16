"""The transport's ledger type is ``ratequeue.ledger.LedgerLike``, named once; the
transport alone does not import the ledger package."""

from __future__ import annotations

import subprocess
import sys

import ratequeue.httpx as rqhttpx
import ratequeue.ledger as ledger


def test_httpx_ledger_is_the_ledger_packages_protocol() -> None:
    assert rqhttpx.Ledger is ledger.LedgerLike
    assert "LedgerLike" in ledger.__all__ and "Ledger" in rqhttpx.__all__


def test_ledger_base_has_every_call_of_the_protocol() -> None:
    for name in ("hold", "settle", "release"):
        assert callable(getattr(ledger.LedgerBase, name))
        assert callable(getattr(ledger.LedgerBase, name + "_async"))


def test_importing_the_transport_does_not_import_the_ledger_package() -> None:
    code = "import sys, ratequeue.httpx; print('ratequeue.ledger' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
