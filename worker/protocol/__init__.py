"""The worker's side of the wire, below every other worker layer: the relay that writes a running job's events
(`relay`) and the work loop's view of Redis outages (`redis_outage`); neither knows RQ. Everything that knows RQ
(the job class the worker runs, its registries, its worker's hooks and private state) is the RQ wing,
`worker.rq`. What clients share with the worker (Redis names, states, the request, events written exactly once,
cancel, connections) is the client contract, `ltx_contract`, which this folder imports and the producer imports
instead of it (tests/test_import_contracts.py)."""
