"""What importing askonce pulls in: no asyncio and no framework until an integration is imported."""

from __future__ import annotations

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
