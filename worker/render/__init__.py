"""What a worker does with a job: the render service, the warm fleet (built, watched, rebuilt), per-request LoRAs,
the mp4 encode stage and the background upload pipeline, plus the no-op runner for benchmarks."""
