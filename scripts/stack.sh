#!/usr/bin/env bash
# The compose stack on a machine that reaches no image registry (`make stack`, `make stack-down`).
#
#   scripts/stack.sh up     install Docker and compose from Debian when absent, start the engine
#                           when none is running, build every image here (nothing is pulled), bring
#                           the stack up, wait until gpt2serve is healthy, print the URLs
#   scripts/stack.sh down [--volumes]
#                           stop the stack (--volumes: and delete its volumes: weights, metrics);
#                           stop the engine too if `up` started it, and undo what that engine
#                           changed on the host (iptables, forwarding, docker0)
#
# Images: gpt2serve (CPU torch), Prometheus from Debian's package, and Arize Phoenix standing in
# for Jaeger as the OTLP trace backend, all on a Debian base made here by debootstrap. Python
# packages come from wheelhouses built on this host with pinned versions; every image build runs
# with --network none. With registry access, plain `docker compose up` is the way (README).
#
# Settings (environment): COMPOSE_PROJECT_NAME (gpt2serve), GPT2SERVE_MODEL (gpt2; random
# weights with a warning when offline), GPT2SERVE_PUBLISH (127.0.0.1: the address the ports are
# published on), GPT2SERVE_{GRPC,REST,PROMETHEUS,TRACES_UI}_PORT, GPT2SERVE_STACK_STATE (.stack:
# the engine's PID, log and the host state to restore), DEBIAN_MIRROR.
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${COMPOSE_PROJECT_NAME:-gpt2serve}
STATE=${GPT2SERVE_STACK_STATE:-$PWD/.stack}
BASE_IMAGE=gpt2serve-base:bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-.venv/bin/python}
HEALTHY_WITHIN_S=${GPT2SERVE_STACK_TIMEOUT_S:-300}
ENGINE_UNAVAILABLE=3  # exit status when the Docker engine itself cannot start
export COMPOSE_PROFILES=cpu COMPOSE_PROJECT_NAME=$PROJECT
# Both compose files, always: the offline file swaps in the images built here.
export COMPOSE_FILE=docker-compose.yml:deploy/compose.offline.yml

say() { echo "stack: $*" >&2; }
sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

install_tools() {
  local packages=()
  command -v dockerd >/dev/null || packages+=(docker.io)
  command -v docker-compose >/dev/null || packages+=(docker-compose)
  command -v debootstrap >/dev/null || packages+=(debootstrap)
  [ ${#packages[@]} -eq 0 ] && return
  say "installing from Debian: ${packages[*]}"
  sudo_if_needed apt-get update -qq
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
}

# --- the engine -----------------------------------------------------------------------------

# The tables dockerd writes to; each is saved before it starts and put back after it stops.
IPTABLES_TABLES=(filter nat)

engine_up() {
  if docker info >/dev/null 2>&1; then
    say "using the running Docker engine"
    return
  fi
  mkdir -p "$STATE"
  sysctl -n net.ipv4.ip_forward >"$STATE/ip_forward"
  for table in "${IPTABLES_TABLES[@]}"; do iptables-save -t "$table" >"$STATE/iptables.$table"; done
  if ip link show docker0 >/dev/null 2>&1; then touch "$STATE/had_docker0"; fi
  say "starting the Docker engine (log: $STATE/dockerd.log)"
  # setsid: the engine outlives this script, and a Ctrl-C here does not reach it.
  setsid dockerd >"$STATE/dockerd.log" 2>&1 </dev/null &
  echo $! >"$STATE/dockerd.pid"
  local pid
  pid=$(cat "$STATE/dockerd.pid")
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && return
    if ! kill -0 "$pid" 2>/dev/null; then
      say "the Docker engine could not start:"
      tail -n 20 "$STATE/dockerd.log" >&2
      restore_host
      exit $ENGINE_UNAVAILABLE
    fi
    sleep 0.5
  done
  say "the Docker engine did not listen within 60 s:"
  tail -n 20 "$STATE/dockerd.log" >&2
  engine_down
  exit $ENGINE_UNAVAILABLE
}

engine_down() {
  [ -f "$STATE/dockerd.pid" ] || return 0
  local pid
  pid=$(cat "$STATE/dockerd.pid")
  if kill -0 "$pid" 2>/dev/null; then
    say "stopping the Docker engine we started (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$STATE/dockerd.pid"
  restore_host
}

# dockerd leaves its iptables chains, the docker0 bridge and IP forwarding behind when it stops.
restore_host() {
  for table in "${IPTABLES_TABLES[@]}"; do
    [ -f "$STATE/iptables.$table" ] || continue
    if grep -q '^\*' "$STATE/iptables.$table"; then
      iptables-restore <"$STATE/iptables.$table"
    else  # the table was not in use: empty it again
      iptables -t "$table" -F && iptables -t "$table" -X
      [ "$table" = filter ] && iptables -P FORWARD ACCEPT
    fi
    rm -f "$STATE/iptables.$table"
  done
  if [ ! -f "$STATE/had_docker0" ] && ip link show docker0 >/dev/null 2>&1; then ip link delete docker0; fi
  rm -f "$STATE/had_docker0"
  if [ -f "$STATE/ip_forward" ]; then
    sysctl -q -w "net.ipv4.ip_forward=$(cat "$STATE/ip_forward")"
    rm -f "$STATE/ip_forward"
  fi
}

# --- what the images are built from ---------------------------------------------------------

# A Debian bookworm root with python3 and venv, from this machine's Debian mirror.
base_image() {
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return
  local root
  root=$(mktemp -d)
  say "debootstrap: $BASE_IMAGE from $DEBIAN_MIRROR (about a minute)"
  if ! debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" "$DEBIAN_MIRROR" \
      >"$STATE/debootstrap.log" 2>&1; then
    tail -n 20 "$STATE/debootstrap.log" >&2
    rm -rf "$root"
    say "debootstrap failed (log: $STATE/debootstrap.log)"
    exit 1
  fi
  tar -C "$root" -c . | docker import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$root"
}

# Debian's prometheus package and the web UI's libraries it depends on, as .deb files.
prometheus_debs() {
  local dir=deploy/prometheus/debs
  ls "$dir"/prometheus_*.deb >/dev/null 2>&1 && return
  mkdir -p "$dir"
  local packages
  packages=$(apt-cache depends --no-pre-depends prometheus | awk '/ Depends: (fonts|libjs)-/ {print $2}')
  # shellcheck disable=SC2086
  (cd "$dir" && { apt-get download -qq prometheus $packages 2>/dev/null \
                  || { sudo_if_needed apt-get update -qq && apt-get download -qq prometheus $packages; }; })
}

# Phoenix's wheels at the versions pinned in deploy/phoenix/requirements.txt.
phoenix_wheels() {
  local dir=deploy/phoenix/wheels
  [ -f "$dir/.complete" ] && [ "$dir/.complete" -nt deploy/phoenix/requirements.txt ] && return
  mkdir -p "$dir"
  "$PYTHON" -m pip download --quiet --quiet --no-deps --dest "$dir" --requirement deploy/phoenix/requirements.txt
  touch "$dir/.complete"
}

build() {
  mkdir -p "$STATE"
  base_image
  [ -f "$PYTHON" ] || make --no-print-directory .venv/.installed-stamp
  scripts/build_wheelhouse.sh
  prometheus_debs
  phoenix_wheels
  say "building the images (network none; cached layers are reused)"
  if ! docker-compose build --quiet >"$STATE/build.log" 2>&1; then
    tail -n 40 "$STATE/build.log" >&2
    say "the image build failed (log: $STATE/build.log)"
    exit 1
  fi
}

wait_healthy() {
  local container status
  container=$(docker-compose ps -q gpt2serve-cpu)
  for _ in $(seq "$HEALTHY_WITHIN_S"); do
    status=$(docker inspect --format '{{.State.Health.Status}}' "$container")
    [ "$status" = healthy ] && return
    if [ "$(docker inspect --format '{{.State.Running}}' "$container")" != true ]; then break; fi
    sleep 1
  done
  say "gpt2serve did not turn healthy (status: ${status:-none}); its last log lines:"
  docker logs --tail 30 "$container" >&2
  exit 1
}

up() {
  install_tools
  engine_up
  build
  docker-compose up --detach --no-build >&2
  wait_healthy
  local host=${GPT2SERVE_PUBLISH:-127.0.0.1}
  cat <<EOF
gpt2serve is up (project $PROJECT, model ${GPT2SERVE_MODEL:-gpt2}):
  REST + OpenAI API   http://$host:${GPT2SERVE_REST_PORT:-8000}   (/v1/completions, /ui, /metrics)
  gRPC                $host:${GPT2SERVE_GRPC_PORT:-50051}
  Prometheus          http://$host:${GPT2SERVE_PROMETHEUS_PORT:-9090}
  Traces (Phoenix)    http://$host:${GPT2SERVE_TRACES_UI_PORT:-6006}
Stop it with: make stack-down
EOF
}

down() {
  if docker info >/dev/null 2>&1; then
    # 45 s: the server drains accepted requests for up to 30 s on SIGTERM.
    docker-compose down --remove-orphans --timeout 45 "$@" >&2
  fi
  engine_down
}

case "${1:-}" in
  up) up ;;
  down) shift; down "$@" ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
