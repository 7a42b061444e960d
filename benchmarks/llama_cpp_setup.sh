#!/usr/bin/env bash
# The llama.cpp benchmark environment of benchmarks/llama_cpp_peer.py (python -m benchmarks.compare --shape
# smollm2-135m / qwen2.5-0.5b): a virtual environment apart from the project's, llama-cpp-python built from its
# source distribution (cmake, this machine's own instruction set: GGML_NATIVE) and that distribution's llama.cpp
# tree (convert_hf_to_gguf.py, conversion/, gguf-py/) unpacked under sdist/ for the GGUF conversion.
# Usage: bash benchmarks/llama_cpp_setup.sh [VENV]  (default: .venv-bench, or $TSERVE_LLAMA_CPP_VENV).
# The build takes 10-30 minutes on 2 cores; its log is VENV/build.log.
set -euo pipefail
VERSION=0.3.36
VENV=${1:-${TSERVE_LLAMA_CPP_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv-bench}}
SDIST=llama_cpp_python-$VERSION
python3 -m venv "$VENV"
"$VENV/bin/pip" download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$VENV/sdist"
tar -xzf "$VENV/sdist/$SDIST.tar.gz" -C "$VENV/sdist" "$SDIST/vendor/llama.cpp/convert_hf_to_gguf.py" \
    "$SDIST/vendor/llama.cpp/conversion" "$SDIST/vendor/llama.cpp/gguf-py"
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/pip" install -v "$VENV/sdist/$SDIST.tar.gz" > "$VENV/build.log" 2>&1
echo "llama-cpp-python $VERSION built into $VENV"
