"""Numerical parity of our flow with upstream's ``cosyvoice.flow.flow.CausalMaskedDiffWithXvec``.

Upstream's module is built from the reference package (var/reference) with the same hyperparameters,
every parameter is randomised under a fixed seed (norm weights and biases included, so that swapped
layers cannot pass), and its state dict is loaded strictly into ours. Both then turn the same tokens,
prompt and speaker embedding into mel, offline and streaming, final and non-final.

Importing upstream's flow needs einops and diffusers (used on the tested path: the decoder's
rearranging and Matcha's transformer blocks). Four imports that the tested path does not use get
stand-ins, registered only for the import and removed right after:

* ``omegaconf``: ``cosyvoice/flow/flow.py`` uses ``DictConfig`` only in default argument values
  (``cfm_params`` is passed here as a namespace with the same attributes).
* ``conformer``: Matcha's ``decoder.py`` subclasses ``ConformerBlock`` for a wrapper CosyVoice never uses.
* ``matcha.utils.pylogger``: pulls in ``lightning`` to build a logger; a plain logger stands in.
* ``cosyvoice.utils.class_utils``: name -> class registries; the real module imports every upstream model
  (LLM, HiFT, the CLI model, which needs torchaudio). The stand-in maps the names CosyVoice2 uses to
  upstream's own classes, so the encoder is built from exactly the classes the real registry returns.

Upstream's encoder hard-codes the width of its look-ahead and upsample layers to 512 (the official
encoder width). For the tiny model those two layers are rebuilt from upstream's own classes at the
tiny width; the official-width case below builds upstream's encoder unmodified.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tts_gateway.models.cosyvoice2.checkpoints.config_writer import tiny_config
from tts_gateway.models.cosyvoice2.model.config import FlowConfig
from tts_gateway.models.cosyvoice2.model.flow import CausalFlow

pytestmark = pytest.mark.cosyvoice

TOLERANCE = 1e-4
UPSTREAM_HARD_CODED_WIDTH = 512


@contextmanager
def stand_ins(modules: dict[str, types.ModuleType]) -> Iterator[None]:
    added = [name for name in modules if name not in sys.modules]
    sys.modules.update({name: modules[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            del sys.modules[name]


def stand_in(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


@pytest.fixture(scope="module")
def upstream(reference_dir: Path) -> types.SimpleNamespace:
    pytest.importorskip("einops", reason="upstream's flow decoder needs einops (pip install einops)")
    pytest.importorskip("diffusers", reason="upstream's flow decoder needs diffusers (pip install diffusers)")
    subsampling = importlib.import_module("cosyvoice.transformer.subsampling")
    embedding = importlib.import_module("cosyvoice.transformer.embedding")
    attention = importlib.import_module("cosyvoice.transformer.attention")
    registries = stand_in(
        "cosyvoice.utils.class_utils",
        COSYVOICE_SUBSAMPLE_CLASSES={"linear": subsampling.LinearNoSubsampling},
        COSYVOICE_EMB_CLASSES={"rel_pos_espnet": embedding.EspnetRelPositionalEncoding},
        COSYVOICE_ATTENTION_CLASSES={"rel_selfattn": attention.RelPositionMultiHeadedAttention},
        COSYVOICE_ACTIVATION_CLASSES={"swish": torch.nn.SiLU},
    )
    with (
        stand_ins(
            {
                "omegaconf": stand_in("omegaconf", DictConfig=dict),
                "conformer": stand_in("conformer", ConformerBlock=torch.nn.Module),
                "matcha.utils.pylogger": stand_in("matcha.utils.pylogger", get_pylogger=logging.getLogger),
                "cosyvoice.utils.class_utils": registries,
            }
        ),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", FutureWarning)
        encoder = importlib.import_module("cosyvoice.transformer.upsample_encoder")
        decoder = importlib.import_module("cosyvoice.flow.decoder")
        flow_matching = importlib.import_module("cosyvoice.flow.flow_matching")
        flow = importlib.import_module("cosyvoice.flow.flow")
    return types.SimpleNamespace(
        Encoder=encoder.UpsampleConformerEncoder,
        PreLookahead=encoder.PreLookaheadLayer,
        Upsample=encoder.Upsample1D,
        Estimator=decoder.CausalConditionalDecoder,
        CFM=flow_matching.CausalConditionalCFM,
        Flow=flow.CausalMaskedDiffWithXvec,
    )


def build_upstream(up: types.SimpleNamespace, cfg: FlowConfig, seed: int) -> Any:
    torch.manual_seed(seed)
    enc, dec = cfg.encoder, cfg.decoder
    est = dec.estimator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # diffusers' LoRACompatibleLinear deprecation
        encoder = up.Encoder(
            input_size=enc.input_size,
            output_size=enc.output_size,
            attention_heads=enc.attention_heads,
            linear_units=enc.linear_units,
            num_blocks=enc.num_blocks,
            dropout_rate=0.1,
            positional_dropout_rate=0.1,
            attention_dropout_rate=0.1,
            normalize_before=True,
            input_layer="linear",
            pos_enc_layer_type="rel_pos_espnet",
            selfattention_layer_type="rel_selfattn",
            use_cnn_module=False,
            macaron_style=False,
            static_chunk_size=enc.static_chunk_size,
        )
        if enc.output_size != UPSTREAM_HARD_CODED_WIDTH:
            encoder.pre_lookahead_layer = up.PreLookahead(channels=enc.output_size, pre_lookahead_len=3)
            encoder.up_layer = up.Upsample(channels=enc.output_size, out_channels=enc.output_size, stride=2)
        estimator = up.Estimator(
            in_channels=est.in_channels,
            out_channels=est.out_channels,
            channels=list(est.channels),
            dropout=0.0,
            attention_head_dim=est.attention_head_dim,
            n_blocks=est.n_blocks,
            num_mid_blocks=est.num_mid_blocks,
            num_heads=est.num_heads,
            act_fn=est.act_fn,
            static_chunk_size=est.static_chunk_size,
            num_decoding_left_chunks=est.num_decoding_left_chunks,
        )
        cfm_params = types.SimpleNamespace(
            sigma_min=dec.sigma_min,
            solver=dec.solver,
            t_scheduler=dec.t_scheduler,
            training_cfg_rate=0.2,
            inference_cfg_rate=dec.inference_cfg_rate,
            reg_loss_type="l1",
        )
        cfm = up.CFM(
            in_channels=dec.in_channels,
            cfm_params=cfm_params,
            n_spks=dec.n_spks,
            spk_emb_dim=dec.spk_emb_dim,
            estimator=estimator,
        )
        model = up.Flow(
            input_size=cfg.input_size,
            output_size=cfg.output_size,
            spk_embed_dim=cfg.spk_embed_dim,
            output_type="mel",
            vocab_size=cfg.vocab_size,
            input_frame_rate=cfg.input_frame_rate,
            only_mask_loss=True,
            token_mel_ratio=cfg.token_mel_ratio,
            pre_lookahead_len=cfg.pre_lookahead_len,
            encoder=encoder,
            decoder=cfm,
        ).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:  # biases and norm weights: move them off their 0/1 initialisation
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


@dataclasses.dataclass(frozen=True)
class Case:
    streaming: bool
    finalize: bool
    prompt_tokens: int = 20
    target_tokens: int = 40


def run_both(ours: CausalFlow, theirs: Any, case: Case, seed: int = 11) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    token = torch.randint(0, 6561, (1, case.target_tokens), generator=g)
    prompt_token = torch.randint(0, 6561, (1, case.prompt_tokens), generator=g)
    prompt_feat = torch.randn(1, 2 * case.prompt_tokens, 80, generator=g)
    embedding = torch.randn(1, 192, generator=g)
    mel = ours.inference(token, prompt_token, prompt_feat, embedding, streaming=case.streaming, finalize=case.finalize)
    reference, _ = theirs.inference(
        token,
        torch.tensor([case.target_tokens]),
        prompt_token,
        torch.tensor([case.prompt_tokens]),
        prompt_feat,
        torch.tensor([2 * case.prompt_tokens]),
        embedding,
        streaming=case.streaming,
        finalize=case.finalize,
    )
    return mel, reference


def load_into_ours(theirs: Any, cfg: FlowConfig) -> CausalFlow:
    ours = CausalFlow(cfg).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours


@pytest.fixture(scope="module")
def tiny_pair(upstream: types.SimpleNamespace) -> tuple[CausalFlow, Any]:
    cfg = tiny_config().flow
    theirs = build_upstream(upstream, cfg, seed=3)
    return load_into_ours(theirs, cfg), theirs


def test_state_dict_keys_and_shapes_equal_upstream(tiny_pair: tuple[CausalFlow, Any]) -> None:
    ours, theirs = tiny_pair
    our_shapes = {key: tuple(value.shape) for key, value in ours.state_dict().items()}
    their_shapes = {key: tuple(value.shape) for key, value in theirs.state_dict().items()}
    assert our_shapes == their_shapes


def test_fixed_noise_equals_upstream(tiny_pair: tuple[CausalFlow, Any]) -> None:
    ours, theirs = tiny_pair
    assert torch.equal(ours.decoder.rand_noise, theirs.decoder.rand_noise)


@pytest.mark.parametrize(
    "case",
    [
        Case(streaming=False, finalize=True),
        Case(streaming=True, finalize=False),
        Case(streaming=True, finalize=True),
        Case(streaming=False, finalize=False),
        Case(streaming=True, finalize=True, prompt_tokens=0, target_tokens=30),
    ],
    ids=["offline", "stream-chunk", "stream-final", "offline-lookahead", "stream-no-prompt"],
)
def test_mel_matches_upstream(tiny_pair: tuple[CausalFlow, Any], case: Case) -> None:
    mel, reference = run_both(*tiny_pair, case)
    assert mel.shape == reference.shape
    assert reference.abs().max() > 0.5  # a meaningful signal, not a degenerate all-zero output
    assert (mel - reference).abs().max().item() < TOLERANCE


def test_official_width_encoder_matches_upstream_unmodified(upstream: types.SimpleNamespace) -> None:
    """At the official 512-wide encoder upstream's module is used exactly as it is built."""
    tiny = tiny_config().flow
    encoder = dataclasses.replace(
        tiny.encoder, input_size=UPSTREAM_HARD_CODED_WIDTH, output_size=UPSTREAM_HARD_CODED_WIDTH, attention_heads=8
    )
    cfg = dataclasses.replace(tiny, input_size=UPSTREAM_HARD_CODED_WIDTH, encoder=encoder)
    theirs = build_upstream(upstream, cfg, seed=5)
    ours = load_into_ours(theirs, cfg)
    for case in (Case(streaming=True, finalize=False, target_tokens=12), Case(streaming=False, finalize=True)):
        mel, reference = run_both(ours, theirs, case)
        assert mel.shape == reference.shape
        assert (mel - reference).abs().max().item() < TOLERANCE


def test_two_level_unet_matches_upstream(upstream: types.SimpleNamespace) -> None:
    """CosyVoice2 ships a one-level U-Net; a two-level one exercises the strided down/up sampling too."""
    tiny = tiny_config().flow
    estimator = dataclasses.replace(tiny.decoder.estimator, channels=(32, 32))
    cfg = dataclasses.replace(tiny, decoder=dataclasses.replace(tiny.decoder, estimator=estimator))
    theirs = build_upstream(upstream, cfg, seed=9)
    ours = load_into_ours(theirs, cfg)
    for case in (Case(streaming=True, finalize=False, target_tokens=21), Case(streaming=False, finalize=True)):
        mel, reference = run_both(ours, theirs, case)
        assert mel.shape == reference.shape
        assert (mel - reference).abs().max().item() < TOLERANCE


def test_official_configuration_has_upstreams_parameter_names_and_shapes(upstream: types.SimpleNamespace) -> None:
    """The official flow.pt layout (hyperparameters of CosyVoice2-0.5B), built without memory on the meta device."""
    tiny = tiny_config().flow
    width = UPSTREAM_HARD_CODED_WIDTH
    encoder = dataclasses.replace(
        tiny.encoder, input_size=width, output_size=width, attention_heads=8, linear_units=2048, num_blocks=6
    )
    estimator = dataclasses.replace(
        tiny.decoder.estimator, channels=(256,), attention_head_dim=64, n_blocks=4, num_mid_blocks=12, num_heads=8
    )
    cfg = dataclasses.replace(
        tiny, input_size=width, encoder=encoder, decoder=dataclasses.replace(tiny.decoder, estimator=estimator)
    )
    with torch.device("meta"):
        theirs = build_upstream(upstream, cfg, seed=0)
        ours = CausalFlow(cfg)
    our_shapes = {key: tuple(value.shape) for key, value in ours.state_dict().items()}
    their_shapes = {key: tuple(value.shape) for key, value in theirs.state_dict().items()}
    assert our_shapes == their_shapes
    assert len(our_shapes) > 500
