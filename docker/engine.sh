#!/usr/bin/env bash
# Start / stop / query a local Docker engine for the WIIIIIDE lab.
#
#   bash docker/engine.sh start    # install docker.io etc. if needed, start dockerd, wait for it
#   bash docker/engine.sh stop     # stop dockerd, but only the one this script started
#   bash docker/engine.sh status
#
# A dockerd started here logs to build/dockerd.log and leaves its pid in build/dockerd.pid.
# That pidfile is the only thing `stop` acts on: an engine started any other way is never touched.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="$REPO_ROOT/build"
PIDFILE="$BUILD_DIR/dockerd.pid"
LOGFILE="$BUILD_DIR/dockerd.log"
START_TIMEOUT="${WIIIIIDE_DOCKERD_TIMEOUT:-60}"
STOP_TIMEOUT=30

log() { echo "[engine] $*"; }
die() { echo "[engine] ERROR: $*" >&2; exit 1; }

engine_up() {
    command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1
}

# Pid from our pidfile if it names a live dockerd, else nothing.
our_pid() {
    [[ -f "$PIDFILE" ]] || return 1
    local pid
    pid="$(tr -dc '0-9' <"$PIDFILE")"
    [[ -n "$pid" && -d "/proc/$pid" ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "dockerd" ]] || return 1
    echo "$pid"
}

install_packages() {
    local pkgs=()
    command -v dockerd >/dev/null 2>&1 || pkgs+=(docker.io)
    command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || pkgs+=(docker-compose)
    command -v debootstrap >/dev/null 2>&1 || pkgs+=(debootstrap)
    command -v tc >/dev/null 2>&1 || pkgs+=(iproute2)
    if ((${#pkgs[@]} == 0)); then
        return 0
    fi
    command -v apt-get >/dev/null 2>&1 || die "missing ${pkgs[*]} and no apt-get to install them"
    log "installing ${pkgs[*]} (apt-get)"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${pkgs[@]}"
}

cmd_start() {
    if engine_up; then
        log "docker engine already running"
        exit 0
    fi
    if [[ "$(id -u)" != 0 ]]; then
        die "no docker engine answers and starting one needs root (run as root, or start dockerd yourself)"
    fi
    install_packages
    if engine_up; then  # a package's postinst may have started one through its init script
        log "docker engine running (started by the package install)"
        exit 0
    fi
    command -v dockerd >/dev/null 2>&1 || die "dockerd still missing after install"
    command -v docker >/dev/null 2>&1 || die "docker client missing after install"

    mkdir -p "$BUILD_DIR"
    local pid
    if pid="$(our_pid)"; then
        log "dockerd (pid $pid) started earlier is still running but not answering yet"
    else
        rm -f "$PIDFILE"
        log "starting dockerd (log: $LOGFILE)"
        # setsid + nohup: dockerd must outlive this shell (and CI step) that started it. This
        # script runs without job control, so setsid does not fork and $! is dockerd itself.
        nohup setsid dockerd >"$LOGFILE" 2>&1 </dev/null &
        pid=$!
        echo "$pid" >"$PIDFILE"
    fi

    local waited=0
    until engine_up; do
        if [[ ! -d "/proc/$pid" ]]; then
            rm -f "$PIDFILE"
            echo "----- tail of $LOGFILE -----" >&2
            tail -n 30 "$LOGFILE" >&2 || true
            die "dockerd (pid $pid) exited before answering"
        fi
        if ((waited >= START_TIMEOUT)); then
            echo "----- tail of $LOGFILE -----" >&2
            tail -n 30 "$LOGFILE" >&2 || true
            die "dockerd (pid $pid) did not answer 'docker info' within ${START_TIMEOUT}s (still running; 'bash docker/engine.sh stop' stops it)"
        fi
        if ((waited % 5 == 0)); then
            log "waiting for dockerd (pid $pid) ... ${waited}s"
        fi
        sleep 1
        waited=$((waited + 1))
    done
    log "docker engine up after ${waited}s: $(docker version --format 'server {{.Server.Version}}, API {{.Server.APIVersion}}' 2>/dev/null || echo '?')"
}

cmd_stop() {
    if [[ ! -f "$PIDFILE" ]]; then
        if engine_up; then
            log "a docker engine runs but was not started by this script: leaving it alone"
        else
            log "no docker engine started by this script"
        fi
        exit 0
    fi
    local pid
    if ! pid="$(our_pid)"; then
        log "$PIDFILE does not name a running dockerd (stale); removing it"
        rm -f "$PIDFILE"
        exit 0
    fi
    log "stopping dockerd (pid $pid)"
    kill -TERM "$pid"
    local waited=0
    while [[ -d "/proc/$pid" ]]; do
        if ((waited >= STOP_TIMEOUT)); then
            log "dockerd (pid $pid) still running after ${STOP_TIMEOUT}s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 1
            break
        fi
        sleep 1
        waited=$((waited + 1))
    done
    rm -f "$PIDFILE"
    log "dockerd stopped"
}

cmd_status() {
    local pid=""
    pid="$(our_pid)" || pid=""
    if engine_up; then
        local ver
        ver="$(docker version --format 'server {{.Server.Version}}, API {{.Server.APIVersion}}' 2>/dev/null || echo '?')"
        if [[ -n "$pid" ]]; then
            log "running ($ver), started by this script, pid $pid"
        else
            log "running ($ver), not started by this script"
        fi
        exit 0
    fi
    if [[ -n "$pid" ]]; then
        log "dockerd pid $pid (ours) is running but does not answer 'docker info'"
    else
        log "not running"
    fi
    exit 1
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *)
        echo "usage: $0 {start|stop|status}" >&2
        exit 2
        ;;
esac
