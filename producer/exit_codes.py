"""The producer's exit codes: one meaning each, so scripts can branch on `$?` without parsing text.

The table is printed in `producer --help` and in docs/producer.md; a test keeps the two in sync.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["EXIT_CODE_HELP", "ExitCode"]


class ExitCode(IntEnum):
    OK = 0  #: done; for watch/fetch/backfill: every job finished successfully
    JOB_FAILED = 1  #: the job (or, for backfill, at least one job) ended failed
    USAGE = 2  #: user error: bad request file, unknown field, value out of range, bad flag, job id or setting
    REFUSED = 3  #: admission control refused the submit: queue full or client quota used up
    CANCELLED = 4  #: the job ended stopped or cancelled
    NOT_FOUND = 5  #: no such job (never submitted, or expired from Redis)
    UNAVAILABLE = 6  #: Redis or S3 unreachable or refusing us (credentials, database, not Redis), object missing
    INTEGRITY = 7  #: downloaded bytes do not match the sha256 the worker recorded
    NOT_FINISHED = 8  #: the job has not ended yet (`watch --timeout` ran out, `fetch` of a running job)
    INTERRUPTED = 130  #: Ctrl+C (backfill can be resumed by running it again)


EXIT_CODE_HELP = "\n".join(
    f"  {code.value:>3}  {code.name.lower().replace('_', ' ')}: {text}"
    for code, text in [
        (ExitCode.OK, "success (watch/fetch: the job finished; backfill: all jobs finished)"),
        (ExitCode.JOB_FAILED, "the job failed (backfill: at least one job failed)"),
        (
            ExitCode.USAGE,
            "user error: unreadable/invalid request file, unknown field, bad value, flag, job id or "
            "setting; fetch from an endpoint that is not configured",
        ),
        (ExitCode.REFUSED, "refused by admission control (queue full or client quota reached)"),
        (ExitCode.CANCELLED, "the job was cancelled or stopped"),
        (ExitCode.NOT_FOUND, "no such job (never submitted, or expired)"),
        (
            ExitCode.UNAVAILABLE,
            "Redis or S3 unreachable, or refusing us (credentials, ACL, no such database, "
            "not Redis at all), or the video object is missing",
        ),
        (ExitCode.INTEGRITY, "downloaded video does not match its recorded sha256"),
        (ExitCode.NOT_FINISHED, "the job has not ended yet (watch --timeout ran out; fetch of an unfinished job)"),
        (ExitCode.INTERRUPTED, "interrupted by Ctrl+C (backfill resumes when run again)"),
    ]
)
