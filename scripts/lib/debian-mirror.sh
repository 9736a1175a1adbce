# Sourced by scripts that fetch Debian packages (scripts/setup-host.sh, bench/media-disk.sh).
# guest/build-image.sh keeps its own copy: it is embedded in the vmsight binary and runs from a
# temporary directory where this file is not available.
# The first "URIs:" (deb822) or "deb" line that serves the main Debian archive.
debian_mirror() {
    local uri=""
    if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
        uri=$(awk '/^URIs:/ {for (i=2;i<=NF;i++) print $i}' /etc/apt/sources.list.d/*.sources \
              | grep -v -- '-security' | head -n1 || true)
    fi
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk '$1=="deb" && $0 !~ /security/ { for (i=2;i<=NF;i++) if ($i ~ /^(https?|file):/) {print $i; exit} }' \
              /etc/apt/sources.list || true)
    fi
    if [ -z "$uri" ]; then
        echo "cannot find a Debian mirror in the apt configuration" >&2
        return 1
    fi
    printf '%s\n' "$uri"
}
