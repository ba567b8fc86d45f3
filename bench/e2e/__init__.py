"""The service end to end on the real stack (Redis, SeaweedFS, `ltx-worker` processes configured through
`LTX_*` variables, jobs through the producer's client): one tool, `python -m bench.e2e MODE ...`.

Modes (`python -m bench.e2e MODE --help` for each):

- `runs` (the default when no mode is named): cold start, warm latency, throughput, GPU idle, memory and
  rebuild per run of a runner on a layout (`bench.e2e.runs`);
- `loras`: what a job's request LoRAs add to a render, side by side with jobs without one
  (`bench.e2e.loras`).

Both share `bench.e2e.stack` (servers, workers, job records), `bench.e2e.clock` (the fleet's clock read
from the job records) and, for `runs`, `bench.e2e.plans` (preset run lists and request sizes).
"""
