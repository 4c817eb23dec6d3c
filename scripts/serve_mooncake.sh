#!/usr/bin/env bash
# Serve a checkpoint with HiCache over a local Mooncake store (what `make serve L3=mooncake` runs).
#
#   scripts/serve_mooncake.sh PYTHON MODEL_DIR PORT [more server flags...]
#
# Starts `mooncake_master` (from PYTHON's environment: the `mooncake` extra) on 127.0.0.1 with its
# embedded HTTP metadata server, serves MODEL_DIR on 127.0.0.1:PORT with
# `--hicache-storage-backend mooncake` on it (TCP; prefetch waits for every page, so a prompt another
# server has seen shows storage hits even on an idle server), and stops the master (by its pid) when the
# server stops: Ctrl-C, `kill <server pid>`, or this script killed. Ports (fixed, so a second
# server can join the same store):
#   MOONCAKE_RPC_PORT (50051), MOONCAKE_HTTP_PORT (8080, metadata), MOONCAKE_METRICS_PORT (9003)
# If a master already answers on MOONCAKE_RPC_PORT (another `make serve L3=mooncake`), this server
# shares it and leaves it running. MOONCAKE_SEGMENT_BYTES (256 MiB): the memory this server
# contributes to the store. The master's log: MOONCAKE_LOG (.cache/serve/mooncake_master.log).
set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '4p' "$0" >&2
    exit 2
fi
PY=$1 MODEL=$2 PORT=$3
shift 3
RPC_PORT=${MOONCAKE_RPC_PORT:-50051}
HTTP_PORT=${MOONCAKE_HTTP_PORT:-8080}
METRICS_PORT=${MOONCAKE_METRICS_PORT:-9003}
SEGMENT_BYTES=${MOONCAKE_SEGMENT_BYTES:-268435456}
LOG=${MOONCAKE_LOG:-.cache/serve/mooncake_master.log}
MASTER_BIN=$(dirname "$PY")/mooncake_master

accepts() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

master_pid="" server_pid=""
cleanup() {
    trap - EXIT INT TERM
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    if [ -n "$master_pid" ] && kill -0 "$master_pid" 2>/dev/null; then
        echo "stopping mooncake_master (pid $master_pid)" >&2
        kill -TERM "$master_pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$master_pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$master_pid" 2>/dev/null || true
        wait "$master_pid" 2>/dev/null || true
    fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if accepts "$RPC_PORT"; then
    echo "a Mooncake master already answers on 127.0.0.1:$RPC_PORT: sharing it (it is not stopped here)" >&2
else
    if [ ! -x "$MASTER_BIN" ]; then
        echo "no $MASTER_BIN: install the mooncake extra (make install) and Debian's libibverbs1 librdmacm1" >&2
        exit 1
    fi
    mkdir -p "$(dirname "$LOG")"
    # its own session: Ctrl-C reaches the server, and the master outlives it until cleanup stops it
    setsid "$MASTER_BIN" -rpc_address 127.0.0.1 -rpc_port "$RPC_PORT" -enable_http_metadata_server=true \
        -http_metadata_server_host 127.0.0.1 -http_metadata_server_port "$HTTP_PORT" \
        -metrics_host 127.0.0.1 -metrics_port "$METRICS_PORT" >"$LOG" 2>&1 </dev/null &
    master_pid=$!
    deadline=$((SECONDS + 30))
    until accepts "$RPC_PORT" && accepts "$HTTP_PORT"; do
        if ! kill -0 "$master_pid" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
            echo "mooncake_master did not start on ports $RPC_PORT/$HTTP_PORT; $LOG:" >&2
            tail -n 20 "$LOG" >&2
            exit 1
        fi
        sleep 0.1
    done
    echo "mooncake_master (pid $master_pid) on 127.0.0.1:$RPC_PORT, metadata http://127.0.0.1:$HTTP_PORT/metadata" >&2
fi

EXTRA=$(printf '{"master_server_address": "127.0.0.1:%s", "metadata_server": "http://127.0.0.1:%s/metadata", "protocol": "tcp", "device_name": "", "local_hostname": "127.0.0.1", "global_segment_size": %s, "prefetch_threshold": 64}' \
    "$RPC_PORT" "$HTTP_PORT" "$SEGMENT_BYTES")
OMP_NUM_THREADS=1 "$PY" -m sglang.launch_server --model-path "$MODEL" --port "$PORT" \
    --max-total-tokens 8192 --page-size 16 --enable-hierarchical-cache --hicache-storage-backend mooncake \
    --hicache-storage-prefetch-policy wait_complete --hicache-storage-backend-extra-config "$EXTRA" "$@" &
server_pid=$!
set +e
wait "$server_pid"
status=$?
server_pid=""
exit "$status"
