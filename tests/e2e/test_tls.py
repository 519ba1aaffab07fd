"""TLS by uvicorn's own mechanism: ``tts-gateway serve --ssl-certfile/--ssl-keyfile`` serves https and wss,
so clients that force ``wss://`` (the ElevenLabs SDK's ``convert_realtime``) connect. The certificate is
self-signed, made here, and trusted by the clients alone."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from elevenlabs.client import ElevenLabs
from openai import OpenAI

from tests.audio_checks import assert_speech, decode, decode_elevenlabs
from tests.e2e.gateway_process import GatewayProcess
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

TEXT = "The quick brown fox jumps over the lazy dog."


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tts-gateway test")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def trust(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certificate[0]))


@pytest.fixture(scope="module")
def tls_gateway(
    cpu_triton: EmbeddedTriton,
    certificate: tuple[Path, Path],
    trust: ssl.SSLContext,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("tls_gateway")
    cert, key = certificate
    process = GatewayProcess(
        root / "gateway.log",
        {"TTS_TRITON_URL": cpu_triton.grpc_url, "TTS_VOICES_DIR": str(root / "voices")},
        ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)],
        tls=trust,
    )
    process.start()
    yield process
    process.stop()


def test_openai_and_elevenlabs_rest_over_https(
    tls_gateway: GatewayProcess, trust: ssl.SSLContext, piper_seconds: Callable[..., float]
) -> None:
    assert tls_gateway.url.startswith("https://")
    openai = OpenAI(base_url=f"{tls_gateway.url}/v1", api_key="unused", http_client=httpx.Client(verify=trust))
    speech = openai.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav")
    assert_speech(decode(speech.content, "wav"), expected_seconds=piper_seconds(TEXT))
    elevenlabs = ElevenLabs(base_url=tls_gateway.url, api_key="unused", httpx_client=httpx.Client(verify=trust))
    audio = decode_elevenlabs(b"".join(elevenlabs.text_to_speech.convert("joe", text=TEXT)), "mp3_44100_128")
    assert audio.sample_rate == 44100 and audio.rms > 0.01


def test_plain_http_is_not_served(tls_gateway: GatewayProcess) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(tls_gateway.url.replace("https://", "http://") + "/health", timeout=5).raise_for_status()


def test_sdk_convert_realtime_speaks_over_wss(
    tls_gateway: GatewayProcess,
    certificate: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    piper_seconds: Callable[..., float],
) -> None:
    # The SDK builds its wss:// URL and TLS context itself; OpenSSL's default trust store then reads this.
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
    client = ElevenLabs(base_url=tls_gateway.url, api_key="unused")
    words = (f"{word} " for word in TEXT.split())
    data = b"".join(client.text_to_speech.convert_realtime("joe", text=words, model_id="eleven_flash_v2_5"))
    audio = decode_elevenlabs(data, "mp3_44100_128")
    assert audio.sample_rate == 44100
    assert audio.rms > 0.01
    assert piper_seconds(TEXT) * 0.8 <= audio.duration <= piper_seconds(TEXT) * 1.3 + 0.3, audio.duration
