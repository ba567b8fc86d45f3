"""RQ bookkeeping of render jobs on the worker side: one execution of a job (`attempt`), how an attempt ends
(outcomes), admission caps and quotas, the tenant queues a worker takes from, and the ids of jobs that poisoned a
fleet."""
