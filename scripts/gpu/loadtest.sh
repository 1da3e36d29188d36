#!/usr/bin/env bash
# Drafters side by side under load: one `draftsman serve` per drafter on the bundled target, all on
# this machine, then one `draftsman loadtest` against all of them in turn (order flipped each run).
# Called by run.sh when LOAD_S > 0; runs anywhere:  OUT_DIR=/tmp/lt bash scripts/gpu/loadtest.sh
#   LOAD_ARGS  loadtest flags (default: 8 clients, 48 requests of 8-128 tokens, 2 runs per server)
set -u
OUT_DIR=${OUT_DIR:?set OUT_DIR to a folder}
mkdir -p "$OUT_DIR"
LOAD_ARGS=${LOAD_ARGS:---requests 48 --concurrency 8 --max-tokens 128 --max-tokens-min 8 --repeats 2}
TARGET="--set target.path=zoo/python-target"
# name | serve flags. `none-1row` is the same server with batching off: what batching itself is worth.
SERVERS=(
  "none-1row|--drafter none --max-batch-rows 1"
  "none|--drafter none"
  "ngram|--drafter ngram"
  "medusa|--drafter medusa --set drafter.path=zoo/python-medusa --set drafter.draft_vocab=1024"
  "eagle3|--drafter eagle --set drafter.path=zoo/python-eagle3"
)
PIDS=(); URLS=(); PORT=8201
for entry in "${SERVERS[@]}"; do
  name=${entry%%|*}; flags=${entry#*|}
  # shellcheck disable=SC2086  # flags are words on purpose
  python3 -m draftsman serve $flags $TARGET --port "$PORT" --quiet > "$OUT_DIR/serve-$name.log" 2>&1 &
  PIDS+=($!); URLS+=(--url "http://127.0.0.1:$PORT/v1"); echo "$PORT $name" >> "$OUT_DIR/servers.txt"
  PORT=$((PORT + 1))
done
trap 'kill "${PIDS[@]}" 2>/dev/null' EXIT TERM INT

# Wait (120 s at most) until every server answers /v1/models.
python3 - "$OUT_DIR/servers.txt" <<'EOF' || { tail -n 5 "$OUT_DIR"/serve-*.log; exit 1; }
import sys, time, urllib.request
ports = [line.split()[0] for line in open(sys.argv[1])]
deadline = time.time() + 120
for port in ports:
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            break
        except OSError:
            if time.time() > deadline:
                sys.exit(f"server on port {port} not up after 120 s")
            time.sleep(1)
print("servers up:", " ".join(ports))
EOF

# shellcheck disable=SC2086
python3 -m draftsman loadtest "${URLS[@]}" $LOAD_ARGS --json "$OUT_DIR/loadtest.json" \
  > "$OUT_DIR/loadtest.md" 2> "$OUT_DIR/loadtest.err"
echo "loadtest exit $?"
cat "$OUT_DIR/servers.txt" "$OUT_DIR/loadtest.md"
