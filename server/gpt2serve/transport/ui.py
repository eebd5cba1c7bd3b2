"""The pages on the REST port, all offline (no CDN, no build step):
- the layer viewer at /ui: one static page shipped in the package (server/gpt2serve/ui/). It calls
  the public REST API like any client (POST /v1/next-token with attention_maps); /ui/config.json
  tells it what this server allows, and holds no model data;
- /docs (Swagger UI 5) and /redoc, their assets from the fastapi-offline package. FastAPI's own
  pages load them from a CDN and render blank on an air-gapped machine.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response

from ..config import ServeConfig

FILES = {"/ui": ("index.html", "text/html; charset=utf-8"),
         "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/ui/style.css": ("style.css", "text/css; charset=utf-8")}
DOCS_ASSETS = {"/docs/static/swagger-ui-bundle.js": "text/javascript; charset=utf-8",
               "/docs/static/swagger-ui.css": "text/css; charset=utf-8",
               "/docs/static/redoc.standalone.js": "text/javascript; charset=utf-8",
               "/docs/static/favicon.png": "image/png"}
CONFIG_PATH = "/ui/config.json"
# Open without the API key (transport.guard): pages and assets that hold no model data.
PAGE_PATHS = frozenset({*FILES, *DOCS_ASSETS, CONFIG_PATH, "/docs", "/redoc"})


def add_ui_routes(app: FastAPI, config: ServeConfig) -> None:
    files = {path: ((resources.files("gpt2serve") / "ui" / name).read_bytes(), media_type)
             for path, (name, media_type) in FILES.items()}
    assets = resources.files("fastapi_offline") / "static"
    files.update({path: ((assets / path.rsplit("/", 1)[1]).read_bytes(), media_type)
                  for path, media_type in DOCS_ASSETS.items()})
    settings = {"trace_layers": config.trace_layers, "trace_ui_url": config.trace_ui_url,
                "api_key_required": bool(config.api_key)}

    def serve(path: str):
        body, media_type = files[path]
        return lambda: Response(body, media_type=media_type, headers={"cache-control": "no-cache"})

    for path in files:
        app.get(path, include_in_schema=False)(serve(path))

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title}: API",
                                   swagger_js_url="/docs/static/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/static/swagger-ui.css",
                                   swagger_favicon_url="/docs/static/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=app.openapi_url, title=f"{app.title}: API",
                              redoc_js_url="/docs/static/redoc.standalone.js",
                              redoc_favicon_url="/docs/static/favicon.png", with_google_fonts=False)

    @app.get(CONFIG_PATH, include_in_schema=False)
    def ui_config() -> JSONResponse:
        return JSONResponse(settings)
