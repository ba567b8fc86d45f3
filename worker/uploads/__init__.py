"""Bytes only: the local spool a finished render waits in, the storage backends (S3, local directory) and the
uploader with retries. Imports neither redis nor rq (tests/test_import_contracts.py): what happens to the job
around an upload is `worker.stages.upload`'s business."""
