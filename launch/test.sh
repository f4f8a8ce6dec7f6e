#!/usr/bin/env bash
# README's test command: set up a fresh machine, then run the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
exec python3 -m pytest tests -n 2 -q "$@"
