"""`HandOff`: what the render job returns to RQ when the video goes on to the background encoder and
uploader (`LTX_UPLOAD_PIPELINE`, `worker.stages.upload`). RQ stores it as the execution's result and marks
the job `finished` while the service state is `rendering` (video still encoding) or `rendered` (in the
spool); once the object is confirmed, `worker.rq.record.JobRecord.record_success_after_return` deletes it and
records the full upload result in its place.

It deliberately carries no `sha256` or `url`, so nothing takes it for an upload result
(`producer.models.looks_uploaded`); `upload` (always `pending`) is what marks a result as a hand-off.
`to_json()` is the JSON RQ stores (`encode` only while encoding; `key` and `bytes` once in the spool);
`HandOff.read(value)` gives the hand-off a stored result is, or None for any other result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ltx_contract.typed_json import OMIT_NONE, SnapshotError, dump, load

__all__ = ["HandOff"]


@dataclass(frozen=True)
class HandOff:
    job_id: str
    state: str  #: `rendering` (the encoder has the frames) or `rendered` (the video is in the spool)
    encode: str | None = field(default=None, metadata=OMIT_NONE)  #: `pending` while the video is encoded
    upload: str = "pending"
    key: str | None = field(default=None, metadata=OMIT_NONE)  #: the object key it will be uploaded to
    bytes: int | None = field(default=None, metadata=OMIT_NONE)  #: the video's size
    render_s: float | None = None
    worker: str | None = None  #: the RQ worker name

    def to_json(self) -> dict[str, Any]:
        return dump(self)

    @classmethod
    def from_json(cls, data: Any) -> HandOff:
        return load(cls, data, "hand-off")

    @classmethod
    def read(cls, value: Any) -> HandOff | None:
        """The hand-off `value` (an RQ result's return value) is; None if it is another result."""
        if not isinstance(value, dict) or not value.get("upload"):
            return None
        try:
            return cls.from_json(value)
        except SnapshotError:
            return None
