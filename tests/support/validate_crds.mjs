// Validates custom resources against their CRD schemas, with the @kubernetes-models packages
// that scripts/chart_tools.sh installs into .tools/. Used by tests/deploy/test_helm_chart.py:
//   node validate_crds.mjs <tools dir> <file with a JSON array of objects>
// Prints one line per object ("ok <kind>/<name>" or "invalid <kind>/<name>: <why>"); exits 1 if
// any is invalid or of a kind it has no schema for.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const MODELS = {
  "keda.sh/v1alpha1/ScaledObject": "keda/keda.sh/v1alpha1/ScaledObject.js",
  "monitoring.coreos.com/v1/ServiceMonitor": "prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor.js",
};

const [toolsDir, file] = process.argv.slice(2);
let failed = false;
for (const object of JSON.parse(readFileSync(file, "utf8"))) {
  const key = `${object.apiVersion}/${object.kind}`;
  const name = `${object.kind}/${object.metadata?.name}`;
  const model = MODELS[key];
  if (!model) {
    console.log(`invalid ${name}: no schema for ${key}`);
    failed = true;
    continue;
  }
  const module = await import(pathToFileURL(join(toolsDir, "node_modules/@kubernetes-models", model)).href);
  try {
    new module[object.kind](object).validate();
    console.log(`ok ${name}`);
  } catch (error) {
    console.log(`invalid ${name}: ${error.message}`);
    failed = true;
  }
}
process.exit(failed ? 1 : 0);
