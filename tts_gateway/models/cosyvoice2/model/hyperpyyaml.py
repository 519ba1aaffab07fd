"""HyperPyYAML, the format of CosyVoice2's ``cosyvoice2.yaml``, read and written without running it.

HyperPyYAML is plain YAML plus the tags ``!new:a.b.C`` (instantiate), ``!name:a.b.f`` (partial
function), ``!apply:a.b.f`` (call at load time) and ``!ref <key>`` (reference, possibly inside
arithmetic such as ``<chunk_size> * <token_mel_ratio>``). This module parses those tags generically
with PyYAML into inert :class:`Tagged` nodes, resolves the references, and never imports or calls
anything the file names; it writes such a tree back with the same tags.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import yaml


class HyperPyYAMLError(ValueError):
    """The text is not valid HyperPyYAML, or one of its references cannot be resolved."""


@dataclass(frozen=True)
class Tagged:
    """A ``!new:``/``!name:``/``!apply:`` node: the tag kind, the dotted target and its arguments."""

    kind: Literal["new", "name", "apply"]
    target: str
    args: Any


@dataclass(frozen=True)
class Ref:
    """A ``!ref`` expression such as ``<sample_rate>`` or ``<chunk_size> * <token_mel_ratio>``."""

    expr: str


class _Loader(yaml.SafeLoader):
    """SafeLoader that keeps HyperPyYAML tags as inert nodes and reads floats the YAML 1.2 way.

    HyperPyYAML uses a YAML 1.2 parser, so ``1e-06`` is a float there; PyYAML's YAML 1.1 resolver
    would read it as a string.
    """


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _construct_args(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    value = loader.construct_scalar(node)
    return value if value != "" else None


def _tag_constructor(kind: Literal["new", "name", "apply"]) -> Callable[[yaml.SafeLoader, str, yaml.Node], Tagged]:
    def construct(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Tagged:
        return Tagged(kind, suffix, _construct_args(loader, node))

    return construct


def _ref_constructor(loader: yaml.SafeLoader, node: yaml.Node) -> Ref:
    return Ref(str(loader.construct_scalar(node)))


for _kind in ("new", "name", "apply"):
    _Loader.add_multi_constructor(f"!{_kind}:", _tag_constructor(_kind))
_Loader.add_constructor("!ref", _ref_constructor)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes :class:`Tagged`/:class:`Ref` back as tags, references unquoted."""

    def choose_scalar_style(self) -> str:
        event = self.event
        if isinstance(event, yaml.ScalarEvent) and event.tag == "!ref" and not event.style:
            if self.analysis is None:
                self.analysis = self.analyze_scalar(event.value)
            if self.analysis.allow_block_plain and not self.flow_level:
                return ""
        return str(super().choose_scalar_style())


def _represent_tagged(dumper: yaml.SafeDumper, node: Tagged) -> yaml.Node:
    tag = f"!{node.kind}:{node.target}"
    if isinstance(node.args, dict):
        return dumper.represent_mapping(tag, node.args)
    if isinstance(node.args, list):
        return dumper.represent_sequence(tag, node.args, flow_style=True)
    return dumper.represent_scalar(tag, "" if node.args is None else str(node.args))


def _represent_ref(dumper: yaml.SafeDumper, node: Ref) -> yaml.Node:
    return dumper.represent_scalar("!ref", node.expr)


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


_Dumper.add_representer(Tagged, _represent_tagged)
_Dumper.add_representer(Ref, _represent_ref)
_Dumper.add_representer(list, _represent_list)

_REF_PATTERN = re.compile(r"<([^<>]+)>")
_ARITHMETIC: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate_arithmetic(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate_arithmetic(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and type(node.value) is not bool:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](  # type: ignore[no-any-return]
            _evaluate_arithmetic(node.left), _evaluate_arithmetic(node.right)
        )
    if isinstance(node, ast.UnaryOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](_evaluate_arithmetic(node.operand))  # type: ignore[no-any-return]
    raise ValueError("not arithmetic")


class _Resolver:
    """Replaces every :class:`Ref` in the document by the value it names, following chains."""

    def __init__(self, root: dict[str, Any]) -> None:
        self._root = root
        self._active: set[str] = set()

    def resolve(self, value: Any) -> Any:
        if isinstance(value, Ref):
            return self._expression(value.expr)
        if isinstance(value, Tagged):
            return Tagged(value.kind, value.target, self.resolve(value.args))
        if isinstance(value, dict):
            return {key: self.resolve(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.resolve(item) for item in value]
        return value

    def _lookup(self, name: str) -> Any:
        """``key`` or ``key[sub][subsub]``, as HyperPyYAML spells nested references."""
        parts = re.findall(r"[^\[\]]+", name.strip())
        if not parts or name in self._active:
            raise HyperPyYAMLError(f"!ref <{name}> is empty or circular")
        self._active.add(name)
        try:
            node: Any = self._root
            for part in parts:
                if isinstance(node, Tagged):
                    node = node.args
                if not isinstance(node, dict) or part not in node:
                    raise HyperPyYAMLError(f"!ref <{name}> names a key the file does not define")
                node = node[part]
            return self.resolve(node)
        finally:
            self._active.discard(name)

    def _expression(self, expr: str) -> Any:
        names = _REF_PATTERN.findall(expr)
        if not names:
            raise HyperPyYAMLError(f"!ref {expr!r} contains no <reference>")
        whole = _REF_PATTERN.fullmatch(expr.strip())
        if whole is not None:
            return self._lookup(whole.group(1))
        values = {name: self._lookup(name) for name in names}
        text = _REF_PATTERN.sub(lambda m: repr(values[m.group(1)]), expr)
        try:
            return _evaluate_arithmetic(ast.parse(text, mode="eval"))
        except (SyntaxError, ValueError, ZeroDivisionError):
            # HyperPyYAML's rule: what is not arithmetic is string interpolation.
            return _REF_PATTERN.sub(lambda m: str(values[m.group(1)]), expr)


def parse_hyperpyyaml(text: str) -> dict[str, Any]:
    """Parse HyperPyYAML text into plain data and :class:`Tagged` nodes, with references resolved."""
    try:
        document = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise HyperPyYAMLError(f"not valid HyperPyYAML: {exc}") from exc
    if not isinstance(document, dict):
        raise HyperPyYAMLError("the top level of cosyvoice2.yaml must be a mapping")
    resolved = _Resolver(document).resolve(document)
    assert isinstance(resolved, dict)
    return resolved


def resolve_reference(document: dict[str, Any], expr: str) -> Any:
    """The value of the ``!ref`` expression ``expr`` within ``document``."""
    return _Resolver(document).resolve(Ref(expr))


def dump_hyperpyyaml(document: dict[str, Any]) -> str:
    """``document`` as HyperPyYAML text: :class:`Tagged` and :class:`Ref` nodes written back as tags."""
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
