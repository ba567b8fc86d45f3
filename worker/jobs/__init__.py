"""RQ bookkeeping of render jobs on the worker side: how an attempt ends (outcomes), admission caps and quotas,
the tenant queues a worker takes from, and the ids of jobs that poisoned a fleet."""
