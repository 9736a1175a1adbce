#!/usr/bin/env bash
# Runs every benchmark; each prints a Markdown table with ratios to its peers (or baseline).
# Benchmarks take options of their own; run them one by one for other settings.
set -euo pipefail
cd "$(dirname "$0")"
python3 foundation.py
python3 interception.py
bash fsview-crawl.sh
python3 filestream.py
python3 icache.py
bash stream-memory.sh
python3 qemu_faults.py --mode stress --runs 4
