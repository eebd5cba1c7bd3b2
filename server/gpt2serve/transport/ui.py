"""The pages on the REST port, all offline (no CDN, no build step):
- the viewer at /ui: one static page shipped in the package (server/gpt2serve/ui/). It calls the
  public REST API like any client (POST /v1/next-token with attention_maps, POST /v1/generate with
  trace_steps); /ui/config.json tells it what this server allows, and /ui/presets/NAME.json gives
  a preset's shape walk-through and parameter count (introspection: no weights, no model data);
- /docs (Swagger UI 5) and /redoc, their assets from the fastapi-offline package. FastAPI's own
  pages load them from a CDN and render blank on an air-gapped machine.
"""

from __future__ import annotations

from dataclasses import asdict
from importlib import resources

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response

from ..config import ServeConfig
from ..errors import InvalidArgument, NotFound
from ..introspection.architectures import PRESETS, published_summary
from ..introspection.params import count
from ..introspection.walkthrough import preset_walkthrough

SCRIPTS = ("common.js", "walkthrough.js", "app.js", "generate.js", "shapes.js", "score.js", "adapters.js")
FILES = {"/ui": ("index.html", "text/html; charset=utf-8"),
         "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
         **{f"/ui/{name}": (name, "text/javascript; charset=utf-8") for name in SCRIPTS}}
DOCS_ASSETS = {"/docs/static/swagger-ui-bundle.js": "text/javascript; charset=utf-8",
               "/docs/static/swagger-ui.css": "text/css; charset=utf-8",
               "/docs/static/redoc.standalone.js": "text/javascript; charset=utf-8",
               "/docs/static/favicon.png": "image/png"}
CONFIG_PATH = "/ui/config.json"
PRESETS_PATH = "/ui/presets.json"
PRESET_PREFIX = "/ui/presets/"  # + NAME.json: a preset's walk-through and parameter count
MAX_PRESET_TOKENS, MAX_PRESET_BATCH = 4096, 64
# Open without the API key (transport.guard): pages and assets that hold no model data.
PAGE_PATHS = frozenset({*FILES, *DOCS_ASSETS, CONFIG_PATH, PRESETS_PATH, "/docs", "/redoc"})
PAGE_PREFIXES = (PRESET_PREFIX,)


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

    @app.get(PRESETS_PATH, include_in_schema=False)
    def ui_presets() -> JSONResponse:
        return JSONResponse({"presets": [{"name": name, "description": arch.describe()}
                                         for name, arch in PRESETS.items()]})

    @app.get(PRESET_PREFIX + "{name}.json", include_in_schema=False)
    def ui_preset(name: str, tokens: int = 5, batch: int = 1) -> JSONResponse:
        if name not in PRESETS:  # rendered by the app's ServeError handler, like every HTTP error
            raise NotFound(f"no preset {name!r}; {PRESETS_PATH} lists them")
        if not (1 <= tokens <= MAX_PRESET_TOKENS and 1 <= batch <= MAX_PRESET_BATCH):
            raise InvalidArgument(f"tokens must be within 1..{MAX_PRESET_TOKENS} "
                                  f"and batch within 1..{MAX_PRESET_BATCH}")
        arch = PRESETS[name]
        breakdown = count(arch)
        return JSONResponse({
            "name": name, "description": arch.describe(), "published": published_summary(arch),
            "walkthrough": [asdict(step) for step in preset_walkthrough(arch, batch, tokens)],
            "parameters": {"lines": [asdict(line) for line in breakdown.lines], "total": breakdown.total,
                           "active": breakdown.active, "n_layer": arch.n_layer}})
