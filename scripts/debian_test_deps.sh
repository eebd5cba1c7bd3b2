#!/usr/bin/env bash
# What the tests need from Debian, installed when missing: Prometheus (a real server scrapes
# gpt2serve in tests/test_prometheus.py; promtool checks deploy/prometheus/prometheus.yml) and
# docker-compose (its `config` validates docker-compose.yml; Docker itself does not run here), and
# Chromium (tests/test_ui.py renders the /ui page in it, headless).
set -euo pipefail
packages=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || packages+=(prometheus)
command -v docker-compose >/dev/null || packages+=(docker-compose)
command -v chromium >/dev/null || packages+=(chromium)
[ ${#packages[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing from Debian: ${packages[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
