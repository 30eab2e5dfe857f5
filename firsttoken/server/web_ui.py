"""The chat page at `/`: the static files of firsttoken/server/web (HTML, CSS, JavaScript
modules, no build step), read once when the app is made and served from memory."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI
from starlette.responses import Response

from firsttoken.server.errors import APIError

INDEX = "index.html"
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",  # module scripts load only with a JavaScript type
}
# The page may run and style only its own files and talk only to this server: markup that got
# into the page by mistake could neither run a script nor send anything elsewhere.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # An upgraded server's page is fetched again rather than run stale against a new API.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class WebFile:
    """One file of the page: its bytes and media type."""

    body: bytes
    media_type: str

    def response(self) -> Response:
        return Response(self.body, media_type=self.media_type, headers=_HEADERS)


def load_web_files() -> dict[str, WebFile]:
    """Every file of the page, by name."""
    folder = resources.files("firsttoken.server").joinpath("web")
    files = {}
    for entry in folder.iterdir():
        media_type = _MEDIA_TYPES.get("." + entry.name.rpartition(".")[2])
        if media_type is not None:
            files[entry.name] = WebFile(entry.read_bytes(), media_type)
    return files


def add_web_ui(app: FastAPI) -> None:
    """Serve the page at `/` and its other files at `/web/<name>`."""
    files = load_web_files()

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return files[INDEX].response()

    @app.get("/web/{name}", include_in_schema=False)
    async def web_file(name: str) -> Response:
        found = files.get(name)
        if found is None:
            raise APIError(404, f"name: the chat page has no file {name!r}", param="name", code="not_found")
        return found.response()
