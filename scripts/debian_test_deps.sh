#!/usr/bin/env bash
# What the tests need from Debian, installed when missing: Prometheus (a real server scrapes
# gpt2serve in tests/test_prometheus.py; promtool checks deploy/prometheus/prometheus.yml).
set -euo pipefail
packages=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || packages+=(prometheus)
[ ${#packages[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing from Debian: ${packages[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
