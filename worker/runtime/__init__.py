"""How a worker runs: the supervisor (one process per device group), one worker process, its `FleetWorker` (the RQ
wing's worker with the worker's health, readiness and fleet policy), back-pressure, and the exit codes between
them."""
