"""Flags whose defaults may come from the environment (`EnvDefaults`), the parsers their values
share, and the trace exporter the OTEL_* variables ask for; config.py builds the server's flags
with them, cli.py the client commands'."""

from __future__ import annotations

import argparse
import logging
from typing import Mapping

ENV_PREFIX = "GPT2SERVE_"
log = logging.getLogger("gpt2serve.config")


def auto_or_int(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else int(text)


def auto_float(text: str) -> float | None:
    return None if text.strip().lower() == "auto" else float(text)


def env_name(flag: str, prefix: str = ENV_PREFIX) -> str:
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


ENV_ERRORS = "_env_errors"  # the Namespace attribute with the chosen command's bad env values


class EnvDefaults:
    """Adds flags whose defaults come from the environment when set there. A bad value is
    reported only when its command runs (`env_errors`), so it cannot break another command."""

    def __init__(self, parser: argparse.ArgumentParser, environ: Mapping[str, str], prefix: str = ENV_PREFIX):
        self.parser = parser
        self.environ = environ
        self.prefix = prefix
        self.errors: list[str] = []
        parser.set_defaults(**{ENV_ERRORS: self.errors})

    def add(self, flag: str, *, type=str, default=None, help: str = "", secret: bool = False, env: str | None = None,
            **kwargs) -> None:
        """`env`: the variable's name, when not <prefix><FLAG>."""
        name = env or env_name(flag, self.prefix)
        if name in self.environ:
            raw = self.environ[name]
            try:
                default = type(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                self.errors.append(f"{name}={'<secret>' if secret else repr(raw)}: {exc}")
        if type is parse_bool:
            kwargs.setdefault("nargs", "?")
            kwargs.setdefault("const", True)
        self.parser.add_argument(
            flag, type=type, default=default,
            help=f"{help} [env {name}" + ("]" if secret else "; default: %(default)s]"), **kwargs
        )


def env_bool(environ: Mapping[str, str], flag: str, default: bool) -> bool:
    """A boolean's default from GPT2SERVE_<FLAG>, for a switch flag (store_false) that takes no value;
    a bad value keeps the default (the switch itself still works)."""
    try:
        return parse_bool(environ[env_name(flag)])
    except (KeyError, argparse.ArgumentTypeError):
        return default


def lora_modules(value: str) -> tuple[str, ...]:
    """name=path entries: one from the command line, or the variable's, separated by spaces."""
    entries = tuple(value.split())
    for entry in entries:
        name, _, path = entry.partition("=")
        if not name or not path:
            raise argparse.ArgumentTypeError(f"{entry!r} is not name=path")
    return entries


def traces_exporter_configured(environ: Mapping[str, str]) -> str | None:
    """Which exporter the OTEL_* variables ask for: "otlp", "console", or None (tracing off).

    The OTel default exporter is OTLP to localhost:4317; a server that nobody pointed at a
    collector should not log export failures forever, so an endpoint or an explicit
    OTEL_TRACES_EXPORTER is required."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter in ("none", "console", "otlp"):
        return None if exporter == "none" else exporter
    if exporter:
        log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none); tracing is off", exporter)
        return None
    if environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return "otlp"
    return None
