"""``cosyvoice2.yaml`` written from a typed config, and the tiny preset, for random-weight checkpoints.

The file comes out in the official file's structure, tags and references, so that
:func:`~tts_gateway.models.cosyvoice2.model.config.load_config` reads it as it reads the official one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tts_gateway.models.cosyvoice2.model.config import (
    CFM_CLASS,
    CFM_PARAMS_CLASS,
    ENCODER_CLASS,
    ESTIMATOR_CLASS,
    F0_PREDICTOR_CLASS,
    FLOW_CLASS,
    HIFT_CLASS,
    CosyVoice2Config,
    DecoderConfig,
    EncoderConfig,
    EstimatorConfig,
    FlowConfig,
    HiftConfig,
)
from tts_gateway.models.cosyvoice2.model.hyperpyyaml import Ref, Tagged, dump_hyperpyyaml, resolve_reference

_SEED = 1986
_SEED_FUNCTIONS = ("random.seed", "numpy.random.seed", "torch.manual_seed", "torch.cuda.manual_seed_all")


def _chunk_ref(value: int, document: Mapping[str, Any], expr: str) -> int | Ref:
    """Write ``value`` as the reference the official file uses when the reference yields it."""
    return Ref(expr) if resolve_reference(dict(document), expr) == value else value


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
    path.write_text(dump_hyperpyyaml(config_to_document(cfg)), encoding="utf-8")


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
