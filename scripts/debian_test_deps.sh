#!/usr/bin/env bash
# What the tests need from Debian, installed when missing: Prometheus (a real server scrapes
# gpt2serve in tests/observability/test_prometheus.py; promtool checks deploy/prometheus/prometheus.yml), the
# Docker engine, docker-compose and debootstrap (tests/deploy/test_stack.py builds and starts the whole
# stack: scripts/stack.sh), npm (the Helm chart tests fetch helm and CRD schemas with it:
# scripts/chart_tools.sh), Chromium (tests/ui/test_ui.py renders the /ui page in it, headless), and a C++
# compiler (the server builds its CPU ops with it, engine/native.py; tests/engine/test_native.py), and
# h2load and wrk (`gpt2serve bench --native` loads gRPC and REST with them; tests/client/test_bench_native.py),
# and curl (tests/serving/test_http_wire.py: its --http2 asks to upgrade every request).
set -euo pipefail
packages=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || packages+=(prometheus)
command -v docker-compose >/dev/null || packages+=(docker-compose)
command -v dockerd >/dev/null && command -v docker >/dev/null || packages+=(docker.io)
command -v debootstrap >/dev/null || packages+=(debootstrap)
command -v npm >/dev/null && command -v node >/dev/null || packages+=(npm)
command -v chromium >/dev/null || packages+=(chromium)
command -v c++ >/dev/null || packages+=(g++)
command -v h2load >/dev/null || packages+=(nghttp2-client)
command -v wrk >/dev/null || packages+=(wrk)
command -v curl >/dev/null || packages+=(curl)
[ ${#packages[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing from Debian: ${packages[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
