#!/usr/bin/env bash
# Ray for the GPU machine (no Ray there, no index): the cp312 manylinux wheel of `ray` unpacked,
# trimmed of what a one-node Python cluster never loads (the Java jar, the dashboard's web build),
# packed as .whl_ray/ray_trim.tar.xz, with the cp312 wheels of its dependencies the GPU image may
# lack. Part ray-tp of benchmarks/gpu/run.sh unpacks it into /tmp/site.
#
# Usage (repo root, on a machine with the package index): bash benchmarks/gpu/ray_bundle.sh [VERSION]
# Prints the sizes; a device call carries at most 64 MiB in all (repo and other wheels included).
set -eu
cd "$(dirname "$0")/../.."
VER=${1:-}
DL=$(mktemp -d /tmp/ray_bundle.XXXXXX)
PIP=(python3 -m pip download -q --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --no-deps -d "$DL")
"${PIP[@]}" "ray${VER:+==$VER}"
mkdir -p .whl_ray "$DL/site"
# Dependencies of ray's core that torch / transformers do not already bring.
"${PIP[@]}" -d .whl_ray click msgpack protobuf jsonschema jsonschema-specifications referencing rpds-py attrs
# pip keeps the executables' mode bits (gcs_server, raylet) and writes bin/ray
python3 -m pip install -q --no-index --no-deps --no-compile --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --target "$DL/site" "$DL"/ray-*.whl
rm -rf "$DL/site/ray/jars" "$DL/site/ray/dashboard/client/build" "$DL/site/bin"  # bin/: this machine's shebangs
find "$DL/site" -name '*.js.map' -delete
tar -C "$DL/site" -cf - . | xz -6 -T2 > .whl_ray/ray_trim.tar.xz
echo "ray wheel: $(du -m "$DL"/ray-*.whl | cut -f1) MiB; trimmed tar.xz: $(du -m .whl_ray/ray_trim.tar.xz | cut -f1) MiB;" \
     "dependency wheels: $(cat .whl_ray/*.whl | wc -c | awk '{printf "%.1f", $1 / 1048576}') MiB"
rm -rf "$DL"
