#!/bin/sh
# Start SeaweedFS with two S3 identities built from secret files, then exec `weed "$@"`.
#
# Used as the compose S3 service's entrypoint (docker-compose.yml) and by hand (docs/operations.md):
#   LTX_S3_SECRETS=./secrets WEED=weed scripts/s3-start.sh server -dir=/var/lib/ltx-s3 ...
#
# - worker identity (s3_worker_access_key/_secret_key): Read, Write, List and Admin on the bucket only
#   (Admin lets the worker create the bucket at start, LTX_S3_CREATE_BUCKET; Write covers multipart);
# - producer identity (s3_producer_access_key/_secret_key): Read on the bucket's objects only (GET/HEAD:
#   `producer fetch`, and the result URLs the worker signs with this key). `Read:<bucket>/*`, not
#   `Read:<bucket>`: SeaweedFS counts ListMultipartUploads as Read, and on the whole bucket it listed every
#   upload in progress (its key names the job and render id) and its upload id (ListParts needs one);
#   scoped to the objects, the bucket-level listing is denied;
# - the S3 gateway's gRPC port requires a client certificate nobody can make (s3_grpc_*; see
#   scripts/secrets.sh), through a security.toml in the working directory, where weed looks first.
#
# The secrets are never on a command line or in the environment: they go from the files into the identity
# file, in a private directory (LTX_S3_CONF_DIR, default a fresh temporary one). weed reads that file
# more than once while it starts (a named pipe does not do), so a watcher beside weed deletes it as soon
# as the S3 API answers /healthz (the identities are loaded by then), and the whole directory if it is a
# temporary one; if weed exits first, the watcher deletes them then. It needs wget or curl (the SeaweedFS
# image has wget); without either the file stays, with a warning. When weed ends, however it ends, the
# watcher deletes the sockets and /tmp logs weed leaves. tests/test_s3_gateway.py checks that nothing is
# left, that no ERROR is logged, and that the identities and the gRPC lock still hold.
set -eu
secrets=${LTX_S3_SECRETS:-/run/secrets}
bucket=${LTX_S3_BUCKET:-videos}
umask 077
# The ports weed's services listen on (flag, else default; gRPC: flag, else port + 10000), as "flag=port"
# words: checked below before anything is written, and a killed weed leaves
# /tmp/seaweedfs-<service>[-grpc]-<port>.sock for them (only a graceful stop, 25 s of weed's timers, removes them).
weed_ports=
port_flags=
for spec in master:9333 volume:8080 filer:8888 s3:8333; do
    service=${spec%%:*}
    p=${spec#*:}
    g=
    for arg in "$@"; do
        case "$arg" in
            "-$service.port="*) p=${arg#*=} ;;
            "-$service.port.grpc="*) g=${arg#*=} ;;
        esac
    done
    case "$p$g" in *[!0-9]*) continue ;; esac
    weed_ports="$weed_ports $p ${g:-$((p + 10000))}"
    port_flags="$port_flags -$service.port=$p -$service.port.grpc=${g:-$((p + 10000))}"
done
# A port something already listens on ends the start here, in one line naming it: weed would die on it
# with a Go stack trace, after binding some of the others. Read from the kernel's socket tables (Linux
# /proc/net/tcp*: every listener of this network namespace, any address), so it needs no tool weed's image
# lacks. (A port taken between this check and weed's bind still gets weed's own error.)
listening=" $(awk '$4 == "0A" { n = split($2, a, ":"); printf "%s ", a[n] }' /proc/net/tcp /proc/net/tcp6 2> /dev/null || true)"
taken=
for word in $port_flags; do
    p=${word#*=}
    case "$listening" in *" $(printf '%04X' "$p") "*) taken="${taken:+$taken, }$p (${word%%=*})" ;; esac
done
if [ -n "$taken" ]; then
    echo "s3-start: in use, weed not started: $taken; free it or give weed another port with that flag" >&2
    exit 2
fi

if [ -n "${LTX_S3_CONF_DIR:-}" ]; then
    conf=$LTX_S3_CONF_DIR
    own_conf=
    mkdir -p "$conf"
else
    conf=$(mktemp -d)
    own_conf=1
fi

read_key() {
    value=$(tr -d ' \r\n' < "$secrets/$1")
    case "$value" in
        '' | *[!A-Za-z0-9_+/=-]*)
            echo "s3-start: $secrets/$1 must hold one key of letters, digits and _+/=- (scripts/secrets.sh)" >&2
            exit 2 ;;
    esac
    printf '%s' "$value"
}
case "$bucket" in
    '' | *[!a-z0-9.-]*) echo "s3-start: bucket name '$bucket' is not a plain S3 bucket name" >&2; exit 2 ;;
esac
for f in s3_grpc_ca s3_grpc_cert s3_grpc_key; do
    [ -s "$secrets/$f" ] || { echo "s3-start: $secrets/$f missing (run scripts/secrets.sh)" >&2; exit 2; }
done

printf '{"identities": [
  {"name": "ltx-worker", "credentials": [{"accessKey": "%s", "secretKey": "%s"}],
   "actions": ["Read:%s", "Write:%s", "List:%s", "Admin:%s"]},
  {"name": "ltx-producer", "credentials": [{"accessKey": "%s", "secretKey": "%s"}],
   "actions": ["Read:%s/*"]}
]}\n' "$(read_key s3_worker_access_key)" "$(read_key s3_worker_secret_key)" \
    "$bucket" "$bucket" "$bucket" "$bucket" \
    "$(read_key s3_producer_access_key)" "$(read_key s3_producer_secret_key)" "$bucket" \
    > "$conf/identities.json"

# The filer's signing key: a fresh random one per start (JWTs it signs live seconds; nothing stored needs
# it again). Without one, weed logs an ERROR at every start (its STS service has no key) and leaves the
# filer's IAM gRPC service unauthenticated.
filer_key=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
printf '[jwt.filer_signing]\nkey = "%s"\n\n[grpc]\nca = "%s"\n\n[grpc.s3]\ncert = "%s"\nkey = "%s"\n' "$filer_key" \
    "$secrets/s3_grpc_ca" "$secrets/s3_grpc_cert" "$secrets/s3_grpc_key" > "$conf/security.toml"

# Where the S3 API answers: -s3.port (default 8333) on -s3.ip.bind (every interface: loopback).
port=8333
host=127.0.0.1
for arg in "$@"; do
    case "$arg" in
        -s3.port=*) port=${arg#-s3.port=} ;;
        -s3.ip.bind=*) host=${arg#-s3.ip.bind=} ;;
    esac
done
case "$host" in '' | 0.0.0.0 | ::) host=127.0.0.1 ;; esac
if command -v wget > /dev/null 2>&1; then
    probe="wget -q -T 2 -O /dev/null"
elif command -v curl > /dev/null 2>&1; then
    probe="curl -fsS -m 2 -o /dev/null"
else
    probe=
    echo "s3-start: neither wget nor curl: $conf/identities.json (the S3 keys) stays while weed runs" >&2
fi
weed_pid=$$  # (after `exec`, this shell's pid is weed's)
# The watcher: deletes the identities once the S3 API answers, then waits for weed to end and deletes what
# weed leaves outside its folders: the sockets of its ports and, when no -dir gave its logs a folder, its
# log files in $TMPDIR (weed.<host>.<user>.log.<level>.<time>.<its pid>, and the weed.<LEVEL> links to them).
# Started through a subshell that exits at once, so the watcher is not weed's child: weed never reaps
# children it did not start, and a watcher that ended stayed <defunct> beside it for weed's lifetime.
( (
    if [ -n "$probe" ]; then
        while kill -0 "$weed_pid" 2> /dev/null && ! $probe "http://$host:$port/healthz" 2> /dev/null; do
            sleep 0.2
        done
        rm -f "$conf/identities.json"
        if [ -n "$own_conf" ]; then rm -rf "$conf"; fi
    fi
    while kill -0 "$weed_pid" 2> /dev/null; do sleep 1; done
    if [ -z "$probe" ]; then
        rm -f "$conf/identities.json"
        if [ -n "$own_conf" ]; then rm -rf "$conf"; fi
    fi
    for p in $weed_ports; do
        for sock in /tmp/seaweedfs-*-"$p".sock; do
            if [ -S "$sock" ]; then rm -f "$sock"; fi
        done
    done
    tmp=${TMPDIR:-/tmp}
    rm -f "$tmp"/weed.*.log.*."$weed_pid"
    for level in INFO WARNING ERROR FATAL; do
        if [ -L "$tmp/weed.$level" ] && [ ! -e "$tmp/weed.$level" ]; then rm -f "$tmp/weed.$level"; fi
    done
) < /dev/null > /dev/null 2>&1 & )

# weed's own log files go to <-dir>/logs (by default they pile up in /tmp as weed.<host>.<user>.log.*).
logdir=
for arg in "$@"; do
    case "$arg" in -dir=*) logdir=${arg#-dir=}/logs ;; esac
done
cd "$conf"
if [ -n "$logdir" ]; then
    mkdir -p "$logdir"
    exec "${WEED:-weed}" -logdir="$logdir" "$@" -s3.config="$conf/identities.json"
fi
exec "${WEED:-weed}" "$@" -s3.config="$conf/identities.json"
