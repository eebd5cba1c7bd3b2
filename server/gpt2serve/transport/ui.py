"""The layer viewer at /ui: one static page shipped in the package (server/gpt2serve/ui/), no CDN,
no build step. It calls the public REST API like any client (POST /v1/next-token with
attention_maps); /ui/config.json tells it what this server allows, and holds no model data.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from ..config import ServeConfig

FILES = {"/ui": ("index.html", "text/html; charset=utf-8"),
         "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/ui/style.css": ("style.css", "text/css; charset=utf-8")}


def add_ui_routes(app: FastAPI, config: ServeConfig) -> None:
    files = {path: ((resources.files("gpt2serve") / "ui" / name).read_bytes(), media_type)
             for path, (name, media_type) in FILES.items()}
    settings = {"trace_layers": config.trace_layers, "trace_ui_url": config.trace_ui_url,
                "api_key_required": bool(config.api_key)}

    def serve(path: str):
        body, media_type = files[path]
        return lambda: Response(body, media_type=media_type, headers={"cache-control": "no-cache"})

    for path in files:
        app.get(path, include_in_schema=False)(serve(path))

    @app.get("/ui/config.json", include_in_schema=False)
    def ui_config() -> JSONResponse:
        return JSONResponse(settings)
