#!/bin/sh
# Create the secret files the compose Redis and S3 services, the worker, the producer and the dashboard read
# (docker-compose.yml, `secrets:`), in DIR (default ./secrets next to docker-compose.yml). Existing files are kept, so running it
# again never rotates a key under a running service; delete a file to rotate that one.
#
#   redis_worker_password                            the Redis `worker` user (workers, the dashboard)
#   redis_tenant_password                            the Redis user of the producer's tenant (LTX_CLIENT)
#   redis_admin_password                             the Redis `admin` user: ACL LOAD, ACL LOG (operators)
#   s3_worker_access_key / s3_worker_secret_key      the worker's S3 identity: read and write the bucket
#   s3_producer_access_key / s3_producer_secret_key  the producer's identity: read objects only
#   s3_grpc_ca, s3_grpc_cert, s3_grpc_key            a lock on the S3 gateway's gRPC port (see below)
#
# Why the gRPC lock: SeaweedFS binds its S3 gateway's gRPC port on the same address as the S3 API, and that
# port accepts identity updates without authentication (measured with weed 4.48: one PutIdentity call adds
# an admin key). It is made to require a client certificate signed by s3_grpc_ca, whose private key this
# script deletes right after signing the server's certificate: no client certificate can ever be made, so
# nobody can use that port (the service does not need it: its identities come from a file at start).
#
# Needs openssl. Keys are hex, so they need no quoting anywhere.
set -eu
dir=${1:-secrets}
umask 077
mkdir -p "$dir"
chmod 700 "$dir"

secret() { # name bytes
    if [ ! -s "$dir/$1" ]; then
        openssl rand -hex "$2" > "$dir/$1"
        echo "created $dir/$1"
    fi
}
secret redis_worker_password 24
secret redis_tenant_password 24
secret redis_admin_password 24
secret s3_worker_access_key 10
secret s3_worker_secret_key 24
secret s3_producer_access_key 10
secret s3_producer_secret_key 24

if [ ! -s "$dir/s3_grpc_cert" ] || [ ! -s "$dir/s3_grpc_key" ] || [ ! -s "$dir/s3_grpc_ca" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    # shellcheck disable=SC2086
    openssl req -x509 $ec -keyout "$work/ca.key" -out "$dir/s3_grpc_ca" -days 36500 \
        -subj "/CN=ltx-s3-grpc-lock" 2>/dev/null
    # shellcheck disable=SC2086
    openssl req $ec -keyout "$dir/s3_grpc_key" -out "$work/s3.csr" -subj "/CN=s3" 2>/dev/null
    openssl x509 -req -in "$work/s3.csr" -CA "$dir/s3_grpc_ca" -CAkey "$work/ca.key" -CAcreateserial \
        -CAserial "$work/ca.srl" -out "$dir/s3_grpc_cert" -days 36500 2>/dev/null
    rm -f "$work/ca.key"  # the lock's key: gone, so no client certificate can be signed
    echo "created $dir/s3_grpc_ca, $dir/s3_grpc_cert, $dir/s3_grpc_key"
fi
# Each file readable by its owner only (0600; files an older version left 0644 too), the folder private.
# Compose mounts each file into the containers that need it with these modes (file secrets are bind
# mounts: compose's uid/gid/mode do not apply to them): its non-root containers run as uid 1000, so run this
# as uid 1000, or as root with SECRETS_OWNER=1000 (the files then belong to that uid; the folder stays
# root's, so no one on the host but root reaches them).
chmod 600 "$dir"/s3_* "$dir"/redis_*
if [ -n "${SECRETS_OWNER:-}" ]; then
    chown "$SECRETS_OWNER" "$dir"/s3_* "$dir"/redis_*
fi
