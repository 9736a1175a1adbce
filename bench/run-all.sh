#!/usr/bin/env bash
# Runs every benchmark; each prints a Markdown table with ratios to its peers.
set -euo pipefail
cd "$(dirname "$0")"
python3 foundation.py "$@"
python3 interception.py "$@"
