"""How a worker runs: settings, the supervisor (one process per device group), one worker process, the RQ
worker loop, and the exit codes between them."""
