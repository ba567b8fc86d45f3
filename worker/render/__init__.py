"""What a worker does with a job: the render service, one attempt's drive of the fleet and what the render leaves
for the stages (`fleet_render`), the uploaded result (`results`), the warm fleet (built, watched, rebuilt),
per-request LoRAs, plus the no-op runner for benchmarks. The encode and upload that follow a render are
`worker.stages`."""
