"""The CPU install leaves a working vLLM and Ray Serve (the setup script removes the mismatched torchvision)."""

import subprocess
import sys

import pytest


@pytest.mark.vllm
def test_vllm_and_ray_serve_import():
    code = "import vllm, ray.serve, torch; print(vllm.__version__, torch.__version__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    vllm_version, torch_version = result.stdout.split()[-2:]
    assert vllm_version == "0.32.0"
    assert torch_version.endswith("+cpu")
