# Sourced by bench/run, bench/wire and bench/manystreams: find nginx and wrk, installing them from
# Debian's packages first when they are missing and we are root (BENCH_APT=0 skips the install).
find_bin() { command -v "$1" 2>/dev/null || { [ -x "/usr/sbin/$1" ] && echo "/usr/sbin/$1"; } || true; }
ensure_tools() {
    if [ "${BENCH_APT:-1}" = 1 ] && { [ -z "$(find_bin nginx)" ] || [ -z "$(find_bin wrk)" ]; }; then
        if [ "$(id -u)" = 0 ]; then
            echo "bench: installing nginx and wrk (apt)" >&2
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq >/dev/null &&
                { apt-get install -y -qq --no-install-recommends nginx-light wrk >/dev/null ||
                    apt-get install -y -qq --no-install-recommends nginx wrk >/dev/null; } ||
                echo "bench: apt-get could not install nginx/wrk" >&2
        else
            echo "bench: not root: cannot apt-get install nginx and wrk" >&2
        fi
    fi
    NGINX=$(find_bin nginx)
    WRK=$(find_bin wrk)
}
