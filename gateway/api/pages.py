"""The playground page (``/playground``, and ``/`` redirecting to it): static files
shipped in the package, served with a Content-Security-Policy that lets them run
only this server's own script and talk only to this server.

The page is public (it holds no data); the API calls it makes carry the key the
user types when the server requires one.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

PAGE = "/playground"
# No inline script or style, nothing from another origin, no framing.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
ASSETS = {
    "playground.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}

router = APIRouter(include_in_schema=False)


@cache
def asset(name: str) -> bytes:
    """One of the page's files, read from the package once."""
    return resources.files("gateway").joinpath("static", name).read_bytes()


def _serve(name: str) -> Response:
    return Response(asset(name), media_type=ASSETS[name], headers=HEADERS)


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse(PAGE, status_code=307)


@router.get("/favicon.ico")
async def favicon() -> Response:
    return Response(status_code=204)  # no icon, and no 404 in the browser's console


@router.get(PAGE)
async def playground() -> Response:
    return _serve("playground.html")


@router.get(PAGE + "/playground.js")
async def script() -> Response:
    return _serve("playground.js")


@router.get(PAGE + "/playground.css")
async def style() -> Response:
    return _serve("playground.css")
