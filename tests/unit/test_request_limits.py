"""Body size limits: 413 before an over-long body is read, whether its length is declared or streamed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, UploadFile

from tts_gateway.gateway.api.error_handlers import install_error_handlers
from tts_gateway.gateway.api.request_limits import RequestBodyLimitMiddleware

LIMIT = 1000
UPLOAD_LIMIT = 5000


class Reads:
    """How much of a streamed request body was pulled from the client."""

    def __init__(self) -> None:
        self.bytes = 0

    async def body(self, total: int, piece: int = 100) -> AsyncIterator[bytes]:
        for _ in range(total // piece):
            self.bytes += piece
            yield b"x" * piece

    async def upload(self, total: int) -> AsyncIterator[bytes]:
        """A well-formed multipart upload of one ``total``-byte file."""
        yield b'--abc\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        async for piece in self.body(total):
            yield piece
        yield b"\r\n--abc--\r\n"


def _client() -> tuple[httpx.AsyncClient, list[str]]:
    """A FastAPI app behind the middleware, and the list of routes it actually ran."""
    api = FastAPI()
    install_error_handlers(api)
    ran: list[str] = []

    @api.post("/json")
    async def json_route(body: dict[str, Any]) -> dict[str, int]:
        ran.append("json")
        return {"keys": len(body)}

    @api.post("/upload")
    async def upload_route(file: UploadFile) -> dict[str, int]:
        ran.append("upload")
        return {"size": len(await file.read())}

    api.add_middleware(
        RequestBodyLimitMiddleware, default_limit=LIMIT, route_limits={("POST", "/upload"): UPLOAD_LIMIT}
    )
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://gateway"), ran


def _assert_413(response: httpx.Response, limit: int) -> None:
    assert response.status_code == 413, response.text
    assert response.json() == {
        "error": {
            "message": f"request body is larger than the limit of {limit} bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": "payload_too_large",
        }
    }


async def test_bodies_within_the_limit_pass() -> None:
    client, ran = _client()
    async with client:
        body = json.dumps({"a": "x" * (LIMIT - 20)}).encode()
        assert len(body) <= LIMIT
        response = await client.post("/json", content=body, headers={"content-type": "application/json"})
        upload = await client.post("/upload", files={"file": ("a.wav", b"y" * (UPLOAD_LIMIT - 500))})
    assert response.status_code == 200 and upload.status_code == 200
    assert ran == ["json", "upload"]


async def test_declared_length_over_the_limit_never_reaches_the_app() -> None:
    client, ran = _client()
    async with client:
        response = await client.post(
            "/json", content=b"{" + b" " * LIMIT + b"}", headers={"content-type": "application/json"}
        )
    _assert_413(response, LIMIT)
    assert ran == []


@pytest.mark.parametrize("total", [LIMIT + 100, 100 * LIMIT])
async def test_streamed_body_is_cut_off_once_over_the_limit(total: int) -> None:
    client, ran = _client()
    reads = Reads()
    async with client:
        response = await client.post("/json", content=reads.body(total), headers={"content-type": "application/json"})
    # FastAPI would call a broken body a 400; the client learns the real reason.
    _assert_413(response, LIMIT)
    assert ran == []
    assert reads.bytes <= LIMIT + 100


async def test_uploads_have_their_own_limit() -> None:
    client, ran = _client()
    reads = Reads()
    async with client:
        declared = await client.post("/upload", files={"file": ("a.wav", b"y" * UPLOAD_LIMIT)})
        streamed = await client.post(
            "/upload",
            content=reads.upload(20 * UPLOAD_LIMIT),
            headers={"content-type": "multipart/form-data; boundary=abc"},
        )
    _assert_413(declared, UPLOAD_LIMIT)
    _assert_413(streamed, UPLOAD_LIMIT)
    assert ran == []
    assert reads.bytes <= UPLOAD_LIMIT + 100
