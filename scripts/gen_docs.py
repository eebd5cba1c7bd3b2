"""Write the reference tables in docs/ from the code that defines them, so they cannot drift:

    docs/configuration.md   flags      `gpt2serve serve`'s argument parser (each flag's env name too)
    docs/metrics.md         metrics    the metrics registry (telemetry.metrics.Metrics)
    docs/api.md             rpcs       the gRPC service's descriptor
                            routes     the REST app's OpenAPI document (every route it serves)
                            statuses   gpt2serve_client.status, the table server and clients read

Each table sits between `<!-- NAME:start -->` and `<!-- NAME:end -->`; the text around it is
written by hand. `--check` rewrites nothing and exits 1 naming the stale tables
(tests/project/test_docs.py runs it, so a stale doc fails the suite).

    .venv/bin/python scripts/gen_docs.py [--check]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def cell(text: str) -> str:
    """One line of a Markdown table cell: pipes escaped, and `<name>` kept as text, not taken for HTML."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def flags() -> str:
    from gpt2serve.config import add_serve_arguments

    parser = argparse.ArgumentParser(prog="gpt2serve serve")
    add_serve_arguments(parser, environ={})  # the defaults, not this shell's GPT2SERVE_* values
    rows = ["| flag | env | default | what it does |", "|---|---|---|---|"]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        help_text = action.help % {**vars(action), "prog": parser.prog}
        described, env, default = re.fullmatch(r"(.*?)\s*\[env ([A-Z0-9_]+)(?:; default: (.*))?\]", help_text,
                                               re.S).groups()
        if action.choices:
            described += f" (one of: {', '.join(map(str, action.choices))})"
        shown = "(secret)" if default is None else f"`{default}`" if default not in ("", "None") else "none"
        rows.append(f"| `{', '.join(action.option_strings)}` | `{env}` | {shown} | {cell(described)} |")
    return "\n".join(rows)


def metrics() -> str:
    from prometheus_client.metrics import MetricWrapperBase

    from gpt2serve.telemetry.metrics import Metrics

    rows = ["| metric | type | labels | what it counts |", "|---|---|---|---|"]
    for metric in vars(Metrics()).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        (family,) = metric.describe()
        name = family.name + ("_total" if family.type == "counter" else "_info" if family.type == "info" else "")
        labels = ", ".join(f"`{label}`" for label in getattr(metric, "_labelnames", ()))
        rows.append(f"| `{name}` | {family.type} | {labels} | {cell(family.documentation)} |")
    return "\n".join(rows)


def rpcs() -> str:
    from gpt2serve_client._proto import gpt2serve_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Gpt2Serve"]
    rows = ["| RPC (`gpt2serve.v1.Gpt2Serve`) | request | response |", "|---|---|---|"]
    for method in service.methods:
        stream = "stream of " if method.server_streaming else ""
        rows.append(f"| `{method.name}` | `{method.input_type.name}` | {stream}`{method.output_type.name}` |")
    return "\n".join(rows)


def routes() -> str:
    from gpt2serve.config import ServeConfig
    from gpt2serve.service import InferenceService
    from gpt2serve.transport.http_errors import HttpErrors
    from gpt2serve.transport.rest import OPENAI_PATHS, InferenceRoutes, create_fastapi, method_of

    config = ServeConfig()
    service = InferenceService(config)
    errors = HttpErrors(service.count_refusal, method_of, OPENAI_PATHS)
    spec = create_fastapi(service, InferenceRoutes(service, errors), errors, config).openapi()
    rows = ["| route | what it does | errors |", "|---|---|---|"]
    for path, operations in spec["paths"].items():
        for verb, operation in operations.items():
            described = (operation.get("description") or "").strip().split("\n\n")[0]  # the handler's docstring
            codes = ", ".join(code for code in sorted(operation["responses"]) if code >= "400")
            rows.append(f"| `{verb.upper()} {path}` | {cell(described or operation.get('summary', ''))} | {codes} |")
    return "\n".join(rows)


def statuses() -> str:
    from gpt2serve_client.status import ERROR_STATUSES

    rows = ["| gRPC code | REST | OpenAI routes | OpenAI `type` | Retry-After | when |", "|---|---|---|---|---|---|"]
    for s in ERROR_STATUSES:
        rows.append(f"| `{s.code}` | {s.http} | {s.openai_http} | `{s.openai_type}` | "
                    f"{'yes' if s.retry_after else ''} | {s.when} |")
    return "\n".join(rows)


TABLES = {"configuration.md": {"flags": flags}, "metrics.md": {"metrics": metrics},
          "api.md": {"rpcs": rpcs, "routes": routes, "statuses": statuses}}


def refreshed(text: str, name: str, table: str, page: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"docs/{page}: no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table}\n{end}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args()
    stale = []
    for page, tables in TABLES.items():
        path = DOCS / page
        text = original = path.read_text()
        for name, make in tables.items():
            text = refreshed(text, name, make(), page)
        if text != original:
            stale.append(page)
            if not args.check:
                path.write_text(text)
    if stale and args.check:
        print(f"stale tables in docs/{', docs/'.join(stale)}: run `.venv/bin/python scripts/gen_docs.py`",
              file=sys.stderr)
        return 1
    print(f"{'refreshed' if stale else 'up to date'}: {', '.join(stale) or 'every table'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
