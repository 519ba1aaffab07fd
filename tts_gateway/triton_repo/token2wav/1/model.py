"""Triton adapter for token2wav (flow + HiFT): the converter built from the config's parameters.

Serving it (batches across requests, streams' sessions, first chunks first) is
:class:`tts_gateway.models.cosyvoice2.stage_models.token2wav_model.Token2WavModel`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tts_gateway.models.contract import parse_bool
from tts_gateway.models.cosyvoice2.engines.token2wav import Token2Wav
from tts_gateway.models.cosyvoice2.stage_models.token2wav_model import Token2WavModel

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TritonPythonModel(Token2WavModel):
    def load(self, params: dict[str, str], device: str) -> Token2Wav:
        return Token2Wav.from_model_dir(
            Path(params["model_dir"]),
            device=device,
            dtype=_DTYPES[params["dtype"]],
            n_timesteps=int(params["n_timesteps"]),
            first_chunk_timesteps=int(params["first_chunk_timesteps"]),
            graph_rows=int(params["graph_rows"]),
            graph_frames=int(params["graph_frames"]),
            prefix_cache_mb=int(params["prefix_cache_mb"]),
            prefix_frames=int(params["prefix_frames"]),
            hift_graph_rows=int(params["hift_graph_rows"]),
            hift_graph_hops=[int(hop) for hop in params["hift_graph_hops"].split(",") if hop.strip()],
            compile_backend=params["compile_backend"],
            fuse_flow=parse_bool(params["fuse_flow"]),
        )
