#!/usr/bin/env bash
# README's main command: set up a fresh machine, then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
exec python3 launch/demo.py "$@"
