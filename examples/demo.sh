#!/usr/bin/env bash
# README's first command: install everything from nothing, then run the local demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install
exec .venv/bin/python -m elasticd.demo "$@"
