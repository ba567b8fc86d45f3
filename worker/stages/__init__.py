"""What happens to a rendered video after the fleet is done with it, beside the next job: the mp4 encode
(`encode`) and the background upload (`upload`). Both work on one `worker.jobs.attempt.JobAttempt` per job;
neither imports `worker.render`, which drives them (tests/test_import_contracts.py, `WORKER_LAYERS`)."""
