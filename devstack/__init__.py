"""Development infrastructure, never imported by production code (tests/test_import_contracts.py): private Redis
and SeaweedFS servers, a TLS/ACL Redis, the compose-like S3 gateway, a TCP fault proxy, and `ltx-demo`."""
