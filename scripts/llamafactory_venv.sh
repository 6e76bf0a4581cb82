#!/usr/bin/env bash
# A virtual environment with LLaMA-Factory 0.9.5 on torch 2.13.0's CPU wheel (roll's torch), for the side-by-side
# benchmarks (docs/performance.md). LLaMA-Factory is never a roll dependency: its transformers/trl/peft/datasets
# pins differ from roll's, so it gets a venv of its own.
#
#   bash scripts/llamafactory_venv.sh lf      # then: --llamafactory-cli lf/bin/llamafactory-cli
#
# Why not `pip install llamafactory`: its requirements pull torchvision, whose Linux wheels on PyPI pin a CUDA
# build of a newer torch (several GB), and text-only training never imports it; it does import torchaudio
# (llamafactory/data/mm_plugin.py), whose compiled libraries do not load with torch 2.13.0+cpu, so torchaudio is
# installed without them and runs in its pure-Python mode. Everything else is LLaMA-Factory's own requirement
# list with torch held at 2.13.0. Measured 2026-11-27: about 4 minutes; torch 2.13.0+cpu, transformers 5.6.0,
# trl 0.24.0, peft 0.18.1, datasets 4.0.0.
set -euo pipefail
venv=${1:?usage: bash scripts/llamafactory_venv.sh VENV_DIR}
version=${LLAMAFACTORY_VERSION:-0.9.5}
python=${PYTHON:-python3.11}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" download -q --no-deps -d "$work" "llamafactory==$version"
wheel=$(ls "$work"/llamafactory-*.whl)
# its requirements (no extras), less torch, torchvision and torchaudio; torch stays at 2.13.0
"$venv/bin/python" - "$wheel" > "$work/requirements.txt" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for line in whl.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            req = line.split(":", 1)[1].strip()
            if re.split(r"[<>=!~; \[]", req)[0].lower() not in ("torch", "torchvision", "torchaudio"):
                print(req)
EOF
echo "torch==2.13.0" > "$work/constraints.txt"
"$venv/bin/pip" install -q -c "$work/constraints.txt" -r "$work/requirements.txt"
"$venv/bin/pip" install -q --no-deps "$wheel" torchaudio==2.11.0
find "$venv"/lib/python3*/site-packages/torchaudio -name '*.so' -delete
"$venv/bin/python" -c "import torch, transformers, llamafactory; print('llamafactory', llamafactory.__version__, \
'torch', torch.__version__, 'transformers', transformers.__version__)"
