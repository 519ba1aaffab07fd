"""cosyvoice2.yaml: HyperPyYAML parsing, strict reading into typed configs, writing the same format."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config, write_config
from tts_gateway.models.cosyvoice2.checkpoints.random_checkpoint import OFFICIAL_CONFIG_FILE
from tts_gateway.models.cosyvoice2.model.config import ConfigError, CosyVoice2Config, load_config
from tts_gateway.models.cosyvoice2.model.hyperpyyaml import Ref, Tagged, parse_hyperpyyaml

pytestmark = pytest.mark.cosyvoice

# The flow/hift part of the official CosyVoice2-0.5B cosyvoice2.yaml, with a sample of the other
# sections; the package keeps it as the full-size random checkpoint's hyper-parameters.
OFFICIAL_YAML = OFFICIAL_CONFIG_FILE.read_text(encoding="utf-8")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cosyvoice2.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def edited(old: str, new: str) -> str:
    assert OFFICIAL_YAML.count(old) == 1, old
    return OFFICIAL_YAML.replace(old, new)


def test_official_file_reads_every_flow_and_hift_hyperparameter(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, OFFICIAL_YAML))

    assert (cfg.sample_rate, cfg.token_frame_rate, cfg.token_mel_ratio) == (24000, 25, 2)
    flow = cfg.flow
    assert (flow.input_size, flow.output_size, flow.spk_embed_dim, flow.vocab_size) == (512, 80, 192, 6561)
    assert (flow.input_frame_rate, flow.token_mel_ratio, flow.pre_lookahead_len) == (25, 2, 3)
    enc = flow.encoder
    assert (enc.input_size, enc.output_size, enc.attention_heads, enc.linear_units) == (512, 512, 8, 2048)
    assert (enc.num_blocks, enc.static_chunk_size) == (6, 25)
    dec = flow.decoder
    assert (dec.in_channels, dec.n_spks, dec.spk_emb_dim) == (240, 1, 80)
    assert (dec.sigma_min, dec.solver, dec.t_scheduler, dec.inference_cfg_rate) == (1e-06, "euler", "cosine", 0.7)
    est = dec.estimator
    assert (est.in_channels, est.out_channels, est.channels) == (320, 80, (256,))
    assert (est.attention_head_dim, est.n_blocks, est.num_mid_blocks, est.num_heads) == (64, 4, 12, 8)
    assert (est.act_fn, est.static_chunk_size, est.num_decoding_left_chunks) == ("gelu", 50, -1)
    hift = cfg.hift
    assert (hift.in_channels, hift.base_channels, hift.nb_harmonics, hift.sampling_rate) == (80, 512, 8, 24000)
    assert (hift.nsf_alpha, hift.nsf_sigma, hift.nsf_voiced_threshold) == (0.1, 0.003, 10.0)
    assert (hift.upsample_rates, hift.upsample_kernel_sizes) == ((8, 5, 3), (16, 11, 7))
    assert (hift.istft_n_fft, hift.istft_hop_len) == (16, 4)
    assert hift.resblock_kernel_sizes == (3, 7, 11)
    assert hift.resblock_dilation_sizes == ((1, 3, 5),) * 3
    assert hift.source_resblock_kernel_sizes == (7, 7, 11)
    assert hift.source_resblock_dilation_sizes == ((1, 3, 5),) * 3
    assert (hift.lrelu_slope, hift.audio_limit) == (0.1, 0.99)
    assert (hift.f0_num_class, hift.f0_in_channels, hift.f0_cond_channels) == (1, 80, 512)


def test_earlier_official_layout_without_chunk_keys_gets_upstream_defaults(tmp_path: Path) -> None:
    """Early CosyVoice2 files had no ``chunk_size``: the encoder streamed with full context."""
    text = edited("        static_chunk_size: !ref <chunk_size>\n", "        use_dynamic_chunk: True\n")
    text = text.replace(
        "            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>\n"
        "            num_decoding_left_chunks: !ref <num_decoding_left_chunks>\n",
        "            static_chunk_size: !ref <token_frame_rate> * <token_mel_ratio>\n",
    )
    cfg = load_config(write(tmp_path, text))
    assert cfg.flow.encoder.static_chunk_size == 0
    assert (cfg.flow.decoder.estimator.static_chunk_size, cfg.flow.decoder.estimator.num_decoding_left_chunks) == (
        50,
        2,
    )


def test_tiny_config_round_trips_through_the_official_format(tmp_path: Path) -> None:
    path = tmp_path / "cosyvoice2.yaml"
    write_config(tiny_config(), path)

    assert load_config(path) == tiny_config()
    text = path.read_text(encoding="utf-8")
    assert "flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec\n" in text
    assert "cfm_params: !new:omegaconf.DictConfig\n" in text
    assert "static_chunk_size: !ref <chunk_size> * <token_mel_ratio>\n" in text
    assert "sampling_rate: !ref <sample_rate>\n" in text
    assert "__set_seed1: !apply:random.seed [1986]\n" in text


def test_official_config_round_trips(tmp_path: Path) -> None:
    official = load_config(write(tmp_path, OFFICIAL_YAML))
    path = tmp_path / "written.yaml"
    write_config(official, path)
    assert load_config(path) == official


def test_tiny_config_keeps_the_real_interfaces() -> None:
    cfg = tiny_config()
    assert cfg.sample_rate == 24000
    assert cfg.flow.output_size == 80
    assert cfg.flow.vocab_size == 6561
    assert cfg.flow.spk_embed_dim == 192
    assert cfg.flow.encoder.output_size < 512
    assert cfg.hift.base_channels < 512


def test_write_config_keeps_a_chunk_size_that_is_not_the_reference(tmp_path: Path) -> None:
    tiny = tiny_config()
    estimator = dataclasses.replace(tiny.flow.decoder.estimator, static_chunk_size=30)
    flow = dataclasses.replace(tiny.flow, decoder=dataclasses.replace(tiny.flow.decoder, estimator=estimator))
    cfg: CosyVoice2Config = dataclasses.replace(tiny, flow=flow)
    path = tmp_path / "cosyvoice2.yaml"
    write_config(cfg, path)
    assert load_config(path) == cfg


def test_hyperpyyaml_tags_stay_inert_and_references_resolve() -> None:
    document = parse_hyperpyyaml(
        "base: 10\n"
        "nested: {inner: {value: 3}}\n"
        "product: !ref <base> * <nested[inner][value]> + 1\n"
        "path: !ref <base>/save\n"
        "same: !ref <model>\n"
        "model: !new:some.module.Model\n"
        "    size: !ref <base>\n"
        "danger: !apply:os.remove ['/definitely/not/here']\n"
        "small: 1e-06\n"
    )
    assert document["product"] == 31
    assert document["path"] == "10/save"
    assert document["model"] == Tagged("new", "some.module.Model", {"size": 10})
    assert document["same"] == document["model"]
    assert document["danger"] == Tagged("apply", "os.remove", ["/definitely/not/here"])
    assert document["small"] == pytest.approx(1e-06)
    assert not any(isinstance(value, Ref) for value in document.values())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (edited("        num_blocks: 6\n", ""), "flow.encoder.num_blocks is missing"),
        (edited("        num_blocks: 6\n", "        num_blocks: 6\n        n_layers: 6\n"), "n_layers"),
        (
            edited("!new:cosyvoice.flow.decoder.CausalConditionalDecoder", "!new:cosyvoice.flow.DiT.dit.DiT"),
            "cosyvoice.flow.DiT.dit.DiT",
        ),
        (edited("        use_cnn_module: False\n", "        use_cnn_module: True\n"), "use_cnn_module"),
        (edited("        input_layer: 'linear'\n", ""), "input_layer = 'conv2d'"),
        (edited("            act_fn: 'gelu'\n", "            act_fn: 'snakebeta'\n"), "act_fn"),
        (edited("                solver: 'euler'\n", "                solver: 'midpoint'\n"), "solver"),
        (
            edited(
                "    nb_harmonics: 8\n    sampling_rate: !ref <sample_rate>\n",
                "    nb_harmonics: 8\n    sampling_rate: 22050\n",
            ),
            "sample_rate",
        ),
        (edited("    upsample_rates: [8, 5, 3]\n", "    upsample_rates: [8, 8, 3]\n"), "samples per mel frame"),
        (edited("    vocab_size: 6561\n", "    vocab_size: '6561'\n"), "flow.vocab_size must be int"),
        (edited("            in_channels: 320\n", "            in_channels: 240\n"), "estimator.in_channels"),
        (
            edited("    input_frame_rate: !ref <token_frame_rate>\n", "    input_frame_rate: !ref <frame_rate>\n"),
            "<frame_rate>",
        ),
        (OFFICIAL_YAML.split("hift: !new")[0], "no `hift` section"),
        ("flow: [unclosed\n", "not valid HyperPyYAML"),
    ],
)
def test_unusable_files_fail_with_the_key_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(write(tmp_path, text))


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")
