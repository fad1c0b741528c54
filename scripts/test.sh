#!/usr/bin/env bash
# Install everything the tests need, then lint, type-check and run the whole suite.
# This is the README's test command and exactly what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
  # The Redis-backed tests start their own redis-server on a free loopback port.
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is missing: install it (apt-get install redis-server) for the Redis tests" >&2
  fi
fi
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # The ledger dashboard is tested in headless Chromium (tests/ledger/test_report_app.py).
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
    || echo "chromium not installed: the dashboard's browser test will skip" >&2
fi
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ] && [ "$(id -u)" = 0 ]; then
  # A real proxy retrying in front of a target (tests/integrations/test_proxy_retries.py).
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null \
    || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null \
    || echo "nginx not installed: the proxy tests will skip" >&2
fi
python -m pip install -q --disable-pip-version-check -e '.[test]'
python -m ruff check src tests bench fuzz
python -m mypy
python -m pytest "$@"
