#!/usr/bin/env bash
# Installs ovdflash with its export stage and test tools into a virtual environment
# (default .venv) from scratch. Usage: bash tools/install.sh [VENV_DIR]
#
# Why a script and not one pip line: optimum-intel declares torchvision as a
# dependency, and PyPI's torchvision breaks beside the CPU build of torch 2.13.0
# ("operator torchvision::nms does not exist"). optimum-intel imports fine without
# torchvision, so it goes in with --no-deps after everything else.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q torch==2.13.0                      # the local CPU wheel, before anything can pull a CUDA build
$PIP install -q -e ".[export,bench,test,serve,ray]"
$PIP install -q --no-deps optimum-intel==2.2.0      # see above: no torchvision
$PIP install -q --no-deps dflash==0.1.0             # test-only oracle (z-lab reference model classes)
# llguidance (structured outputs) comes with the serve extra: fail here, not at the first JSON-schema request
$VENV/bin/python -c "import torch, openvino, optimum.intel, llguidance; print('ovdflash install ok: torch', torch.__version__, 'openvino', openvino.__version__, 'llguidance', llguidance.__version__)"
