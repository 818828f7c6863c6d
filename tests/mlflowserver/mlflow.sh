#!/usr/bin/env bash
# A real MLflow tracking server for tests/test_mlflow.py, from its own virtual environment (the full
# `mlflow` package pins pyarrow < 26; petatrain's client is mlflow-skinny):
#   mlflow.sh install          create the environment (once; ~1 minute on a fresh machine)
#   mlflow.sh start PORT DIR   serve on 127.0.0.1:PORT, SQLite and artifacts under DIR; prints the URI
#   mlflow.sh stop DIR         stop the server started on DIR
set -euo pipefail
VERSION=3.17.2  # the client (mlflow-skinny) and the server at one version
HOME_DIR="${PETATRAIN_MLFLOW_HOME:-${TMPDIR:-/tmp}/petatrain-mlflow}"
VENV="$HOME_DIR/venv-$VERSION"

install() {
  mkdir -p "$HOME_DIR"
  exec 9>"$HOME_DIR/install.lock"
  flock 9
  if [ ! -x "$VENV/bin/mlflow" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "mlflow==$VERSION"
  fi
}

case "${1:-}" in
  install) install ;;
  start)
    port="$2"; dir="$3"
    install
    mkdir -p "$dir/artifacts"
    # Its own session (stop ends the whole group: uvicorn's workers too); no job runner (a pool of
    # huey consumers, for MLflow's GenAI jobs, that would take the test machine's cores).
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$VENV/bin/mlflow" server --host 127.0.0.1 --port "$port" \
      --workers 1 --backend-store-uri "sqlite:///$dir/mlflow.db" --artifacts-destination "$dir/artifacts" \
      >"$dir/server.log" 2>&1 &
    echo $! >"$dir/server.pid"
    for _ in $(seq 1 120); do
      if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then echo "http://127.0.0.1:$port"; exit 0; fi
      if ! kill -0 "$(cat "$dir/server.pid")" 2>/dev/null; then cat "$dir/server.log" >&2; exit 1; fi
      sleep 0.5
    done
    echo "mlflow server did not answer on port $port in 60 s" >&2; tail -20 "$dir/server.log" >&2; exit 1 ;;
  stop)
    dir="$2"
    if [ -f "$dir/server.pid" ]; then
      pid="$(cat "$dir/server.pid")"
      kill -TERM -- "-$pid" 2>/dev/null || true
      for _ in $(seq 1 20); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.25; done
      kill -KILL -- "-$pid" 2>/dev/null || true
      rm -f "$dir/server.pid"
    fi ;;
  *) echo "usage: mlflow.sh install | start PORT DIR | stop DIR" >&2; exit 2 ;;
esac
