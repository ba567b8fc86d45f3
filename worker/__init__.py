"""worker: the RQ render service. One worker process per device group holds one warm `MGPUController`,
takes render jobs from Redis, relays runner events into Redis Streams and uploads videos to S3.

Modules: `settings` (configuration), `keys` (Redis names, states, failure reasons; stdlib only),
`schema` (the request), `job` (the RQ job function), `service` (what a job does), `rqworker` (the RQ
worker class), `fleet` (controller supervision), `relay` (events + meta summary), `spool`, `storage`,
`uploader`, `metrics`, `logs`, `process` (one worker process), `supervisor` + `cli` (`ltx-worker`),
`control` (cancel, for any client), `outcomes` (how a job's attempt ends: budgets, records, TTLs), `rqcompat`
(every touch of RQ's registries and private state), `limits` (runner request limits), `health` (the
snapshot writer), `noop` (a no-op runner for benchmarks). See docs/worker.md.
"""
