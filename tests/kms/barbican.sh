#!/usr/bin/env bash
# barbican.sh - a throwaway OpenStack Barbican key manager (HTTP API) for tests.
#
#   barbican.sh install       install Barbican (Debian packages) if needed, and nothing else.
#   barbican.sh start  [DIR]  install Barbican (Debian packages) if needed, write a
#                             config in DIR and start the API on 127.0.0.1. Idempotent.
#   barbican.sh stop   [DIR]  kill the server started from DIR and remove DIR.
#   barbican.sh status [DIR]  exit 0 if the Barbican endpoint answers, 1 otherwise.
#   barbican.sh env    [DIR]  print `export PETATRAIN_BARBICAN_URL=...`.
#
# DIR defaults to /tmp/petatrain-barbican. Everything (config, the sqlite
# database, logs, the pid file) lives under DIR; /etc/barbican is neither used
# nor changed. The server binds 127.0.0.1 only.
#
# What runs: Debian's python3-barbican WSGI app (paste pipeline with the
# `unauthenticated-context` filter: NO keystone; the project is the
# `X-Project-Id` request header, the roles the `X-Roles` header - none given
# means `admin`), served by waitress (from Debian). waitress accepts and reads
# many connections at once, but runs ONE worker thread: Barbican keeps a
# database transaction open per request, and with sqlite several worker threads
# fail concurrent writes at once with "database is locked" (HTTP 500; seen with
# 8 threads and 8 parallel clients: 58 of 80 POSTs failed). One thread queues
# the requests instead; each takes a few ms (an RSA order: up to seconds).
# Secrets are stored by the `store_crypto` secret store with the
# `simple_crypto` plugin; its KEK is 32 random bytes made at each start (so
# the secrets of one run are unreadable by the next; DIR is throwaway anyway).
# Orders (key generation) are processed synchronously in the API (no queue,
# no barbican-worker).
#
# Barbican's config files are found by oslo.config in ~/.barbican/ first, so
# the server and barbican-manage run with HOME=DIR/home and read
# DIR/home/.barbican/barbican.conf.
#
# Environment:
#   PETATRAIN_BARBICAN_PORT     API port (default 9311)
#   PETATRAIN_BARBICAN_TIMEOUT  seconds to wait for the API to answer (default 120)
#
# Must run as root (installs packages).

set -euo pipefail

PROG=$(basename "$0")
CMD=${1:-}
DIR=${2:-/tmp/petatrain-barbican}
PORT=${PETATRAIN_BARBICAN_PORT:-9311}
TIMEOUT=${PETATRAIN_BARBICAN_TIMEOUT:-120}

MARKER=.petatrain-barbican   # marks DIR as ours, so we only ever rm -rf our own dirs
# barbican-api (the uwsgi/init.d/systemd wrapper) is not installed: it pulls in
# python3-openstackclient (19 more packages) and its postinst tries to start a
# system-wide barbican-api on 0.0.0.0:9311. The WSGI app is in python3-barbican.
PACKAGES=(python3-barbican barbican-common python3-waitress python3-pastedeploy curl)

log() { echo "[$PROG] $*" >&2; }
die() { echo "[$PROG] ERROR: $*" >&2; exit 1; }

usage() {
    cat >&2 <<EOF
usage: $PROG {install|start|stop|status|env} [DIR]
  DIR defaults to /tmp/petatrain-barbican; the port is PETATRAIN_BARBICAN_PORT (default 9311)
EOF
    exit 2
}

check_args() {
    [[ $PORT =~ ^[0-9]+$ ]] && ((PORT > 0 && PORT < 65536)) ||
        die "PETATRAIN_BARBICAN_PORT must be a port number, got '$PORT'"
    [[ $TIMEOUT =~ ^[0-9]+$ ]] || die "PETATRAIN_BARBICAN_TIMEOUT must be a number, got '$TIMEOUT'"
    [[ $DIR == /* ]] || DIR=$(pwd)/$DIR
    DIR=${DIR%/}
    case "$DIR" in
        "" | / | /tmp | /root | /home | /usr | /var | /etc | /work | /work/main)
            die "refusing to use '$DIR' as the state directory" ;;
    esac
    [[ $DIR != *[[:space:]]* ]] || die "DIR must not contain white space: '$DIR'"
}

endpoint() { echo "http://127.0.0.1:$PORT"; }
pidfile() { echo "$DIR/run/barbican-api.pid"; }

# 0 if something answers HTTP on the port.
port_answers() {
    curl -s -o /dev/null --max-time 3 "$(endpoint)/" 2>/dev/null
}

# 0 if it answers *and* looks like Barbican: GET / is its version document
# (300 Multiple Choices, {"versions": {"values": [{"id": "v1", ...}]}}).
barbican_answers() {
    local body
    body=$(curl -s --max-time 3 "$(endpoint)/" 2>/dev/null) || return 1
    [[ $body == *'"versions"'* && $body == *'"v1"'* ]]
}

tcp_listening() { # 0 if something accepts connections on 127.0.0.1:$PORT
    timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT" 2>/dev/null
}

need_root() {
    [[ $(id -u) == 0 ]] || die "must run as root (installs packages)"
}

installed() { # all of PACKAGES fully installed (dpkg), and the tools on PATH
    local status
    command -v curl >/dev/null 2>&1 && command -v barbican-manage >/dev/null 2>&1 || return 1
    status=$(dpkg-query -W -f='${db:Status-Status}\n' "${PACKAGES[@]}" 2>/dev/null) || return 1
    ! grep -qvx installed <<<"$status"
}

POLICY_RC=/usr/sbin/policy-rc.d
POLICY_RC_OURS=0
drop_policy_rc() {
    if ((POLICY_RC_OURS)) && grep -qF "$PROG" "$POLICY_RC" 2>/dev/null; then
        rm -f "$POLICY_RC"
    fi
    POLICY_RC_OURS=0
}

install_if_missing() {
    installed && return 0
    command -v apt-get >/dev/null 2>&1 || die "Barbican is not installed and apt-get is not available"
    local t0=$SECONDS aptlog=${TMPDIR:-/tmp}/petatrain-barbican-apt.log
    log "installing ${PACKAGES[*]} (Debian packages) ..."
    # No maintainer script may start a system-wide service while we install
    # (none of these packages has one, but a later change or barbican-api
    # would): policy-rc.d answering 101 makes invoke-rc.d skip every start.
    # Only added if there is none, and removed again afterwards.
    if [[ ! -e $POLICY_RC ]]; then
        printf '#!/bin/sh\n# temporary, written by %s: no service starts during its apt-get install\nexit 101\n' \
            "$PROG" >"$POLICY_RC"
        chmod 755 "$POLICY_RC"
        POLICY_RC_OURS=1
        trap drop_policy_rc EXIT
    fi
    # debconf: all questions of barbican-common (configure_db, rabbit,
    # keystone) default to "no"; noninteractive takes the defaults, asks nothing.
    export DEBIAN_FRONTEND=noninteractive DEBCONF_NONINTERACTIVE_SEEN=true
    # another install (the suite's RGW, Prometheus, Java) may hold dpkg's lock: wait for it
    apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null 2>&1 || die "apt-get update failed"
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confdef \
        -o Dpkg::Options::=--force-confold "${PACKAGES[@]}" >"$aptlog" 2>&1 ||
        { drop_policy_rc; tail -n 30 "$aptlog" >&2; die "apt-get install failed (log: $aptlog)"; }
    drop_policy_rc
    installed && /usr/bin/python3 -c "import barbican.api.app, waitress, paste.deploy" >/dev/null 2>&1 ||
        die "Barbican is still not usable after installing (python3 cannot import it)"
    log "installed in $((SECONDS - t0))s"
}

# pid of the server from the pid file, only if it is alive and really is the
# server started from DIR (pid files can be stale / reused).
our_pid() {
    local f pid
    f=$(pidfile)
    [[ -f $f ]] || return 1
    pid=$(tr -dc 0-9 <"$f" || true)
    [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$DIR/serve.py" || return 1
    echo "$pid"
}

kill_server() {
    local pid i
    pid=$(our_pid) || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$(pidfile)"; return 0; }
        if ((i == 30)); then kill -KILL "$pid" 2>/dev/null || true; fi
        sleep 0.1
    done
    die "could not kill the Barbican server (pid $pid)"
}

wipe_dir() {
    [[ -e $DIR ]] || return 0
    if [[ -d $DIR && ! -e $DIR/$MARKER && -n $(ls -A "$DIR" 2>/dev/null) ]]; then
        die "'$DIR' exists, is not empty and was not created by $PROG; refusing to delete it"
    fi
    rm -rf -- "$DIR"
}

show_logs() {
    local f
    for f in "$DIR"/log/*.log; do
        [[ -s $f ]] || continue
        echo "----- tail -n 20 $f -----" >&2
        tail -n 20 "$f" >&2 || true
    done
}

fail_start() { # report, show the logs, kill what was started; DIR is kept for inspection
    echo "[$PROG] ERROR: $*" >&2
    show_logs
    kill_server || true
    echo "[$PROG] ERROR: $* (server killed; logs kept in $DIR/log, '$0 stop $DIR' removes them)" >&2
    exit 1
}

write_conf() {
    local etc=$DIR/home/.barbican kek
    mkdir -p "$etc/barbican.conf.d" "$etc/policy.d"
    # the KEK wraps every project's key; fresh random bytes per start, never in the repo
    kek=$(head -c 32 /dev/urandom | base64 -w0)
    (
        umask 077
        cat >"$etc/barbican.conf" <<EOF
# generated by $PROG - throwaway Barbican for tests; never use outside tests
[DEFAULT]
# the href base of secret/order/container refs in responses
host_href = $(endpoint)
sql_connection = sqlite:///$DIR/barbican.sqlite
db_auto_create = false
# role given to requests without an X-Roles header (unauthenticated-context)
admin_role = admin
log_file = $DIR/log/barbican-api.log
use_stderr = false
debug = false

[queue]
# orders are processed synchronously in the API process (no RabbitMQ, no worker)
enable = false

[keystone_notifications]
enable = false

[secretstore]
namespace = barbican.secretstore.plugin
enabled_secretstore_plugins = store_crypto

[crypto]
namespace = barbican.crypto.plugin
enabled_crypto_plugins = simple_crypto

[simple_crypto_plugin]
kek = $kek

[oslo_policy]
# Barbican's default (in-code) policy; nothing from /etc/barbican/policy.d
policy_file = $etc/policy.yaml
policy_dirs = $etc/policy.d
EOF
    )
    echo '{}' >"$etc/policy.yaml"

    cat >"$DIR/barbican-api-paste.ini" <<EOF
# generated by $PROG: Debian's barbican-api-paste.ini with the unauthenticated pipeline on /v1
[composite:main]
use = egg:Paste#urlmap
/: barbican_version
/v1: barbican_api

[pipeline:barbican_version]
pipeline = cors http_proxy_to_wsgi microversion versionapp

# no keystone: the project comes from the X-Project-Id header, roles from X-Roles
[pipeline:barbican_api]
pipeline = cors http_proxy_to_wsgi unauthenticated-context microversion apiapp

[app:apiapp]
paste.app_factory = barbican.api.app:create_main_app

[app:versionapp]
paste.app_factory = barbican.api.app:create_version_app

[filter:unauthenticated-context]
paste.filter_factory = barbican.api.middleware.context:UnauthenticatedContextMiddleware.factory

[filter:microversion]
paste.filter_factory = barbican.api.middleware.microversion:MicroversionMiddleware.factory

[filter:cors]
paste.filter_factory = oslo_middleware.cors:filter_factory
oslo_config_project = barbican

[filter:http_proxy_to_wsgi]
paste.filter_factory = oslo_middleware:HTTPProxyToWSGI.factory
EOF

    cat >"$DIR/serve.py" <<'EOF'
# generated by barbican.sh: serve Barbican's paste app with waitress (threaded)
import sys

from paste.deploy import loadapp
import waitress

paste_ini, port = sys.argv[1], int(sys.argv[2])
app = loadapp("config:" + paste_ini)
# one worker thread: sqlite + Barbican's per-request transactions (see barbican.sh)
waitress.serve(app, host="127.0.0.1", port=port, threads=1,
               ident="barbican", clear_untrusted_proxy_headers=True)
EOF
}

run_barbican() { # run_barbican <cmd...>: with DIR's config (HOME=DIR/home)
    env HOME="$DIR/home" "$@"
}

cmd_start() {
    need_root
    if barbican_answers; then
        if our_pid >/dev/null; then
            log "already running: $(endpoint) (from $DIR)"
            return 0
        fi
        die "a Barbican not started from $DIR answers at $(endpoint); stop it or set PETATRAIN_BARBICAN_PORT"
    fi
    # stale state from an earlier run: kill what it left behind, then wipe it
    if [[ -e $DIR ]]; then
        log "removing stale state in $DIR"
        if [[ -e $DIR/$MARKER ]]; then kill_server; fi
        wipe_dir
    fi
    if port_answers || tcp_listening; then
        die "port 127.0.0.1:$PORT is taken by something that is not Barbican; set PETATRAIN_BARBICAN_PORT"
    fi
    install_if_missing

    local t0=$SECONDS pid
    mkdir -p "$DIR"/{run,log,home}
    chmod 700 "$DIR"
    : >"$DIR/$MARKER"
    write_conf

    # schema: Barbican's alembic migrations (what `barbican-manage db upgrade` runs)
    run_barbican barbican-manage db upgrade >>"$DIR/log/db.log" 2>&1 ||
        fail_start "barbican-manage db upgrade failed"
    log "database schema ready ($((SECONDS - t0))s)"

    # the server: a new session (setsid) so it survives this shell; fd 9 (the lock) closed
    (
        cd "$DIR"
        exec setsid env HOME="$DIR/home" /usr/bin/python3 "$DIR/serve.py" \
            "$DIR/barbican-api-paste.ini" "$PORT" \
            </dev/null >>"$DIR/log/server.log" 2>&1 9<&-
    ) &
    pid=$!
    echo "$pid" >"$(pidfile)"
    until barbican_answers; do
        our_pid >/dev/null || fail_start "the Barbican server exited during startup"
        ((SECONDS - t0 < TIMEOUT)) || fail_start "timed out after ${TIMEOUT}s waiting for $(endpoint)"
        sleep 0.3
    done
    log "Barbican up at $(endpoint) in $((SECONDS - t0))s (pid $pid, state in $DIR)"
}

cmd_stop() {
    if [[ -e $DIR ]]; then
        if [[ -e $DIR/$MARKER ]]; then
            kill_server
        fi
        wipe_dir
        log "stopped; removed $DIR"
    else
        log "nothing to stop ($DIR does not exist)"
    fi
}

cmd_status() {
    if barbican_answers; then
        log "running: $(endpoint)"
    else
        log "not running ($(endpoint) does not answer)"
        return 1
    fi
}

cmd_env() {
    echo "export PETATRAIN_BARBICAN_URL=$(endpoint)"
}

# serialize start/stop (e.g. parallel test workers all calling start). The
# server is started with fd 9 closed so that it does not inherit the lock.
lock() {
    if command -v flock >/dev/null 2>&1; then
        exec 9<"${BASH_SOURCE[0]}"
        flock 9
    fi
}

case "$CMD" in
    install) lock; install_if_missing ;;
    start) check_args; lock; cmd_start ;;
    stop) check_args; lock; cmd_stop ;;
    status) check_args; cmd_status ;;
    env) check_args; cmd_env ;;
    -h | --help | help) usage ;;
    *) usage ;;
esac
