"""worker: the RQ render service. One worker process per device group holds one warm `MGPUController`,
takes render jobs from Redis, relays runner events into Redis Streams and uploads videos to S3.

What it shares with clients is the client contract, `ltx_contract` (the producer imports that, never this).
Folders, lowest layer first (each imports only the ones before it: tests/test_import_contracts.py):
`errors` (`WorkerError`, the root of every worker exception), `protocol` (the RQ job class, RQ internals, the relay),
`settings` (every knob), `ops` (what operators see), `uploads` (bytes only), `jobs` (RQ bookkeeping), `render`
(what a job does), then `job` (the RQ job function, `worker.job.render`), `runtime` (how a worker runs) and
`cli` (`ltx-worker`). Development servers and the demo live outside the production tree, in `devstack/`.
See docs/worker.md.
"""
