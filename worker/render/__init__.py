"""What a worker does with a job: the render service, the warm fleet and its supervision, per-request LoRAs,
the mp4 encode stage and the background upload pipeline, plus the no-op runner for benchmarks."""
