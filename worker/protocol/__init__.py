"""The worker's side of the wire, below every other worker layer: the RQ job class it runs (`render_job`), every
touch of RQ's internals (`rq_compat`), the relay that writes a running job's events (`relay`) and the work loop's
view of Redis outages (`redis_outage`). What clients share with the worker (Redis names, states, the request,
events written exactly once, cancel, connections) is the client contract, `ltx_contract`, which this folder
imports and the producer imports instead of it (tests/test_import_contracts.py)."""
