"""What both runner families (smoke, ltx2) use; neither family imports the other.

- `args`: `RenderArgs`, the job arguments declared once, and `job_entry` (a runner's `__call__`)
- `handoff`: the video out of the fleet (an mp4, one hand-off of frames, or frames streamed as they decode;
  the mp4 code itself is `ltx_mgpu.media`)
- `audio`: the LTX-2 audio VAE decoder + vocoder (with or without torchaudio), their checkpoint layout
- `stages`: `StageClock`, per-stage seconds and peak memory for the `output` event
- `loading`: file and meta-device checks, checkpoint metadata, the synthetic-weights warning
- `weights`: seeded random weights in real layouts, streamed into safetensors files
- `tiny`: tiny transformer and video VAE configs
- `local`: `LocalRunner`, a runner in the calling process as a world of one

Import by module path; this package imports nothing heavy.
"""
