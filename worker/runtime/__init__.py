"""How a worker runs: the supervisor (one process per device group), one worker process, the RQ worker loop
and its parts, and the exit codes between them."""
