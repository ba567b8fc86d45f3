"""worker: the RQ render service. One worker process per device group holds one warm `MGPUController`,
takes render jobs from Redis, relays runner events into Redis Streams and uploads videos to S3.

Folders: `protocol` (shared with the producer), `jobs` (RQ bookkeeping), `uploads` (bytes only), `render`
(what a job does), `runtime` (how a worker runs), `ops` (what operators see), `dev` (development only; no
production module imports it). At the top: `job` (the RQ job function, `worker.job.render`) and `cli`
(`ltx-worker`). See docs/worker.md.
"""
