"""The Kubernetes manifests in deploy/ are valid against the API's own schemas (kubernetes-validate, offline)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted(DEPLOY.rglob("*.yaml"))
# The oldest Kubernetes release still commonly run, and the newest the validator knows.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def _resources() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{path.relative_to(DEPLOY)}:{doc['kind']}/{doc['metadata']['name']}", doc)
        for path in MANIFESTS
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


RESOURCES = _resources()


def _find(kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(doc for _, doc in RESOURCES if doc["kind"] == kind))


def test_the_deployment_has_what_the_issue_asks_for() -> None:
    kinds = sorted(doc["kind"] for _, doc in RESOURCES)
    assert kinds == sorted(
        [
            "Service",
            "StatefulSet",
            "PodDisruptionBudget",
            "Service",
            "Deployment",
            "PersistentVolumeClaim",
            "HorizontalPodAutoscaler",
            "PodDisruptionBudget",
        ]
    )
    triton_service = next(
        doc for _, doc in RESOURCES if doc["kind"] == "Service" and doc["metadata"]["name"] == "triton"
    )
    assert triton_service["spec"]["clusterIP"] == "None", "headless: one address per Triton pod"
    env = {e["name"]: e for e in _find("Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TTS_TRITON_URL"]["value"] == "triton:8001"
    assert env["TTS_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "tts-gateway-api-keys"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "resource"), RESOURCES, ids=[name for name, _ in RESOURCES])
def test_manifest_is_valid(name: str, resource: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(resource, version, strict=True)


@pytest.mark.parametrize(
    ("kind", "breakage"),
    [
        ("Deployment", lambda d: d["spec"].pop("selector")),
        ("StatefulSet", lambda d: d["spec"].update(replicas="one")),
        ("HorizontalPodAutoscaler", lambda d: d["spec"]["metrics"][0]["resource"].update(targett={})),
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"].update(port=8080)),
    ],
)
def test_a_broken_manifest_is_refused(kind: str, breakage: Any) -> None:
    resource = _find(kind)
    breakage(resource)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(resource, VERSIONS[-1], strict=True)
