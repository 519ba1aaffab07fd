"""Typed hyperparameters of CosyVoice2's flow and HiFT, read from ``cosyvoice2.yaml``.

The model directory's ``cosyvoice2.yaml`` is HyperPyYAML (:mod:`.hyperpyyaml` parses it without
running it). Only the ``flow`` and ``hift`` sections and the top-level constants they refer to are
read; the LLM is loaded from its own Hugging Face directory and the training sections are
irrelevant here.

Reading is strict: inside the sections that are read, a missing hyperparameter, an unknown key, a
class other than CosyVoice2's, or a setting this implementation does not support is a
:class:`ConfigError` naming the key, so a CosyVoice3 file or a typo fails at start-up instead of
loading weights into the wrong architecture.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from tts_gateway.models.cosyvoice2.model.hyperpyyaml import HyperPyYAMLError, Tagged, parse_hyperpyyaml

FLOW_CLASS = "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"
ENCODER_CLASS = "cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder"
CFM_CLASS = "cosyvoice.flow.flow_matching.CausalConditionalCFM"
CFM_PARAMS_CLASS = "omegaconf.DictConfig"
ESTIMATOR_CLASS = "cosyvoice.flow.decoder.CausalConditionalDecoder"
HIFT_CLASS = "cosyvoice.hifigan.generator.HiFTGenerator"
F0_PREDICTOR_CLASS = "cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor"


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
    except (ConfigError, HyperPyYAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
