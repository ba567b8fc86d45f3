"""ltx_contract: what a client of the render service and its workers agree on, in a package of its own.

Why a package: the producer used to import the worker's `protocol` folder, and with it the event relay, the
worker's Redis-outage handling and RQ registry surgery (17 of 18 modules, about 3.9k lines cherry-picked
into the producer image). This package is the contract alone: Redis names (`keys`), job states, events and
failure reasons (`states`), the request (`schema`, `lora_refs`; its bounds are `ltx_mgpu.spec`'s) and the
limits workers publish (`limits`, in their health snapshot: `health`, `typed_json`; the hand-off result:
`handoff`), the enqueue and read side (`rq_client`: the bounded job load, the enqueue tenants may do, live
workers; `queue_depth`), cancel (`control`), one job event written exactly once (`event_stream`, retried
through transient refusals: `redis_retry`), the shared `LTX_*` checks (`shared_settings`), connections
(`redis_conn`), S3 errors in one line (`s3_errors`), and the access deal operators deploy (`redis_acl`:
the ACL users, `redis_proxy`: the tenants' connection caps).

Arrows point down: `producer -> ltx_contract <- worker`, and `ltx_contract -> ltx_mgpu.spec` only. It imports
nothing of `worker/` or `producer/`, no torch, and of RQ only its client API (jobs, queues, serializers,
commands, the worker list; never its registries, results or executions); `ContractError` (`errors`) is the
root of its exceptions. The producer image copies this package and `ltx_mgpu/spec/` and nothing else
(tests/test_import_contracts.py and tests/test_compose.py hold both).
"""
