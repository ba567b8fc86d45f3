"""What the tests share: servers, worker processes, runners and one way to wait. No test functions here.

- `wait`: `wait_for(predicate, timeout, what)`, the one wait-until loop (raises AssertionError on timeout);
- `runners`: the fault-injection runners (`FaultRunner`, directives in the prompt) the worker tests register;
- `workers`: `ltx-worker` processes under test (`worker_env`, `WorkerProcess`, `launch_worker`), their health
  and their jobs (`enqueue`, `wait_ready`, `wait_state`, `events`);
- `fleet`: one ready `ltx-worker one` with a warm fleet (`Fleet`, `running_worker`) and its /metrics;
- `acl_stack`: a worker logged in as the generated `worker` ACL user;
- `controller_runners`, `gpu_runners`, `slow_import_probe`: runners the controller tests ship to fleets.

The Redis, S3 and TCP-proxy fixtures are in `tests/conftest.py` (the servers in `devstack.dev_servers`), and so
is the one place that assigns each test its tier (README, "Tests").
"""
