"""API-key middleware: every path but the public ones needs one of the keys, answered in OpenAI's shape."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from tts_gateway.gateway.api.auth import ApiKeyMiddleware
from tts_gateway.gateway.api.error_handlers import install_error_handlers

KEYS = ("key-one", "key-two")
MISSING = "missing API key; send it as 'Authorization: Bearer <key>' or 'xi-api-key: <key>'"


def _client(public: tuple[str, ...] = ("/health",)) -> tuple[httpx.AsyncClient, list[str]]:
    api = FastAPI()
    install_error_handlers(api)
    ran: list[str] = []

    @api.get("/health")
    async def health() -> dict[str, str]:
        ran.append("health")
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics() -> dict[str, str]:
        ran.append("metrics")
        return {}

    @api.post("/v1/audio/speech")
    async def speech() -> dict[str, str]:
        ran.append("speech")
        return {}

    api.add_middleware(ApiKeyMiddleware, keys=KEYS, public_paths=public)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://gateway"), ran


def _assert_401(response: httpx.Response, message: str) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    }


@pytest.mark.parametrize("authorization", ["Bearer key-one", "Bearer key-two", "bearer key-two", "Bearer  key-one "])
async def test_any_configured_key_is_accepted(authorization: str) -> None:
    client, ran = _client()
    async with client:
        response = await client.post("/v1/audio/speech", headers={"Authorization": authorization})
    assert response.status_code == 200
    assert ran == ["speech"]


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer ", "Basic a2V5LW9uZQ==", "key-one"])
async def test_a_missing_key_is_a_401(authorization: str | None) -> None:
    client, ran = _client()
    headers = {} if authorization is None else {"Authorization": authorization}
    async with client:
        response = await client.post("/v1/audio/speech", headers=headers, content=b'{"input": "hi"}')
    _assert_401(response, MISSING)
    assert ran == []


@pytest.mark.parametrize(("key", "accepted"), [("key-one", True), ("key-two", True), ("key-three", False), ("", False)])
async def test_elevenlabs_clients_send_the_key_as_xi_api_key(key: str, accepted: bool) -> None:
    client, ran = _client()
    async with client:
        response = await client.post("/v1/audio/speech", headers={"xi-api-key": key})
    if accepted:
        assert response.status_code == 200
        assert ran == ["speech"]
    else:
        _assert_401(response, "incorrect API key provided" if key else MISSING)
        assert ran == []


async def test_elevenlabs_paths_refuse_in_elevenlabs_envelope() -> None:
    client, ran = _client()
    async with client:
        response = await client.get("/v1/voices", headers={"xi-api-key": "key-three"})
    assert response.status_code == 401
    assert response.json() == {"detail": {"status": "invalid_api_key", "message": "incorrect API key provided"}}
    assert ran == []


@pytest.mark.parametrize("key", ["key-three", "key-on", "key-one2", "KEY-ONE", "key-one,key-two"])
async def test_a_wrong_key_is_a_401(key: str) -> None:
    client, ran = _client()
    async with client:
        response = await client.post("/v1/audio/speech", headers={"Authorization": f"Bearer {key}"})
    _assert_401(response, "incorrect API key provided")
    assert ran == []


async def test_only_the_public_paths_are_open() -> None:
    client, ran = _client()
    async with client:
        health = await client.get("/health")
        metrics = await client.get("/metrics")
        docs = await client.get("/docs")
        unknown = await client.get("/v1/nothing-here")
        unknown_with_key = await client.get("/v1/nothing-here", headers={"Authorization": "Bearer key-one"})
    assert health.status_code == 200
    for response in (metrics, docs, unknown):
        _assert_401(response, MISSING)
    # Only a caller with a key learns which paths exist.
    assert unknown_with_key.status_code == 404
    assert ran == ["health"]


async def test_public_paths_are_configurable() -> None:
    client, ran = _client(public=("/health", "/metrics"))
    async with client:
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/health/")).status_code == 401  # exact paths only
    assert ran == ["metrics", "health"]


def test_it_refuses_to_run_without_keys() -> None:
    with pytest.raises(ValueError, match="at least one key"):
        ApiKeyMiddleware(FastAPI(), keys=[], public_paths=[])
