"""The gateway's subpackages import only downward (the rule ``tts_gateway/gateway/__init__.py`` states)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tts_gateway.gateway

GATEWAY = Path(tts_gateway.gateway.__file__).parent
PACKAGE = "tts_gateway.gateway"
# Layer of each part of the gateway; a module may import its own part or a part of a lower layer.
# ``triton`` and ``embedded`` share a layer and must not import each other.
LAYERS = {"root leaves": 0, "triton": 1, "embedded": 1, "speech": 2, "api": 3, "composition root": 4}
COMPOSITION_ROOT = {"app_factory", "cli"}


def part_of(module: str) -> str:
    """The part of the gateway that module ``tts_gateway.gateway.<...>`` belongs to."""
    first = module.removeprefix(PACKAGE).lstrip(".").split(".")[0]
    if first in ("", *COMPOSITION_ROOT):
        return "composition root"
    if (GATEWAY / first).is_dir():
        return first
    return "root leaves"


def module_name(path: Path) -> str:
    parts = path.relative_to(GATEWAY).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def gateway_imports(source: str, path: Path) -> set[str]:
    """Every ``tts_gateway.gateway`` module that ``source``, the text of ``path``, imports, absolute or relative."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from tts_gateway.gateway.speech import plan`` names a module: judge by the module's part.
            names = [f"{base}.{alias.name}" if base == PACKAGE else base for alias in node.names]
        else:
            continue
        found.update(name for name in names if name == PACKAGE or name.startswith(PACKAGE + "."))
    return found


def is_upward(importer: str, imported: str) -> bool:
    """Whether module ``importer`` importing ``imported`` reaches into another part on its own layer or above."""
    own, other = part_of(importer), part_of(imported)
    return other != own and LAYERS[other] >= LAYERS[own]


def upward_imports() -> list[str]:
    violations = []
    for path in sorted(GATEWAY.rglob("*.py")):
        importer = module_name(path)
        for imported in sorted(gateway_imports(path.read_text(encoding="utf-8"), path)):
            if is_upward(importer, imported):
                violations.append(f"{importer} ({part_of(importer)}) imports {imported} ({part_of(imported)})")
    return violations


def test_every_part_imports_only_downward() -> None:
    assert upward_imports() == []


def test_every_subpackage_is_in_a_layer() -> None:
    subpackages = {path.name for path in GATEWAY.iterdir() if (path / "__init__.py").is_file()}
    assert subpackages <= set(LAYERS)


@pytest.mark.parametrize(
    ("importer", "source", "upward"),
    [
        ("speech/plan.py", "from tts_gateway.gateway.api.openai_schema import SpeechRequest\n", True),
        ("triton/pool.py", "import tts_gateway.gateway.embedded.server\n", True),
        ("settings.py", "from tts_gateway.gateway import speech\n", True),
        ("api/auth.py", "from tts_gateway.gateway.speech.plan import SpeechPlan\n", False),
        ("speech/text_stream/synthesis.py", "from ..plan import SpeechPlan\n", False),
        ("speech/text_stream/synthesis.py", "from ...api import auth\n", True),
    ],
)
def test_the_check_sees_an_upward_import(importer: str, source: str, upward: bool) -> None:
    """The reader of the graph resolves absolute, relative and ``from package import module`` forms."""
    path = GATEWAY / importer
    imported = gateway_imports(source, path)
    assert imported
    assert any(is_upward(module_name(path), name) for name in imported) is upward
