# Sourced by the bash benchmarks (one copy of their start): `bench_start NAME HELP_END "$@"`
# records what bench/lib/results.py needs (ARGV, START, LOAD0, T0), takes `--out PATH` (OUT)
# and `-h`/`--help` (prints the script's header comment, lines 2..HELP_END), and refuses
# anything else.
# shellcheck shell=bash
bench_start() {
    local name=$1 help_end=$2
    shift 2
    ARGV=("$0" "$@")
    START=$(date -u +%Y-%m-%dT%H:%M:%SZ) LOAD0=$(cut -d' ' -f1-3 /proc/loadavg) T0=$SECONDS
    OUT=
    while [ $# -gt 0 ]; do
        case $1 in
            --out) OUT=$(realpath -m "$2"); shift 2 ;;
            -h|--help) sed -n "2,${help_end}s/^# \{0,1\}//p" "$0"; exit 0 ;;
            *) echo "$name: unknown option $1 (--out PATH)" >&2; exit 2 ;;
        esac
    done
}
