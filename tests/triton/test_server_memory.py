"""tritonserver's own memory: large responses pass through it and leave nothing behind at rest."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from benchmarks.memory_soak import rss_mib
from tts_gateway.gateway.embedded.server import EmbeddedTriton

pytestmark = pytest.mark.triton

MIB = 1024 * 1024
# Output sizes in MiB, eight responses in flight at a time: a long Piper sentence's float32 waveform
# is several MiB, and the server copies each into its gRPC response.
SIZES_MIB = (2, 3, 4, 6, 8, 10, 12, 16) * 2


def write_sized_output_model(repository: Path) -> None:
    """A Python model answering ``x`` (MiB) with that many MiB of float32."""
    model = repository / "sized" / "1"
    model.mkdir(parents=True)
    (model.parent / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "y", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
        "instance_group [ { count: 4, kind: KIND_CPU } ]\n"
    )
    (model / "model.py").write_text(
        "import numpy as np\n"
        "import triton_python_backend_utils as pb\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        responses = []\n"
        "        for request in requests:\n"
        "            mib = int(pb.get_input_tensor_by_name(request, 'x').as_numpy()[0])\n"
        f"            y = np.ones(mib * {MIB // 4}, np.float32)\n"
        "            responses.append(pb.InferenceResponse([pb.Tensor('y', y)]))\n"
        "        return responses\n"
    )


def ask(url: str, mib: int) -> int:
    with grpcclient.InferenceServerClient(url) as client:
        x = grpcclient.InferInput("x", [1], "FP32")
        x.set_data_from_numpy(np.array([mib], np.float32))
        y = client.infer("sized", [x]).as_numpy("y")
    assert y is not None
    return int(y.nbytes // MIB)


def test_large_responses_leave_the_servers_own_memory_where_it_was(tmp_path: Path) -> None:
    # The outputs' shared memory (the stubs' pool, mapped by the server too) is left out: it keeps the
    # size of the largest outputs in flight at once, a bound, not a growth.
    write_sized_output_model(tmp_path / "models")
    with EmbeddedTriton(tmp_path / "models", workdir=tmp_path / "work") as server:
        assert server.pid is not None
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda _: ask(server.grpc_url, 1), range(8))) == [1] * 8
            before = rss_mib(server.pid)[" own"]
            for _ in range(3):
                assert list(pool.map(lambda mib: ask(server.grpc_url, mib), SIZES_MIB)) == list(SIZES_MIB)
        after = rss_mib(server.pid)[" own"]
    # Measured: +0 MiB; +50 MiB with glibc's defaults, +157 MiB with Triton's pool of response objects.
    assert after - before < 8, f"tritonserver's own memory {before:.1f} -> {after:.1f} MiB"
