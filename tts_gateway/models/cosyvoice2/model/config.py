"""Typed hyperparameters of CosyVoice2's flow and HiFT, read from and written to ``cosyvoice2.yaml``.

The model directory's ``cosyvoice2.yaml`` is HyperPyYAML: plain YAML plus the tags ``!new:a.b.C``
(instantiate), ``!name:a.b.f`` (partial function), ``!apply:a.b.f`` (call at load time) and
``!ref <key>`` (reference, possibly inside arithmetic such as ``<chunk_size> * <token_mel_ratio>``).
This module parses those tags generically with PyYAML into inert :class:`Tagged` nodes, resolves the
references, and never imports or calls anything the file names. Only the ``flow`` and ``hift``
sections and the top-level constants they refer to are read; the LLM is loaded from its own
Hugging Face directory and the training sections are irrelevant here.

Reading is strict: inside the sections that are read, a missing hyperparameter, an unknown key, a
class other than CosyVoice2's, or a setting this implementation does not support is a
:class:`ConfigError` naming the key, so a CosyVoice3 file or a typo fails at start-up instead of
loading weights into the wrong architecture.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

FLOW_CLASS = "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"
ENCODER_CLASS = "cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder"
CFM_CLASS = "cosyvoice.flow.flow_matching.CausalConditionalCFM"
CFM_PARAMS_CLASS = "omegaconf.DictConfig"
ESTIMATOR_CLASS = "cosyvoice.flow.decoder.CausalConditionalDecoder"
HIFT_CLASS = "cosyvoice.hifigan.generator.HiFTGenerator"
F0_PREDICTOR_CLASS = "cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor"

_SEED = 1986
_SEED_FUNCTIONS = ("random.seed", "numpy.random.seed", "torch.manual_seed", "torch.cuda.manual_seed_all")


class ConfigError(ValueError):
    """``cosyvoice2.yaml`` is malformed, incomplete, or describes a model this code cannot run."""


@dataclass(frozen=True)
class EncoderConfig:
    """``flow.encoder``: the UpsampleConformerEncoder (relative-position conformer, look-ahead, x2 upsample)."""

    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    static_chunk_size: int
    """Attention chunk in tokens when streaming (0: full context)."""


@dataclass(frozen=True)
class EstimatorConfig:
    """``flow.decoder.estimator``: the CausalConditionalDecoder 1-D U-Net."""

    in_channels: int
    out_channels: int
    channels: tuple[int, ...]
    attention_head_dim: int
    n_blocks: int
    num_mid_blocks: int
    num_heads: int
    act_fn: Literal["gelu"]
    static_chunk_size: int
    """Attention chunk in mel frames when streaming (0: full context)."""
    num_decoding_left_chunks: int


@dataclass(frozen=True)
class DecoderConfig:
    """``flow.decoder``: the CausalConditionalCFM (conditional flow matching) around the estimator."""

    in_channels: int
    n_spks: int
    spk_emb_dim: int
    sigma_min: float
    solver: Literal["euler"]
    t_scheduler: Literal["cosine", "linear"]
    inference_cfg_rate: float
    estimator: EstimatorConfig


@dataclass(frozen=True)
class FlowConfig:
    """``flow``: CausalMaskedDiffWithXvec, speech tokens + speaker embedding -> 80-bin mel."""

    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    input_frame_rate: int
    token_mel_ratio: int
    pre_lookahead_len: int
    encoder: EncoderConfig
    decoder: DecoderConfig


@dataclass(frozen=True)
class HiftConfig:
    """``hift``: the HiFTGenerator vocoder (neural source filter + iSTFT) with its ConvRNN F0 predictor."""

    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    f0_num_class: int
    f0_in_channels: int
    f0_cond_channels: int


@dataclass(frozen=True)
class CosyVoice2Config:
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    flow: FlowConfig
    hift: HiftConfig


# --- HyperPyYAML syntax --------------------------------------------------------------------------


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
            raise ConfigError(f"!ref <{name}> is empty or circular")
        self._active.add(name)
        try:
            node: Any = self._root
            for part in parts:
                if isinstance(node, Tagged):
                    node = node.args
                if not isinstance(node, dict) or part not in node:
                    raise ConfigError(f"!ref <{name}> names a key the file does not define")
                node = node[part]
            return self.resolve(node)
        finally:
            self._active.discard(name)

    def _expression(self, expr: str) -> Any:
        names = _REF_PATTERN.findall(expr)
        if not names:
            raise ConfigError(f"!ref {expr!r} contains no <reference>")
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
        raise ConfigError(f"not valid HyperPyYAML: {exc}") from exc
    if not isinstance(document, dict):
        raise ConfigError("the top level of cosyvoice2.yaml must be a mapping")
    resolved = _Resolver(document).resolve(document)
    assert isinstance(resolved, dict)
    return resolved


# --- reading the sections ------------------------------------------------------------------------

_T = TypeVar("_T")
_REQUIRED = object()


class _Section:
    """Typed, strict access to the arguments of one ``!new:`` node."""

    def __init__(self, path: str, node: Any, expected_class: str) -> None:
        if not isinstance(node, Tagged) or node.kind != "new":
            raise ConfigError(f"{path} must be `!new:{expected_class}`, found {node!r}")
        if node.target != expected_class:
            raise ConfigError(f"{path} is `{node.target}`; this implementation runs `{expected_class}` (CosyVoice2)")
        if node.args is None:
            node = Tagged(node.kind, node.target, {})
        if not isinstance(node.args, dict):
            raise ConfigError(f"{path} must have keyword arguments")
        self.path = path
        self._args: dict[str, Any] = node.args
        self._seen: set[str] = set()

    def _get(self, key: str, kind: type[_T], default: Any) -> _T:
        self._seen.add(key)
        if key not in self._args:
            if default is _REQUIRED:
                raise ConfigError(f"{self.path}.{key} is missing")
            return default  # type: ignore[no-any-return]
        value = self._args[key]
        if kind is float and type(value) is int:
            value = float(value)
        if type(value) is not kind:
            raise ConfigError(f"{self.path}.{key} must be {kind.__name__}, found {value!r}")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        return self._get(key, int, _REQUIRED if default is None else default)

    def number(self, key: str) -> float:
        return self._get(key, float, _REQUIRED)

    def text(self, key: str) -> str:
        return self._get(key, str, _REQUIRED)

    def ints(self, key: str) -> tuple[int, ...]:
        values = self._get(key, list, _REQUIRED)
        if not values or any(type(v) is not int for v in values):
            raise ConfigError(f"{self.path}.{key} must be a non-empty list of ints, found {values!r}")
        return tuple(values)

    def int_lists(self, key: str) -> tuple[tuple[int, ...], ...]:
        values = self._get(key, list, _REQUIRED)
        if not values or any(not isinstance(v, list) or not v or any(type(i) is not int for i in v) for v in values):
            raise ConfigError(f"{self.path}.{key} must be a list of lists of ints, found {values!r}")
        return tuple(tuple(v) for v in values)

    def choice(self, key: str, allowed: tuple[str, ...]) -> str:
        value = self.text(key)
        if value not in allowed:
            raise ConfigError(f"{self.path}.{key} = {value!r} is not supported (supported: {allowed})")
        return value

    def expect(self, key: str, supported: object, upstream_default: object) -> None:
        """A setting only one value of which is implemented; absent means upstream's default."""
        self._seen.add(key)
        value = self._args.get(key, upstream_default)
        if value != supported or type(value) is not type(supported):
            raise ConfigError(f"{self.path}.{key} = {value!r} is not supported (CosyVoice2 uses {supported!r})")

    def node(self, key: str) -> Any:
        self._seen.add(key)
        if key not in self._args:
            raise ConfigError(f"{self.path}.{key} is missing")
        return self._args[key]

    def training_only(self, *keys: str) -> None:
        """Keys that only matter for training: accepted and not read."""
        self._seen.update(keys)

    def finish(self) -> None:
        unknown = sorted(set(self._args) - self._seen)
        if unknown:
            raise ConfigError(f"{self.path} has keys this implementation does not know: {unknown}")


def _top_int(document: Mapping[str, Any], key: str) -> int:
    value = document.get(key)
    if type(value) is not int:
        raise ConfigError(f"top-level `{key}` must be an int, found {value!r}")
    return value


def _same(path: str, value: int, top_key: str, top_value: int) -> None:
    if value != top_value:
        raise ConfigError(f"{path} = {value} disagrees with top-level {top_key} = {top_value}")


def _read_encoder(node: Any) -> EncoderConfig:
    s = _Section("flow.encoder", node, ENCODER_CLASS)
    config = EncoderConfig(
        input_size=s.integer("input_size"),
        output_size=s.integer("output_size"),
        attention_heads=s.integer("attention_heads"),
        linear_units=s.integer("linear_units"),
        num_blocks=s.integer("num_blocks"),
        static_chunk_size=s.integer("static_chunk_size", default=0),
    )
    s.expect("input_layer", "linear", "conv2d")
    s.expect("pos_enc_layer_type", "rel_pos_espnet", "rel_pos")
    s.expect("selfattention_layer_type", "rel_selfattn", "rel_selfattn")
    s.expect("normalize_before", True, True)
    s.expect("use_cnn_module", False, True)
    s.expect("macaron_style", False, True)
    s.expect("activation_type", "swish", "swish")
    s.expect("key_bias", True, True)
    s.expect("global_cmvn", None, None)
    s.training_only(
        "dropout_rate",
        "positional_dropout_rate",
        "attention_dropout_rate",
        "use_dynamic_chunk",
        "use_dynamic_left_chunk",
        "gradient_checkpointing",
        "positionwise_conv_kernel_size",
        "cnn_module_kernel",
        "causal",
        "cnn_module_norm",
    )
    s.finish()
    if config.output_size % config.attention_heads:
        raise ConfigError("flow.encoder.output_size must be divisible by attention_heads")
    return config


def _read_estimator(node: Any) -> EstimatorConfig:
    s = _Section("flow.decoder.estimator", node, ESTIMATOR_CLASS)
    config = EstimatorConfig(
        in_channels=s.integer("in_channels"),
        out_channels=s.integer("out_channels"),
        channels=s.ints("channels"),
        attention_head_dim=s.integer("attention_head_dim"),
        n_blocks=s.integer("n_blocks"),
        num_mid_blocks=s.integer("num_mid_blocks"),
        num_heads=s.integer("num_heads"),
        act_fn="gelu",
        static_chunk_size=s.integer("static_chunk_size", default=50),
        num_decoding_left_chunks=s.integer("num_decoding_left_chunks", default=2),
    )
    s.expect("act_fn", "gelu", "snake")
    s.training_only("dropout")
    s.finish()
    return config


def _read_decoder(node: Any) -> DecoderConfig:
    s = _Section("flow.decoder", node, CFM_CLASS)
    params = _Section("flow.decoder.cfm_params", s.node("cfm_params"), CFM_PARAMS_CLASS)
    content = params.node("content")
    params.finish()
    p = _Section("flow.decoder.cfm_params.content", Tagged("new", CFM_PARAMS_CLASS, content), CFM_PARAMS_CLASS)
    config = DecoderConfig(
        in_channels=s.integer("in_channels"),
        n_spks=s.integer("n_spks"),
        spk_emb_dim=s.integer("spk_emb_dim"),
        sigma_min=p.number("sigma_min"),
        solver="euler",
        t_scheduler="cosine" if p.choice("t_scheduler", ("cosine", "linear")) == "cosine" else "linear",
        inference_cfg_rate=p.number("inference_cfg_rate"),
        estimator=_read_estimator(s.node("estimator")),
    )
    p.choice("solver", ("euler",))
    p.training_only("training_cfg_rate", "reg_loss_type")
    p.finish()
    s.finish()
    return config


def _read_flow(document: Mapping[str, Any]) -> FlowConfig:
    if "flow" not in document:
        raise ConfigError("cosyvoice2.yaml has no `flow` section")
    s = _Section("flow", document["flow"], FLOW_CLASS)
    config = FlowConfig(
        input_size=s.integer("input_size"),
        output_size=s.integer("output_size"),
        spk_embed_dim=s.integer("spk_embed_dim"),
        vocab_size=s.integer("vocab_size"),
        input_frame_rate=s.integer("input_frame_rate"),
        token_mel_ratio=s.integer("token_mel_ratio"),
        pre_lookahead_len=s.integer("pre_lookahead_len"),
        encoder=_read_encoder(s.node("encoder")),
        decoder=_read_decoder(s.node("decoder")),
    )
    s.expect("output_type", "mel", "mel")
    s.training_only("only_mask_loss", "decoder_conf", "mel_feat_conf")
    s.finish()
    _check_flow(config)
    return config


def _check_flow(flow: FlowConfig) -> None:
    """Cross-section shape agreements that upstream only discovers as a tensor shape error."""
    mel, estimator = flow.output_size, flow.decoder.estimator
    agreements = {
        "flow.encoder.input_size == flow.input_size": flow.encoder.input_size == flow.input_size,
        "flow.decoder.spk_emb_dim == flow.output_size": flow.decoder.spk_emb_dim == mel,
        "flow.decoder.n_spks == 1": flow.decoder.n_spks == 1,
        "estimator.in_channels == 4 * flow.output_size (x, mu, speaker, prompt)": estimator.in_channels == 4 * mel,
        "estimator.out_channels == flow.output_size": estimator.out_channels == mel,
        "flow.pre_lookahead_len >= 1": flow.pre_lookahead_len >= 1,
        "flow.token_mel_ratio >= 1": flow.token_mel_ratio >= 1,
    }
    broken = [name for name, holds in agreements.items() if not holds]
    if broken:
        raise ConfigError(f"inconsistent flow hyperparameters: {broken}")


def _read_hift(document: Mapping[str, Any]) -> HiftConfig:
    if "hift" not in document:
        raise ConfigError("cosyvoice2.yaml has no `hift` section")
    s = _Section("hift", document["hift"], HIFT_CLASS)
    istft = s.node("istft_params")
    if not isinstance(istft, dict) or set(istft) != {"n_fft", "hop_len"}:
        raise ConfigError(f"hift.istft_params must have exactly n_fft and hop_len, found {istft!r}")
    ist = _Section("hift.istft_params", Tagged("new", "istft_params", istft), "istft_params")
    f0 = _Section("hift.f0_predictor", s.node("f0_predictor"), F0_PREDICTOR_CLASS)
    config = HiftConfig(
        in_channels=s.integer("in_channels"),
        base_channels=s.integer("base_channels"),
        nb_harmonics=s.integer("nb_harmonics"),
        sampling_rate=s.integer("sampling_rate"),
        nsf_alpha=s.number("nsf_alpha"),
        nsf_sigma=s.number("nsf_sigma"),
        nsf_voiced_threshold=s.number("nsf_voiced_threshold"),
        upsample_rates=s.ints("upsample_rates"),
        upsample_kernel_sizes=s.ints("upsample_kernel_sizes"),
        istft_n_fft=ist.integer("n_fft"),
        istft_hop_len=ist.integer("hop_len"),
        resblock_kernel_sizes=s.ints("resblock_kernel_sizes"),
        resblock_dilation_sizes=s.int_lists("resblock_dilation_sizes"),
        source_resblock_kernel_sizes=s.ints("source_resblock_kernel_sizes"),
        source_resblock_dilation_sizes=s.int_lists("source_resblock_dilation_sizes"),
        lrelu_slope=s.number("lrelu_slope"),
        audio_limit=s.number("audio_limit"),
        f0_num_class=f0.integer("num_class"),
        f0_in_channels=f0.integer("in_channels"),
        f0_cond_channels=f0.integer("cond_channels"),
    )
    for section in (s, ist, f0):
        section.finish()
    if len(config.upsample_rates) != len(config.upsample_kernel_sizes):
        raise ConfigError("hift.upsample_rates and hift.upsample_kernel_sizes differ in length")
    if len(config.resblock_kernel_sizes) != len(config.resblock_dilation_sizes):
        raise ConfigError("hift.resblock_kernel_sizes and hift.resblock_dilation_sizes differ in length")
    if len(config.source_resblock_kernel_sizes) != len(config.source_resblock_dilation_sizes):
        raise ConfigError("hift.source_resblock_* sizes differ in length")
    return config


def config_from_document(document: Mapping[str, Any]) -> CosyVoice2Config:
    """Build the typed config from a parsed (reference-resolved) HyperPyYAML document."""
    config = CosyVoice2Config(
        sample_rate=_top_int(document, "sample_rate"),
        token_frame_rate=_top_int(document, "token_frame_rate"),
        token_mel_ratio=_top_int(document, "token_mel_ratio"),
        flow=_read_flow(document),
        hift=_read_hift(document),
    )
    _same("flow.input_frame_rate", config.flow.input_frame_rate, "token_frame_rate", config.token_frame_rate)
    _same("flow.token_mel_ratio", config.flow.token_mel_ratio, "token_mel_ratio", config.token_mel_ratio)
    _same("hift.sampling_rate", config.hift.sampling_rate, "sample_rate", config.sample_rate)
    if "spk_embed_dim" in document:
        _same("flow.spk_embed_dim", config.flow.spk_embed_dim, "spk_embed_dim", _top_int(document, "spk_embed_dim"))
    _same("hift.in_channels", config.hift.in_channels, "flow.output_size", config.flow.output_size)
    samples_per_frame = math.prod(config.hift.upsample_rates) * config.hift.istft_hop_len
    mel_rate = config.token_frame_rate * config.token_mel_ratio
    if samples_per_frame * mel_rate != config.sample_rate:
        raise ConfigError(
            f"hift produces {samples_per_frame} samples per mel frame, but {mel_rate} mel frames/s at "
            f"{config.sample_rate} Hz need {config.sample_rate / mel_rate:g}"
        )
    return config


def load_config(path: Path) -> CosyVoice2Config:
    """Read a model directory's ``cosyvoice2.yaml`` (the official file or one from :func:`write_config`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    try:
        return config_from_document(parse_hyperpyyaml(text))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


# --- writing -------------------------------------------------------------------------------------


def _chunk_ref(value: int, document: Mapping[str, Any], expr: str) -> int | Ref:
    """Write ``value`` as the reference the official file uses when the reference yields it."""
    return Ref(expr) if _Resolver(dict(document)).resolve(Ref(expr)) == value else value


def config_to_document(cfg: CosyVoice2Config) -> dict[str, Any]:
    """The HyperPyYAML tree of ``cfg``, laid out like the official ``cosyvoice2.yaml``.

    Only the sections this package reads are written (seeds, constants, ``flow``, ``hift``); the
    training-only arguments carry the official file's values.
    """
    flow, enc, dec = cfg.flow, cfg.flow.encoder, cfg.flow.decoder
    est = dec.estimator
    hift = cfg.hift
    document: dict[str, Any] = {
        f"__set_seed{i}": Tagged("apply", fn, [_SEED]) for i, fn in enumerate(_SEED_FUNCTIONS, start=1)
    }
    document |= {
        "sample_rate": cfg.sample_rate,
        "spk_embed_dim": flow.spk_embed_dim,
        "token_frame_rate": cfg.token_frame_rate,
        "token_mel_ratio": cfg.token_mel_ratio,
        "chunk_size": enc.static_chunk_size,
        "num_decoding_left_chunks": est.num_decoding_left_chunks,
    }
    encoder = {
        "output_size": enc.output_size,
        "attention_heads": enc.attention_heads,
        "linear_units": enc.linear_units,
        "num_blocks": enc.num_blocks,
        "dropout_rate": 0.1,
        "positional_dropout_rate": 0.1,
        "attention_dropout_rate": 0.1,
        "normalize_before": True,
        "input_layer": "linear",
        "pos_enc_layer_type": "rel_pos_espnet",
        "selfattention_layer_type": "rel_selfattn",
        "input_size": enc.input_size,
        "use_cnn_module": False,
        "macaron_style": False,
        "static_chunk_size": Ref("<chunk_size>"),
    }
    estimator = {
        "in_channels": est.in_channels,
        "out_channels": est.out_channels,
        "channels": list(est.channels),
        "dropout": 0.0,
        "attention_head_dim": est.attention_head_dim,
        "n_blocks": est.n_blocks,
        "num_mid_blocks": est.num_mid_blocks,
        "num_heads": est.num_heads,
        "act_fn": est.act_fn,
        "static_chunk_size": _chunk_ref(est.static_chunk_size, document, "<chunk_size> * <token_mel_ratio>"),
        "num_decoding_left_chunks": Ref("<num_decoding_left_chunks>"),
    }
    cfm_params = {
        "sigma_min": dec.sigma_min,
        "solver": dec.solver,
        "t_scheduler": dec.t_scheduler,
        "training_cfg_rate": 0.2,
        "inference_cfg_rate": dec.inference_cfg_rate,
        "reg_loss_type": "l1",
    }
    decoder = {
        "in_channels": dec.in_channels,
        "n_spks": dec.n_spks,
        "spk_emb_dim": dec.spk_emb_dim,
        "cfm_params": Tagged("new", CFM_PARAMS_CLASS, {"content": cfm_params}),
        "estimator": Tagged("new", ESTIMATOR_CLASS, estimator),
    }
    document["flow"] = Tagged(
        "new",
        FLOW_CLASS,
        {
            "input_size": flow.input_size,
            "output_size": flow.output_size,
            "spk_embed_dim": Ref("<spk_embed_dim>"),
            "output_type": "mel",
            "vocab_size": flow.vocab_size,
            "input_frame_rate": Ref("<token_frame_rate>"),
            "only_mask_loss": True,
            "token_mel_ratio": Ref("<token_mel_ratio>"),
            "pre_lookahead_len": flow.pre_lookahead_len,
            "encoder": Tagged("new", ENCODER_CLASS, encoder),
            "decoder": Tagged("new", CFM_CLASS, decoder),
        },
    )
    document["hift"] = Tagged(
        "new",
        HIFT_CLASS,
        {
            "in_channels": hift.in_channels,
            "base_channels": hift.base_channels,
            "nb_harmonics": hift.nb_harmonics,
            "sampling_rate": Ref("<sample_rate>"),
            "nsf_alpha": hift.nsf_alpha,
            "nsf_sigma": hift.nsf_sigma,
            "nsf_voiced_threshold": hift.nsf_voiced_threshold,
            "upsample_rates": list(hift.upsample_rates),
            "upsample_kernel_sizes": list(hift.upsample_kernel_sizes),
            "istft_params": {"n_fft": hift.istft_n_fft, "hop_len": hift.istft_hop_len},
            "resblock_kernel_sizes": list(hift.resblock_kernel_sizes),
            "resblock_dilation_sizes": [list(d) for d in hift.resblock_dilation_sizes],
            "source_resblock_kernel_sizes": list(hift.source_resblock_kernel_sizes),
            "source_resblock_dilation_sizes": [list(d) for d in hift.source_resblock_dilation_sizes],
            "lrelu_slope": hift.lrelu_slope,
            "audio_limit": hift.audio_limit,
            "f0_predictor": Tagged(
                "new",
                F0_PREDICTOR_CLASS,
                {
                    "num_class": hift.f0_num_class,
                    "in_channels": hift.f0_in_channels,
                    "cond_channels": hift.f0_cond_channels,
                },
            ),
        },
    )
    return document


def write_config(cfg: CosyVoice2Config, path: Path) -> None:
    """Write ``cfg`` as HyperPyYAML in the official file's structure, tags and references."""
    text = yaml.dump(config_to_document(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    path.write_text(text, encoding="utf-8")


# --- presets -------------------------------------------------------------------------------------


def tiny_config() -> CosyVoice2Config:
    """Small random-weight model with the real interfaces: 80 mel bins, 6561 tokens, 192-d speaker
    embedding, 24 kHz, 25 tokens/s, 2 mel frames per token, 3-token look-ahead."""
    mel = 80
    return CosyVoice2Config(
        sample_rate=24000,
        token_frame_rate=25,
        token_mel_ratio=2,
        flow=FlowConfig(
            input_size=32,
            output_size=mel,
            spk_embed_dim=192,
            vocab_size=6561,
            input_frame_rate=25,
            token_mel_ratio=2,
            pre_lookahead_len=3,
            encoder=EncoderConfig(
                input_size=32,
                output_size=32,
                attention_heads=2,
                linear_units=64,
                num_blocks=1,
                static_chunk_size=25,
            ),
            decoder=DecoderConfig(
                in_channels=240,
                n_spks=1,
                spk_emb_dim=mel,
                sigma_min=1e-06,
                solver="euler",
                t_scheduler="cosine",
                inference_cfg_rate=0.7,
                estimator=EstimatorConfig(
                    in_channels=4 * mel,
                    out_channels=mel,
                    channels=(32,),
                    attention_head_dim=16,
                    n_blocks=1,
                    num_mid_blocks=1,
                    num_heads=2,
                    act_fn="gelu",
                    static_chunk_size=50,
                    num_decoding_left_chunks=-1,
                ),
            ),
        ),
        hift=HiftConfig(
            in_channels=mel,
            base_channels=32,
            nb_harmonics=8,
            sampling_rate=24000,
            nsf_alpha=0.1,
            nsf_sigma=0.003,
            nsf_voiced_threshold=10.0,
            upsample_rates=(8, 5, 3),
            upsample_kernel_sizes=(16, 11, 7),
            istft_n_fft=16,
            istft_hop_len=4,
            resblock_kernel_sizes=(3, 7, 11),
            resblock_dilation_sizes=((1, 3, 5), (1, 3, 5), (1, 3, 5)),
            source_resblock_kernel_sizes=(7, 7, 11),
            source_resblock_dilation_sizes=((1, 3, 5), (1, 3, 5), (1, 3, 5)),
            lrelu_slope=0.1,
            audio_limit=0.99,
            f0_num_class=1,
            f0_in_channels=mel,
            f0_cond_channels=32,
        ),
    )
