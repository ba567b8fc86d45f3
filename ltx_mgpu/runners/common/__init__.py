"""What both runner families (smoke, ltx2) use; neither family imports the other.

- `args`: `RenderArgs`, the job arguments declared once, and `job_entry` (a runner's `__call__`)
- `media`: mp4 out (H.264 + AAC) and back in (PyAV)
- `handoff`: the video out of the fleet (an mp4, one hand-off of frames, or frames streamed as they decode)
- `mp4stream`: the encoder's side of a streamed hand-off (x264 runs started as frames arrive)
- `x264segments`: segment-parallel x264 runs joined by the muxer
- `audio`: the LTX-2 audio VAE decoder + vocoder (with or without torchaudio), their checkpoint layout
- `stages`: `StageClock`, per-stage seconds and peak memory for the `output` event
- `loading`: file and meta-device checks, checkpoint metadata, the synthetic-weights warning
- `weights`: seeded random weights in real layouts, streamed into safetensors files
- `tiny`: tiny transformer and video VAE configs
- `local`: `LocalRunner`, a runner in the calling process as a world of one

Import by module path; this package imports nothing heavy.
"""
