#!/usr/bin/env bash
# Fill deploy/wheels with the server image's Python packages, built and fetched on this host at
# the pinned versions (constraints.txt), so `docker build` installs them with `pip --no-index`
# and never reaches the network. torch stays pinned at 2.13.0 (its CPU build).
# Only wheels go in: no pip configuration, certificates or credentials of this host.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# The same source gives the same wheel bytes (zip timestamps from the last commit), so Docker's
# layer cache holds across fresh clones.
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 315532800)}
mkdir -p deploy/wheels/gpt2serve
rm -f deploy/wheels/*.whl deploy/wheels/gpt2serve/*.whl
"$PYTHON" -m pip wheel --quiet --quiet --constraint constraints.txt --wheel-dir deploy/wheels '.[server]'
# gpt2serve's own wheel apart from its dependencies: the image installs those in a layer of their
# own, which a code change leaves cached.
mv deploy/wheels/gpt2serve-*.whl deploy/wheels/gpt2serve/
echo "deploy/wheels: $(ls deploy/wheels/*.whl | wc -l) wheels, $(du -sh deploy/wheels | cut -f1)"
