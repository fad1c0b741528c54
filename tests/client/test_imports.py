"""What importing askonce pulls in: no asyncio and no framework until an integration is imported."""

from __future__ import annotations

import json
import subprocess
import sys


def test_import_askonce_pulls_in_no_asyncio_and_no_framework() -> None:
    code = ("import sys, askonce; bad = [m for m in ('asyncio', 'httpx', 'requests', 'grpc', 'redis', "
            "'starlette', 'fastapi', 'flask') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_importing_the_client_and_the_integrations_package_imports_no_framework_and_not_asyncio() -> None:
    code = ("import sys, askonce.client, askonce.integrations; "
            "print(sorted(m for m in ('httpx', 'requests', 'urllib3', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def _loaded_by_import_askonce() -> list[str]:
    """The modules a fresh interpreter's ``import askonce`` adds (what start-up loaded excluded)."""
    code = ("import sys, json; before = set(sys.modules); import askonce; "
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return list(json.loads(out))


def test_import_askonce_loads_no_integration_simulator_demo_ledger_or_client() -> None:
    # They are layers above the facade: each is imported only by the code that uses it.
    above = ("askonce.integrations", "askonce.sim", "askonce.demo", "askonce.ledger", "askonce.client",
             "askonce.cli", "askonce.breakers", "askonce.core.breaker")
    loaded = _loaded_by_import_askonce()
    assert [m for m in loaded if m.startswith(above)] == []
    assert "askonce.retrying" in loaded  # the probe sees askonce's own modules


def test_import_askonce_loads_neither_asyncio_nor_any_framework() -> None:
    frameworks = {"asyncio", "fastapi", "starlette", "flask", "werkzeug", "httpx", "httpcore",
                  "requests", "urllib3", "grpc", "redis", "prometheus_client", "opentelemetry",
                  "rich", "uvicorn", "waitress", "anyio", "sniffio", "h11", "pydantic", "polars"}
    top = {m.split(".")[0] for m in _loaded_by_import_askonce()}
    assert sorted(top & frameworks) == []
