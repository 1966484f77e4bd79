#!/usr/bin/env bash
# The main job on the embedded default: make the tiny agreeing checkpoint pair,
# build an engine from it, and stream lossless speculative generation with
# acceptance statistics. Everything lands under ./demo-out (override with $1).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh" "test"
OUT="${1:-$ROOT/demo-out}"
CLI="$VENV/bin/muse-spark"
echo "== 1/4 tiny checkpoint pair (target + DSpark draft) -> $OUT/tiny"
"$CLI" make-tiny "$OUT/tiny" --kind agreeing
echo "== 2/4 build the engine -> $OUT/engine"
"$CLI" build --target "$OUT/tiny/target" --draft "$OUT/tiny/draft" --out "$OUT/engine" \
    --backend eager --device cpu --max-batch 4 --max-seq 512
echo "== 3/4 speculative generation (greedy, streamed)"
"$CLI" generate --engine "$OUT/engine" --prompt "Muse Spark says: " --max-tokens 64 --ignore-eos --stream
echo "== and sampled at temperature 0.8 (seed 7)"
"$CLI" generate --engine "$OUT/engine" --prompt "Muse Spark says: " --max-tokens 64 --ignore-eos --stream \
    --temperature 0.8 --seed 7
echo "== 4/4 a chat round trip through the OpenAI-compatible server (the official openai client)"
PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$CLI" serve-openai --engine "$OUT/engine" --port "$PORT" --served-model-name tiny --log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
"$PY" - "$PORT" <<'PYEOF'
import sys, time, urllib.request
import openai

base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(600):  # the engine loads first
    try:
        urllib.request.urlopen(base + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
client = openai.OpenAI(base_url=base + "/v1", api_key="none")
messages = [{"role": "user", "content": "Hello, Muse Spark!"}]
reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=32, temperature=0)
print("user: Hello, Muse Spark!")
print("assistant:", repr(reply.choices[0].message.content), f"({reply.usage.completion_tokens} tokens,",
      f"finish reason {reply.choices[0].finish_reason})")
PYEOF
kill $SERVER 2>/dev/null || true
wait $SERVER 2>/dev/null || true
