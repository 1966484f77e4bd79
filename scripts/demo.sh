#!/usr/bin/env bash
# The main job on the embedded default: make the tiny agreeing checkpoint pair,
# build an engine from it, and stream lossless speculative generation with
# acceptance statistics. Everything lands under ./demo-out (override with $1).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh" "test"
OUT="${1:-$ROOT/demo-out}"
CLI="$VENV/bin/muse-spark"
echo "== 1/3 tiny checkpoint pair (target + DSpark draft) -> $OUT/tiny"
"$CLI" make-tiny "$OUT/tiny" --kind agreeing
echo "== 2/3 build the engine -> $OUT/engine"
"$CLI" build --target "$OUT/tiny/target" --draft "$OUT/tiny/draft" --out "$OUT/engine" \
    --backend eager --device cpu --max-batch 4 --max-seq 512
echo "== 3/3 speculative generation (greedy, streamed)"
"$CLI" generate --engine "$OUT/engine" --prompt "Muse Spark says: " --max-tokens 64 --ignore-eos --stream
echo "== and sampled at temperature 0.8 (seed 7)"
"$CLI" generate --engine "$OUT/engine" --prompt "Muse Spark says: " --max-tokens 64 --ignore-eos --stream \
    --temperature 0.8 --seed 7
