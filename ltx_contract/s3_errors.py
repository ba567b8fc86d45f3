"""S3 errors as one line that says what to fix. Imports nothing (not even botocore): the producer uses it
too, and must stay light."""

from __future__ import annotations

__all__ = ["s3_error_text"]
#: S3 error codes that mean the endpoint does not accept this key (a 403 on HEAD carries only "403").
_BAD_KEY_CODES = frozenset({"403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden"})


def s3_error_text(exc: Exception) -> str:
    """A botocore error as one line; a refused key says so (HeadBucket's 403 has no body, so botocore's
    own text is only "Forbidden", which reads like a permission on the bucket rather than a wrong key)."""
    text = " ".join(str(exc).split())
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if code in _BAD_KEY_CODES or status == 403:
        return (
            f"{text} (the endpoint refused the S3 key: check LTX_S3_ACCESS_KEY_ID and LTX_S3_SECRET_ACCESS_KEY "
            "(or their _FILE variants), and that this key may use the bucket)"
        )
    return text
