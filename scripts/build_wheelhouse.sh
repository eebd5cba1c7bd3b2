#!/usr/bin/env bash
# Fill deploy/wheels with the server image's Python packages, built and fetched on this host at
# the pinned versions (constraints.txt), so `docker build` installs them with `pip --no-index`
# and never reaches the network. torch==2.13.0 resolves to the local CPU build on our machines.
# Only wheels go in: no pip configuration, certificates or credentials of this host.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p deploy/wheels
rm -f deploy/wheels/*.whl
"$PYTHON" -m pip wheel --quiet --constraint constraints.txt --wheel-dir deploy/wheels '.[server]'
echo "deploy/wheels: $(ls deploy/wheels/*.whl | wc -l) wheels, $(du -sh deploy/wheels | cut -f1)"
