#!/usr/bin/env bash
# What the tests need from Debian, installed when missing: Prometheus (a real server scrapes
# gpt2serve in tests/test_prometheus.py; promtool checks deploy/prometheus/prometheus.yml) and
# docker-compose (its `config` validates docker-compose.yml; Docker itself does not run here).
set -euo pipefail
packages=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || packages+=(prometheus)
command -v docker-compose >/dev/null || packages+=(docker-compose)
[ ${#packages[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing from Debian: ${packages[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
