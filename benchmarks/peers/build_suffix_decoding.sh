#!/usr/bin/env bash
# Build SuffixDecoding's suffix tree (arctic-inference 0.3.0, Apache-2.0) for the peer benchmark
# benchmarks/bench_suffix_decoding.py: a benchmark-only dependency, never a runtime one of mtprobe.
#
# Only the nanobind extension csrc/suffix_decoding (suffix_tree.cc, bindings.cc -> _C) is built,
# with arctic's own CMakeLists.txt, outside the repository:
#
#     DEST = ${MTPROBE_CACHE:-$HOME/.cache/mtprobe}/peers/arctic_inference-0.3.0   (or $1)
#
# and laid out as a minimal package, so that with DEST on sys.path
#
#     from arctic_inference.suffix_decoding import SuffixDecodingCache
#
# works without the rest of arctic_inference (its vLLM plugin, torch ops). The sdist is fetched by
# URL (not `pip download`, which would build the whole package and pull its heavy build deps) and
# checked against its sha256. nanobind 2.9.2 is pip-installed (build-time only). Idempotent: a
# finished build (DEST/.built) is kept; delete DEST to rebuild.
#
#     bash benchmarks/peers/build_suffix_decoding.sh
set -euo pipefail

VERSION=0.3.0
NAME=arctic_inference-${VERSION}
URL=https://files.pythonhosted.org/packages/63/c1/573fa2f00097cd9cc1167b31fd900b2482f58f3491867cebdd5516626533/${NAME}.tar.gz
SHA256=7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36
NANOBIND=2.9.2
PYTHON=${PYTHON:-python}

DEST=${1:-${MTPROBE_CACHE:-$HOME/.cache/mtprobe}/peers/${NAME}}
TARBALL=$DEST/_download/${NAME}.tar.gz
SRC=$DEST/_src/${NAME}
BUILD=$DEST/_build
PKG=$DEST/arctic_inference

check_import() {
  (cd / && PYTHONPATH="$DEST" "$PYTHON" -c '
from arctic_inference.suffix_decoding import SuffixDecodingCache
c = SuffixDecodingCache(max_tree_depth=8)
c.start_request(0, [1, 2, 3, 1, 2])
d = c.speculate(0, [1, 2], max_spec_tokens=4, use_tree_spec=True)
assert list(d.token_ids)[:1] == [3], d
c.stop_request(0)
import sys
assert "torch" not in sys.modules and "vllm" not in sys.modules
')
}

if [[ -f $DEST/.built ]] && check_import 2>/dev/null; then
  echo "SuffixDecoding (arctic-inference $VERSION) already built: $PKG"
  echo "use it with: PYTHONPATH=$DEST (or sys.path.insert(0, '$DEST'))"
  exit 0
fi

mkdir -p "$DEST/_download" "$DEST/_src"

# 1. The sdist, checked.
sha_ok() { [[ -f $1 ]] && [[ $(sha256sum "$1" | cut -d' ' -f1) == "$SHA256" ]]; }
if ! sha_ok "$TARBALL"; then
  echo "fetching $URL"
  curl -fsSL --retry 3 -o "$TARBALL.part" "$URL"
  mv "$TARBALL.part" "$TARBALL"
fi
if ! sha_ok "$TARBALL"; then
  echo "sha256 mismatch for $TARBALL (want $SHA256, got $(sha256sum "$TARBALL" | cut -d' ' -f1))" >&2
  rm -f "$TARBALL"
  exit 1
fi
echo "sdist: $TARBALL (sha256 $SHA256)"
rm -rf "$SRC"
tar -xzf "$TARBALL" -C "$DEST/_src"

# 2. nanobind (build-time only) and the extension, with arctic's CMakeLists.txt (C++20, Release).
if ! "$PYTHON" -c "import nanobind, sys; sys.exit(nanobind.__version__ != '$NANOBIND')" 2>/dev/null; then
  "$PYTHON" -m pip install --quiet "nanobind==$NANOBIND"
fi
GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
cmake -S "$SRC/csrc/suffix_decoding" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v "$PYTHON")" >"$DEST/_build.log" 2>&1 || {
  cat "$DEST/_build.log" >&2
  exit 1
}
cmake --build "$BUILD" --parallel "${BUILD_JOBS:-1}" >>"$DEST/_build.log" 2>&1 || {
  cat "$DEST/_build.log" >&2
  exit 1
}
SO=$(find "$BUILD" -maxdepth 1 -name '_C*.so' | head -n1)
[[ -n $SO ]] || { echo "no _C*.so in $BUILD" >&2; exit 1; }

# 3. The minimal package: arctic_inference/suffix_decoding/{__init__,cache,simulator}.py and _C.
rm -rf "$PKG"
mkdir -p "$PKG/suffix_decoding"
if grep -Eq '^[[:space:]]*(import|from)[[:space:]]' "$SRC/arctic_inference/__init__.py"; then
  # The package's own __init__ imports more than the suffix tree needs: a minimal one instead.
  printf '%s\n' "# Minimal arctic_inference package: only arctic_inference.suffix_decoding (built by" \
    "# mtprobe's benchmarks/peers/build_suffix_decoding.sh from arctic-inference $VERSION)." \
    >"$PKG/__init__.py"
else
  cp "$SRC/arctic_inference/__init__.py" "$PKG/__init__.py"  # 0.3.0: only its license header
fi
cp "$SRC"/arctic_inference/suffix_decoding/{__init__,cache,simulator}.py "$PKG/suffix_decoding/"
cp "$SO" "$PKG/suffix_decoding/"
cp "$SRC/LICENSE" "$DEST/LICENSE"
cat >"$DEST/README" <<EOF
SuffixDecoding's suffix tree from arctic-inference $VERSION (Snowflake Inc., Apache-2.0: LICENSE),
sdist $URL
(sha256 $SHA256), only csrc/suffix_decoding built (nanobind $NANOBIND) and
arctic_inference/suffix_decoding/ copied unchanged, by mtprobe's
benchmarks/peers/build_suffix_decoding.sh. Put this folder on sys.path.
EOF

check_import
touch "$DEST/.built"
echo "built SuffixDecoding (arctic-inference $VERSION): $PKG/suffix_decoding/$(basename "$SO")"
echo "license: $DEST/LICENSE; sources: $SRC; build log: $DEST/_build.log"
echo "use it with: PYTHONPATH=$DEST (or sys.path.insert(0, '$DEST'))"
