#!/usr/bin/env bash
# rgw.sh - a throwaway, single-node Ceph RADOS Gateway (S3 API) for tests.
#
#   rgw.sh start [DIR]   install Ceph (Debian packages) if needed, bootstrap a
#                        one-mon / one-OSD (memstore) / one-radosgw cluster in DIR
#                        and create the S3 test user. Idempotent.
#   rgw.sh stop  [DIR]   kill the daemons started from DIR and remove DIR.
#   rgw.sh env   [DIR]   print `export ...` lines for S3 clients.
#   rgw.sh status [DIR]  exit 0 if the S3 endpoint answers, 1 otherwise.
#   rgw.sh user NAME [DIR]  create S3 user NAME (if missing) on the running
#                        gateway and print `export ...` lines with its keys.
#   rgw.sh usage [DIR]   print the gateway's usage log (JSON: per bucket and
#                        operation, the requests and bytes sent), as tests count
#                        what clients fetched from the server.
#
# DIR defaults to /tmp/petatrain-rgw. Everything (config, mon/osd data, logs,
# pid files, admin sockets, the test CA) lives under DIR; /etc/ceph and
# /var/lib/ceph are not used. Everything binds to 127.0.0.1 only; Ceph's own
# authentication is off. The gateway serves S3 over plain HTTP and over TLS
# (a certificate for 127.0.0.1/localhost issued by a CA created at start, in
# DIR/tls/ca.pem), with SSE-C and SSE-KMS (the `testing` KMS backend) on.
#
# Environment:
#   PETATRAIN_RGW_PORT      S3 HTTP port            (default 7480)
#   PETATRAIN_RGW_TLS_PORT  S3 HTTPS port           (default: the HTTP port + 1)
#   PETATRAIN_RGW_MON_PORT  monitor msgr2 port      (default 3300)
#   PETATRAIN_RGW_TIMEOUT   seconds to wait for each daemon (default 120)
#
# Must run as root (installs packages; daemons run as root).

set -euo pipefail

PROG=$(basename "$0")
CMD=${1:-}
if [[ $CMD == user ]]; then
    USER_NAME=${2:-}
    DIR=${3:-/tmp/petatrain-rgw}
else
    DIR=${2:-/tmp/petatrain-rgw}
fi
PORT=${PETATRAIN_RGW_PORT:-7480}
TLS_PORT=${PETATRAIN_RGW_TLS_PORT:-}
MON_PORT=${PETATRAIN_RGW_MON_PORT:-3300}
TIMEOUT=${PETATRAIN_RGW_TIMEOUT:-120}

ACCESS_KEY=petatrain
SECRET_KEY=petatrain-secret
RGW_UID=petatrain
REGION=us-east-1
KMS_KEY_IDS=(testkey-1 testkey-2)   # keys of the `testing` KMS backend (random key material per start)
MARKER=.petatrain-rgw        # marks DIR as ours, so we only ever rm -rf our own dirs
CONF=$DIR/ceph.conf
CEPH_TIMEOUT=30              # per ceph CLI call
RGW_POOLS=(.rgw.root default.rgw.control default.rgw.meta default.rgw.log
    default.rgw.buckets.index default.rgw.buckets.data default.rgw.buckets.non-ec)

log() { echo "[$PROG] $*" >&2; }
die() { echo "[$PROG] ERROR: $*" >&2; exit 1; }

usage() {
    cat >&2 <<EOF
usage: $PROG {start|stop|env|status} [DIR]
       $PROG user NAME [DIR]
  DIR defaults to /tmp/petatrain-rgw; ports from PETATRAIN_RGW_PORT (default 7480)
  and PETATRAIN_RGW_TLS_PORT (default: PETATRAIN_RGW_PORT + 1)
EOF
    exit 2
}

check_args() {
    [[ $PORT =~ ^[0-9]+$ ]] || die "PETATRAIN_RGW_PORT must be a number, got '$PORT'"
    TLS_PORT=${TLS_PORT:-$((PORT + 1))}
    [[ $TLS_PORT =~ ^[0-9]+$ ]] || die "PETATRAIN_RGW_TLS_PORT must be a number, got '$TLS_PORT'"
    ((TLS_PORT != PORT)) || die "PETATRAIN_RGW_TLS_PORT must differ from PETATRAIN_RGW_PORT ($PORT)"
    [[ $MON_PORT =~ ^[0-9]+$ ]] || die "PETATRAIN_RGW_MON_PORT must be a number, got '$MON_PORT'"
    [[ $TIMEOUT =~ ^[0-9]+$ ]] || die "PETATRAIN_RGW_TIMEOUT must be a number, got '$TIMEOUT'"
    [[ $DIR == /* ]] || DIR=$(pwd)/$DIR
    DIR=${DIR%/}
    case "$DIR" in
        "" | / | /tmp | /root | /home | /usr | /var | /etc | /work | /work/main)
            die "refusing to use '$DIR' as the state directory" ;;
    esac
    CONF=$DIR/ceph.conf
    # unix sockets are limited to 107 bytes: $DIR/run/ceph-client.rgw.0.asok
    if ((${#DIR} > 70)); then
        die "DIR '$DIR' is too long (admin socket paths must stay under 108 bytes)"
    fi
}

endpoint() { echo "http://127.0.0.1:$PORT"; }
tls_endpoint() { echo "https://127.0.0.1:$TLS_PORT"; }

# 0 if something answers HTTP on the S3 port.
port_answers() {
    curl -s -o /dev/null --max-time 3 "$(endpoint)/" 2>/dev/null
}

# 0 if it answers *and* looks like RGW (an S3 XML listing / error).
rgw_answers() {
    local body
    body=$(curl -s --max-time 3 "$(endpoint)/" 2>/dev/null) || return 1
    [[ $body == *ListAllMyBucketsResult* || $body == *"<Error>"* ]]
}

# 0 if the TLS endpoint answers with a certificate the test CA verifies.
tls_answers() {
    local body
    [[ -f $DIR/tls/ca.pem ]] || return 1
    body=$(curl -s --max-time 3 --cacert "$DIR/tls/ca.pem" "$(tls_endpoint)/" 2>/dev/null) || return 1
    [[ $body == *ListAllMyBucketsResult* || $body == *"<Error>"* ]]
}

ceph_cli() {
    timeout $((CEPH_TIMEOUT + 10)) ceph -c "$CONF" --connect-timeout "$CEPH_TIMEOUT" "$@"
}

mon_answers() { # quick probe, for polling
    timeout 10 ceph -c "$CONF" --connect-timeout 5 mon stat
}

tcp_listening() { # tcp_listening <port>: 0 if something accepts connections on 127.0.0.1:<port>
    timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}

show_logs() {
    local f
    for f in "$DIR"/log/*.log; do
        [[ -f $f ]] || continue
        [[ -s $f ]] || continue
        echo "----- tail -n 15 $f -----" >&2
        tail -n 15 "$f" >&2 || true
    done
}

fail_start() { # report, show the logs, kill what was started; DIR is kept for inspection
    echo "[$PROG] ERROR: $*" >&2
    show_logs
    kill_daemons || true
    echo "[$PROG] ERROR: $* (daemons killed; logs kept in $DIR/log, '$0 stop $DIR' removes them)" >&2
    exit 1
}

need_root() {
    [[ $(id -u) == 0 ]] || die "must run as root (installs packages, runs ceph daemons)"
}

install_if_missing() {
    local missing=0 b
    for b in radosgw radosgw-admin ceph-mon ceph-osd monmaptool ceph curl; do
        command -v "$b" >/dev/null 2>&1 || missing=1
    done
    ((missing)) || return 0
    command -v apt-get >/dev/null 2>&1 || die "Ceph is not installed and apt-get is not available"
    log "installing ceph-mon ceph-osd radosgw (Debian packages) ..."
    export DEBIAN_FRONTEND=noninteractive
    # another install (the suite's Barbican, Prometheus, Java) may hold dpkg's lock: wait for it
    apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null || die "apt-get update failed"
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends ceph-mon ceph-osd radosgw curl ca-certificates uuid-runtime \
        >"${TMPDIR:-/tmp}/petatrain-rgw-apt.log" 2>&1 ||
        { tail -n 30 "${TMPDIR:-/tmp}/petatrain-rgw-apt.log" >&2; die "apt-get install failed"; }
    command -v radosgw >/dev/null 2>&1 || die "radosgw still not on PATH after installing"
}

# pid of daemon <name> from its pid file, only if it is alive and really is a
# ceph daemon running with our config file (pid files can be stale / reused).
our_pid() {
    local f=$DIR/run/$1.pid pid
    [[ -f $f ]] || return 1
    pid=$(tr -dc 0-9 <"$f" || true)
    [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$CONF" || return 1
    echo "$pid"
}

# kill the daemons started from DIR. The state is thrown away anyway, so no
# orderly shutdown is needed: SIGTERM all, wait up to 1 s, then SIGKILL (a
# radosgw or OSD whose monitor is gone can take a long time to exit).
kill_daemons() {
    local pid name pids=() i alive
    [[ -d $DIR/run ]] || return 0
    for name in client.rgw.0 osd.0 mon.a; do
        if pid=$(our_pid "$name"); then pids+=("$pid"); fi
    done
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do
        alive=()
        for pid in "${pids[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then alive+=("$pid"); fi
        done
        ((${#alive[@]})) || return 0
        if ((i == 10)); then kill -KILL "${alive[@]}" 2>/dev/null || true; fi
        sleep 0.1
    done
    die "could not kill daemons: ${alive[*]}"
}

wipe_dir() {
    [[ -e $DIR ]] || return 0
    if [[ -d $DIR && ! -e $DIR/$MARKER && -n $(ls -A "$DIR" 2>/dev/null) ]]; then
        die "'$DIR' exists, is not empty and was not created by $PROG; refusing to delete it"
    fi
    rm -rf -- "$DIR"
}

# The test CA and the gateway's certificate (127.0.0.1 and localhost), in DIR/tls:
# ca.pem is the bundle clients verify the TLS endpoint with. EC P-256 keys: ~10 ms.
make_tls() {
    local tls=$DIR/tls
    mkdir -p "$tls"
    openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
        -keyout "$tls/ca.key" -out "$tls/ca.pem" -days 30 -subj "/CN=petatrain test CA (rgw.sh)" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        >>"$DIR/log/mkfs.log" 2>&1 || fail_start "openssl: creating the test CA failed"
    openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
        -keyout "$tls/server.key" -out "$tls/server.csr" -subj "/CN=127.0.0.1" \
        >>"$DIR/log/mkfs.log" 2>&1 || fail_start "openssl: creating the server key failed"
    printf '%s\n' "subjectAltName = IP:127.0.0.1, DNS:localhost" \
        "basicConstraints = critical, CA:FALSE" "keyUsage = critical, digitalSignature, keyEncipherment" \
        "extendedKeyUsage = serverAuth" "subjectKeyIdentifier = hash" "authorityKeyIdentifier = keyid, issuer" \
        >"$tls/server.ext"
    openssl x509 -req -in "$tls/server.csr" -CA "$tls/ca.pem" -CAkey "$tls/ca.key" -CAcreateserial \
        -days 30 -extfile "$tls/server.ext" -out "$tls/server.pem" \
        >>"$DIR/log/mkfs.log" 2>&1 || fail_start "openssl: signing the server certificate failed"
    chmod 600 "$tls/ca.key" "$tls/server.key"
}

# `testing` KMS backend keys: "id=base64(32 bytes) ...", fresh random material per start
kms_keys() {
    local id out=()
    for id in "${KMS_KEY_IDS[@]}"; do
        out+=("$id=$(head -c 32 /dev/urandom | base64 -w0)")
    done
    echo "${out[*]}"
}

write_conf() {
    local fsid=$1
    cat >"$CONF" <<EOF
# generated by $PROG - throwaway single-node Ceph cluster for tests
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$MON_PORT
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
ms bind ipv6 = false

auth cluster required = none
auth service required = none
auth client required = none
keyring = $DIR/keyring

run dir = $DIR/run
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
mon cluster log file = $DIR/log/cluster.log
log to stderr = false
err to stderr = true
log to syslog = false
crash dir = $DIR/crash

osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim = false
mon warn on insecure global id reclaim allowed = false
mon data avail warn = 2
mon data avail crit = 1

[mon]
admin socket = $DIR/run/\$name.asok
mon data = $DIR/mon/\$name
# throwaway cluster: commit map changes quickly (default 1 s) - faster pool creation/OSD boot
paxos propose interval = 0.05
paxos min wait = 0.01

[osd]
admin socket = $DIR/run/\$name.asok
osd data = $DIR/osd/\$name
osd objectstore = memstore
# capacity the OSD *reports*; memstore does not enforce it (and with no mgr
# there are no full flags): RAM use is ~2x the data currently stored.
memstore device bytes = 2147483648
# minimum allowed value (smaller values are ignored); only sizes BlueStore caches
osd memory target = 939524096
osd class dir = /usr/lib/x86_64-linux-gnu/rados-classes
osd op num shards = 1
osd op num threads per shard = 2
osd crush update on start = true

[client.rgw.0]
# radosgw defaults to ms_mon_client_mode=secure, which needs cephx; with auth
# off it then fails with "get_initial_auth_request returned -13" (EACCES)
ms mon client mode = crc
rgw init timeout = $((TIMEOUT > 30 ? TIMEOUT : 30))
admin socket = $DIR/run/\$name.asok
rgw data = $DIR/rgw
# plain HTTP and TLS side by side; the certificate is issued by DIR/tls/ca.pem
rgw frontends = beast endpoint=127.0.0.1:$PORT ssl_endpoint=127.0.0.1:$TLS_PORT ssl_certificate=$DIR/tls/server.pem ssl_private_key=$DIR/tls/server.key tcp_nodelay=1
# server-side encryption: SSE-C, and SSE-KMS with the "testing" backend (keys named
# in this file; never use it outside tests). RGW refuses SSE requests over plain
# HTTP by default; off here so that a client's own refusal (petatrain's
# storage.allow_http) is what a test sees.
rgw crypt s3 kms backend = testing
rgw crypt s3 kms encryption keys = $(kms_keys)
rgw crypt require ssl = false
rgw thread pool size = 32
rgw dns name = localhost
# the usage log: what each bucket served (rgw.sh usage), flushed every second
rgw enable usage log = true
rgw usage log tick interval = 1
rgw usage log flush threshold = 1
rgw enable ops log = false
# deleted/overwritten object data is garbage-collected by RGW, by default only
# after 2 h (and the GC runs hourly): with memstore that is RAM held for hours.
rgw gc obj min wait = 0
rgw gc processor period = 15
EOF
    # osd class dir differs per architecture; let ceph use its compiled default elsewhere
    local classdir
    classdir=$(ceph-conf --show-config-value osd_class_dir 2>/dev/null || true)
    if [[ -n $classdir ]]; then
        sed -i "s|^osd class dir = .*|osd class dir = $classdir|" "$CONF"
    else
        sed -i '/^osd class dir = /d' "$CONF"
    fi
}

wait_for() { # wait_for <what> <command...>; polls up to $TIMEOUT s
    local what=$1 t0=$SECONDS
    shift
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS - t0 >= TIMEOUT)); then
            fail_start "timed out after ${TIMEOUT}s waiting for $what"
        fi
        sleep 0.5
    done
}

osd_up() {
    ceph_cli osd dump -f json 2>/dev/null | grep -q '"up":1'
}

ensure_user() {
    local out
    if radosgw-admin -c "$CONF" user info --uid="$RGW_UID" >/dev/null 2>&1; then
        return 0
    fi
    out=$(radosgw-admin -c "$CONF" user create --uid="$RGW_UID" \
        --display-name="petatrain tests" --access-key="$ACCESS_KEY" --secret-key="$SECRET_KEY" 2>&1) ||
        { echo "$out" >&2; fail_start "radosgw-admin user create failed"; }
}

# the user must also be usable through the HTTP endpoint (radosgw caches users)
wait_user_ok() { # wait_user_ok <uid> <access key> <secret key>; 1 if they fail for 30 s
    local t0=$SECONDS
    while :; do
        # /usr/bin/python3 is a dependency of the ceph CLI; stdlib only
        if /usr/bin/python3 - "$(endpoint)" "$2" "$3" <<'PY' 2>/dev/null; then
import sys, hmac, hashlib, base64, email.utils, urllib.request
ep, ak, sk = sys.argv[1:4]
date = email.utils.formatdate(usegmt=True)
sig = base64.b64encode(hmac.new(sk.encode(), f"GET\n\n\n{date}\n/".encode(), hashlib.sha1).digest()).decode()
req = urllib.request.Request(ep + "/", headers={"Date": date, "Authorization": f"AWS {ak}:{sig}"})
with urllib.request.urlopen(req, timeout=5) as r:
    sys.exit(0 if r.status == 200 else 1)
PY
            return 0
        fi
        ((SECONDS - t0 < 30)) || return 1
        sleep 0.5
    done
}

cmd_start() {
    need_root
    if rgw_answers; then
        log "already running: $(endpoint) answers"
        if [[ -f $CONF ]] && command -v radosgw-admin >/dev/null 2>&1; then
            ensure_user
        else
            log "warning: $CONF does not exist - this RGW was not started from $DIR"
        fi
        tls_answers || log "warning: $(tls_endpoint) does not answer with a certificate from $DIR/tls/ca.pem"
        return 0
    fi
    # stale state from an earlier run: kill what it left behind, then wipe it
    if [[ -e $DIR ]]; then
        log "removing stale state in $DIR"
        if [[ -e $DIR/$MARKER ]]; then kill_daemons; fi
        wipe_dir
    fi
    if port_answers; then
        die "port $PORT is taken by something that is not RGW; set PETATRAIN_RGW_PORT"
    fi
    if tcp_listening "$TLS_PORT"; then
        die "TLS port 127.0.0.1:$TLS_PORT is taken; set PETATRAIN_RGW_TLS_PORT"
    fi
    if tcp_listening "$MON_PORT"; then
        die "monitor port 127.0.0.1:$MON_PORT is taken (another Ceph cluster?); set PETATRAIN_RGW_MON_PORT"
    fi
    install_if_missing

    local t0=$SECONDS fsid osd_uuid osd_id
    mkdir -p "$DIR"/{run,log,mon/mon.a,osd/osd.0,rgw,crash}
    : >"$DIR/$MARKER"
    fsid=$(cat /proc/sys/kernel/random/uuid)
    write_conf "$fsid"
    make_tls
    # with auth off the keyring is unused, but ceph-mon --mkfs wants one
    ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null

    # ---- monitor
    monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$MON_PORT]" "$DIR/monmap" >/dev/null ||
        fail_start "monmaptool failed"
    ceph-mon -c "$CONF" -i a --mkfs --monmap "$DIR/monmap" --keyring "$DIR/keyring" \
        --mon-data "$DIR/mon/mon.a" 2>>"$DIR/log/mkfs.log" || fail_start "ceph-mon --mkfs failed"
    ceph-mon -c "$CONF" -i a 2>>"$DIR/log/daemons.log" 9<&- || fail_start "ceph-mon failed to start"
    wait_for "the monitor (port $MON_PORT)" mon_answers
    log "monitor up ($((SECONDS - t0))s)"
    # radosgw would create its pools itself, lazily (~2 s each: the first bucket
    # creation and the first upload stall). Create them now, in the background
    # while the OSD boots, with one ceph CLI process (commands read from stdin).
    local pool pools_pid
    for pool in "${RGW_POOLS[@]}"; do
        printf 'osd pool create %s 8 8\nosd pool application enable %s rgw\n' "$pool" "$pool"
    done | ceph_cli >>"$DIR/log/mkfs.log" 2>&1 &
    pools_pid=$!

    # ---- OSD (memstore: all objects live in RAM)
    osd_uuid=$(cat /proc/sys/kernel/random/uuid)
    osd_id=$(ceph_cli osd create "$osd_uuid" 2>>"$DIR/log/mkfs.log") || fail_start "ceph osd create failed"
    [[ $osd_id == 0 ]] || fail_start "expected osd id 0, got '$osd_id'"
    ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$osd_uuid" --osd-data "$DIR/osd/osd.0" \
        >>"$DIR/log/mkfs.log" 2>&1 || fail_start "ceph-osd --mkfs failed"
    ceph-osd -c "$CONF" -i 0 --osd-data "$DIR/osd/osd.0" 2>>"$DIR/log/daemons.log" 9<&- ||
        fail_start "ceph-osd failed to start"
    wait_for "osd.0 to be up" osd_up
    log "osd.0 up ($((SECONDS - t0))s)"

    wait "$pools_pid" || fail_start "creating the RGW pools failed"
    local have
    have=$(ceph_cli osd pool ls 2>>"$DIR/log/mkfs.log") || fail_start "ceph osd pool ls failed"
    for pool in "${RGW_POOLS[@]}"; do
        grep -qxF -- "$pool" <<<"$have" || fail_start "pool $pool was not created"
    done
    log "pools created ($((SECONDS - t0))s)"

    # ---- radosgw
    radosgw -c "$CONF" -n client.rgw.0 2>>"$DIR/log/daemons.log" 9<&- || fail_start "radosgw failed to start"
    local tw=$SECONDS
    until rgw_answers; do
        our_pid client.rgw.0 >/dev/null || fail_start "radosgw exited during startup"
        ((SECONDS - tw < TIMEOUT)) || fail_start "timed out after ${TIMEOUT}s waiting for $(endpoint)"
        sleep 0.5
    done
    until tls_answers; do
        ((SECONDS - tw < TIMEOUT)) || fail_start "timed out after ${TIMEOUT}s waiting for $(tls_endpoint)"
        sleep 0.2
    done
    ensure_user
    wait_user_ok "$RGW_UID" "$ACCESS_KEY" "$SECRET_KEY" ||
        fail_start "user '$RGW_UID' exists but S3 requests with its keys fail"
    log "RGW up at $(endpoint) and $(tls_endpoint) in $((SECONDS - t0))s (state in $DIR; access key '$ACCESS_KEY')"
}

cmd_stop() {
    if [[ -e $DIR ]]; then
        if [[ -e $DIR/$MARKER ]]; then
            kill_daemons
        fi
        wipe_dir
        log "stopped; removed $DIR"
    else
        log "nothing to stop ($DIR does not exist)"
    fi
}

cmd_env() {
    cat <<EOF
export AWS_ACCESS_KEY_ID=$ACCESS_KEY
export AWS_SECRET_ACCESS_KEY=$SECRET_KEY
export AWS_ENDPOINT_URL=$(endpoint)
export AWS_REGION=$REGION
export AWS_DEFAULT_REGION=$REGION
export AWS_REQUEST_CHECKSUM_CALCULATION=WHEN_REQUIRED
export AWS_RESPONSE_CHECKSUM_VALIDATION=WHEN_REQUIRED
export PETATRAIN_TEST_S3_TLS_ENDPOINT=$(tls_endpoint)
export PETATRAIN_TEST_S3_CA_BUNDLE=$DIR/tls/ca.pem
export PETATRAIN_TEST_S3_KMS_KEY_ID=${KMS_KEY_IDS[0]}
EOF
}

# An S3 identity besides the bucket owner (e.g. ingest, train, serve for role policies):
# created with generated keys if missing; prints its keys and its principal ARN.
cmd_user() {
    need_root
    [[ $USER_NAME =~ ^[a-z][a-z0-9-]{0,31}$ ]] ||
        die "user NAME: lowercase letters, digits and '-', starting with a letter; got '$USER_NAME'"
    [[ -f $CONF ]] || die "$CONF does not exist: start the gateway first ('$PROG start $DIR')"
    rgw_answers || die "$(endpoint) does not answer: start the gateway first ('$PROG start $DIR')"
    local info keys
    if ! info=$(radosgw-admin -c "$CONF" user info --uid="$USER_NAME" 2>/dev/null); then
        info=$(radosgw-admin -c "$CONF" user create --uid="$USER_NAME" \
            --display-name="petatrain test identity $USER_NAME" 2>&1) ||
            { echo "$info" >&2; die "radosgw-admin user create $USER_NAME failed"; }
    fi
    keys=$(/usr/bin/python3 -c '
import json, sys
key = json.load(sys.stdin)["keys"][0]
print(key["access_key"], key["secret_key"])' <<<"$info") || die "cannot read the keys of user $USER_NAME"
    set -- $keys
    wait_user_ok "$USER_NAME" "$1" "$2" || die "user '$USER_NAME' exists but S3 requests with its keys fail"
    cat <<EOF
export AWS_ACCESS_KEY_ID=$1
export AWS_SECRET_ACCESS_KEY=$2
export PETATRAIN_TEST_S3_PRINCIPAL=arn:aws:iam:::user/$USER_NAME
EOF
}

cmd_usage() {
    [[ -f $CONF ]] || die "$CONF does not exist: start the gateway first ('$PROG start $DIR')"
    radosgw-admin -c "$CONF" usage show --show-log-entries=true 2>/dev/null ||
        die "radosgw-admin usage show failed"
}

cmd_status() {
    if rgw_answers; then
        log "running: $(endpoint)"
    else
        log "not running ($(endpoint) does not answer)"
        return 1
    fi
}

# serialize start/stop (e.g. parallel test workers all calling start). The
# daemons are started with fd 9 closed so that they do not inherit the lock.
lock() {
    if command -v flock >/dev/null 2>&1; then
        exec 9<"${BASH_SOURCE[0]}"
        flock 9
    fi
}

case "$CMD" in
    start) check_args; lock; cmd_start ;;
    stop) check_args; lock; cmd_stop ;;
    env) check_args; cmd_env ;;
    status) check_args; cmd_status ;;
    user) check_args; lock; cmd_user ;;
    usage) check_args; cmd_usage ;;
    -h | --help | help) usage ;;
    *) usage ;;
esac
