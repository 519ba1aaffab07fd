"""Every profile renders into configs Triton can parse, and the CosyVoice2 configs agree with the code.

Configs are parsed with Triton's own ``ModelConfig`` protobuf (shipped in ``tritonclient``),
so a misspelt field or a malformed value fails here rather than at server start.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tts_gateway.models import contract
from tts_gateway.models.model_repository import TemplateError, load_profiles, render_repository
from tts_gateway.paths import TRITON_REPOSITORY

pytestmark = pytest.mark.cosyvoice

SOURCE = TRITON_REPOSITORY
COSYVOICE_PROFILES = ("cosyvoice2-cpu", "gpu-trtllm", "gpu-torch")


def _dtype(config_dtype: int) -> str:
    """Config dtype enum -> contract spelling (BYTES for TYPE_STRING)."""
    name = mc.DataType.Name(config_dtype).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def _render(profile: str, dest: Path) -> dict[str, mc.ModelConfig]:
    names = render_repository(SOURCE, profile, dest)
    configs = {}
    for name in names:
        config = mc.ModelConfig()
        text_format.Parse((dest / name / "config.pbtxt").read_text(encoding="utf-8"), config)
        configs[name] = config
    return configs


def _params(config: mc.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, mc.ModelConfig]]:
    root = tmp_path_factory.mktemp("repos")
    return {profile: _render(profile, root / profile) for profile in load_profiles(SOURCE)}


def test_every_profile_renders_into_parseable_configs(rendered: dict[str, dict[str, mc.ModelConfig]]) -> None:
    assert set(COSYVOICE_PROFILES) <= set(rendered)
    for profile, configs in rendered.items():
        assert configs, profile
        for name, config in configs.items():
            assert config.backend in ("python", "tensorrtllm"), (profile, name)
            assert "${" not in text_format.MessageToString(config), (profile, name)


@pytest.mark.parametrize("profile", COSYVOICE_PROFILES)
def test_orchestrator_serves_the_contract(rendered: dict[str, dict[str, mc.ModelConfig]], profile: str) -> None:
    configs = rendered[profile]
    offline, stream = configs["cosyvoice2"], configs[contract.stream_model_name("cosyvoice2")]
    assert not offline.model_transaction_policy.decoupled
    assert stream.model_transaction_policy.decoupled
    for config in (offline, stream):
        inputs = {tensor.name: tensor for tensor in config.input}
        declared = set(contract.INPUT_DTYPES) - {contract.VOICE}
        assert set(inputs) == declared
        for name, tensor in inputs.items():
            assert _dtype(tensor.data_type) == contract.INPUT_DTYPES[name], name
            assert tensor.optional == (name != contract.TARGET_TEXT), name
        assert [(o.name, _dtype(o.data_type), list(o.dims)) for o in config.output] == [
            (contract.WAVEFORM, "FP32", [-1])
        ]
        params = _params(config)
        assert params[contract.PARAM_TTS_CONTRACT] == contract.CONTRACT_VERSION
        assert params[contract.PARAM_SAMPLE_RATE] == "24000"
        assert contract.parse_bool(params[contract.PARAM_SUPPORTS_CLONING])
        # Tempo changes happen offline only; the gateway stretches streams itself.
        assert contract.parse_bool(params[contract.PARAM_SUPPORTS_SPEED]) == (config is offline)
        assert contract.parse_list(params[contract.PARAM_BUILTIN_VOICES]) == ()
        assert "en" in contract.parse_list(params[contract.PARAM_LANGUAGES])


@pytest.mark.parametrize("profile", COSYVOICE_PROFILES)
def test_offline_and_stream_deployments_differ_only_in_decoupling_and_speed(
    rendered: dict[str, dict[str, mc.ModelConfig]], profile: str
) -> None:
    offline, stream = rendered[profile]["cosyvoice2"], rendered[profile]["cosyvoice2_stream"]
    speed = contract.PARAM_SUPPORTS_SPEED
    assert {**_params(offline), speed: ""} == {**_params(stream), speed: ""}
    assert list(offline.input) == list(stream.input)
    assert list(offline.instance_group) == list(stream.instance_group)


@pytest.mark.parametrize("profile", COSYVOICE_PROFILES)
def test_orchestrator_parameters_build_pipeline_settings(
    rendered: dict[str, dict[str, mc.ModelConfig]], profile: str
) -> None:
    from tts_gateway.models.cosyvoice2.orchestrator.pipeline import PipelineSettings

    configs = rendered[profile]
    params = _params(configs["cosyvoice2"])
    settings = PipelineSettings.from_parameters(params)
    assert settings.hop_schedule.first_hop == int(params["first_hop_tokens"])
    assert settings.max_output_tokens == int(params["max_output_tokens"])
    for key in ("llm_model", "audio_tokenizer_model", "speaker_embedding_model", "token2wav_model"):
        assert params[key] in configs, f"{profile}: {key} names {params[key]!r}, not deployed"


def _llm_config(configs: dict[str, mc.ModelConfig]) -> mc.ModelConfig:
    return configs[_params(configs["cosyvoice2"])["llm_model"]]


@pytest.mark.parametrize("profile", COSYVOICE_PROFILES)
def test_llm_model_accepts_what_the_orchestrator_sends(
    rendered: dict[str, dict[str, mc.ModelConfig]], profile: str
) -> None:
    from tts_gateway.models.cosyvoice2 import tensors
    from tts_gateway.models.cosyvoice2.orchestrator.pipeline import LLMRequest

    llm = _llm_config(rendered[profile])
    assert llm.model_transaction_policy.decoupled, "the orchestrator always streams from the LLM"
    assert llm.max_batch_size >= 1
    declared = {tensor.name: tensor for tensor in llm.input}
    request = LLMRequest(
        input_ids=[1, 2, 3],
        max_new_tokens=10,
        min_new_tokens=2,
        end_id=7,
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        repetition_penalty=1.1,
        seed=5,
        streaming=True,
    )
    sent = tensors.llm_inputs(request)
    assert set(sent) == set(tensors.LLM_INPUT_DTYPES)
    for name, array in sent.items():
        tensor = declared[name]
        assert _dtype(tensor.data_type) == tensors.LLM_INPUT_DTYPES[name], name
        assert array.dtype == np.dtype(tensors.LLM_INPUT_DTYPES[name].lower().replace("fp", "float")), name
        # Leading batch dimension, then the declared dims.
        assert array.shape[0] == 1
        assert len(array.shape) == 1 + len(tensor.dims), name
    required = {tensor.name for tensor in llm.input if not tensor.optional}
    assert required <= set(sent)
    outputs = {tensor.name: _dtype(tensor.data_type) for tensor in llm.output}
    assert {k: outputs[k] for k in tensors.LLM_OUTPUT_DTYPES} == tensors.LLM_OUTPUT_DTYPES


def test_torch_llm_mirrors_the_tensorrt_llm_backend(rendered: dict[str, dict[str, mc.ModelConfig]]) -> None:
    from tts_gateway.models.cosyvoice2 import tensors

    torch_llm = rendered["cosyvoice2-cpu"]["llm"]
    trt_llm = rendered["gpu-trtllm"]["tensorrt_llm"]
    trt_inputs = {tensor.name: tensor for tensor in trt_llm.input}
    torch_only = {tensor.name: _dtype(tensor.data_type) for tensor in torch_llm.input if tensor.name not in trt_inputs}
    # Text streams are the PyTorch LLM's own; their later requests carry no prompt, so its prompt
    # inputs are optional where TensorRT-LLM requires them.
    assert torch_only == tensors.TEXT_STREAM_INPUT_DTYPES
    for tensor in torch_llm.input:
        if tensor.name in torch_only:
            continue
        twin = trt_inputs[tensor.name]
        assert (tensor.data_type, list(tensor.dims)) == (twin.data_type, list(twin.dims)), tensor.name
        assert tensor.optional or not twin.optional, tensor.name
    trt_outputs = {tensor.name: tensor for tensor in trt_llm.output}
    for tensor in torch_llm.output:
        assert (tensor.data_type, list(tensor.dims)) == (
            trt_outputs[tensor.name].data_type,
            list(trt_outputs[tensor.name].dims),
        )


def test_tensorrt_llm_config_matches_the_backend(rendered: dict[str, dict[str, mc.ModelConfig]]) -> None:
    config = rendered["gpu-trtllm"]["tensorrt_llm"]
    params = _params(config)
    assert config.backend == "tensorrtllm"
    assert config.model_transaction_policy.decoupled
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["exclude_input_in_output"] == "true"
    assert 0.0 < float(params["kv_cache_free_gpu_mem_fraction"]) < 1.0
    assert int(params["max_attention_window_size"]) > 0
    assert params["gpt_model_path"].startswith("/")
    inputs = {tensor.name: tensor for tensor in config.input}
    assert not inputs["input_ids"].optional
    assert inputs["input_ids"].allow_ragged_batch
    assert list(inputs["input_lengths"].reshape.shape) == []
    assert _dtype(inputs["random_seed"].data_type) == "UINT64"


@pytest.mark.parametrize("profile", COSYVOICE_PROFILES)
def test_voice_models_match_the_orchestrator(rendered: dict[str, dict[str, mc.ModelConfig]], profile: str) -> None:
    from tts_gateway.models.cosyvoice2 import tensors

    configs = rendered[profile]
    params = _params(configs["cosyvoice2"])
    token2wav = configs[params["token2wav_model"]]
    declared = {tensor.name: _dtype(tensor.data_type) for tensor in token2wav.input}
    assert declared == tensors.TOKEN2WAV_INPUT_DTYPES
    assert [o.name for o in token2wav.output] == [tensors.WAVEFORM_OUTPUT]
    for key, output in (
        ("audio_tokenizer_model", tensors.AUDIO_TOKENS_OUTPUT),
        ("speaker_embedding_model", tensors.SPEAKER_EMBEDDING_OUTPUT),
    ):
        config = configs[params[key]]
        assert {t.name: _dtype(t.data_type) for t in config.input} == tensors.REFERENCE_INPUT_DTYPES
        assert [o.name for o in config.output] == [output]


def test_gpu_profiles_put_token2wav_on_the_gpu(rendered: dict[str, dict[str, mc.ModelConfig]]) -> None:
    for profile in ("gpu-trtllm", "gpu-torch"):
        token2wav = rendered[profile]["token2wav"]
        assert token2wav.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
        assert _params(token2wav)["device"] == "cuda"
    cpu = rendered["cosyvoice2-cpu"]
    assert cpu["token2wav"].instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert _params(cpu["token2wav"])["device"] == "cpu"
    assert _params(cpu["llm"])["device"] == "cpu"
    assert "tensorrt_llm" not in cpu


def test_token2wav_runs_as_one_instance_everywhere(rendered: dict[str, dict[str, mc.ModelConfig]]) -> None:
    # Streaming state lives in the instance's process: a second instance could receive a
    # session's later chunks and not know it (no sequence batching pins sessions to instances).
    for profile, configs in rendered.items():
        if "token2wav" in configs:
            groups = configs["token2wav"].instance_group
            assert sum(group.count for group in groups) == 1, profile


def test_token2wav_instances_cannot_be_overridden(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match=r"token2wav.*unknown keys \['instance_count'\]"):
        render_repository(SOURCE, "gpu-torch", tmp_path / "repo", {"token2wav": {"instance_count": "4"}})


def test_gpu_profiles_compile_the_flow_in_fewer_kernels_unless_told_not_to(
    rendered: dict[str, dict[str, mc.ModelConfig]], tmp_path: Path
) -> None:
    for profile in ("gpu-trtllm", "gpu-torch"):
        params = _params(rendered[profile]["token2wav"])
        assert (params["compile_backend"], contract.parse_bool(params["fuse_flow"])) == ("inductor", True)
    render_repository(SOURCE, "gpu-torch", tmp_path / "repo", {"token2wav": {"fuse_flow": "false"}})
    config = mc.ModelConfig()
    text_format.Parse((tmp_path / "repo" / "token2wav" / "config.pbtxt").read_text(encoding="utf-8"), config)
    assert not contract.parse_bool(_params(config)["fuse_flow"])


def test_token2wav_records_hift_for_the_hops_the_orchestrators_make(
    rendered: dict[str, dict[str, mc.ModelConfig]],
) -> None:
    """The first 20 non-final chunks, caught up or not, are shapes the HiFT graphs hold (else vocoded
    eagerly), and every recorded shape is one of them (else its graphs cost start-up and memory for nothing)."""
    from tts_gateway.models.cosyvoice2.orchestrator.pipeline import PipelineSettings

    checked = 0
    for profile, configs in rendered.items():
        if "token2wav" not in configs:
            continue
        hops = {int(hop) for hop in _params(configs["token2wav"])["hift_graph_hops"].split(",")}
        for name in ("cosyvoice2", "cosyvoice2_stream"):
            schedule = PipelineSettings.from_parameters(_params(configs[name])).hop_schedule
            scheduled = {schedule.next_hop(index) for index in range(20)}
            caught_up = {
                schedule.catch_up_hop(hop, pending)
                for hop in scheduled - {schedule.first_hop}
                for pending in range(500)
            }
            assert scheduled | caught_up == hops, (profile, name)
            checked += 1
    assert checked >= 2 * len(COSYVOICE_PROFILES)


def test_the_llm_yields_only_to_requests_past_their_own_first_chunk(
    rendered: dict[str, dict[str, mc.ModelConfig]],
) -> None:
    """yield_after_tokens is the tokens the orchestrator needs for a first chunk: its first hop plus the look-ahead."""
    from tts_gateway.models.cosyvoice2.orchestrator.pipeline import PipelineSettings

    checked = 0
    for profile, configs in rendered.items():
        llm = configs.get("llm")
        if llm is None or llm.backend != "python":
            continue
        schedule = PipelineSettings.from_parameters(_params(configs["cosyvoice2_stream"])).hop_schedule
        assert int(_params(llm)["yield_after_tokens"]) == schedule.first_hop + schedule.pre_lookahead, profile
        checked += 1
    assert checked >= 2
