"""A render job's bookkeeping on the worker side, nothing of RQ (the job is a `worker.rq.record.JobRecord`): one
execution of a job and the one place its end is decided (`attempt`), the values an end is told with (`ends`), the
rules it is decided by (`outcomes`), the admission rule, the names and order of tenant queues, tenants' Redis
memory, and the ids of jobs that poisoned a fleet."""
