"""The mp4 code in one home: what renders video files and what reads them back (PyAV, numpy, torch).

- `mp4`: mp4 out (H.264 + AAC, `write_mp4`, `write_mp4_yuv`), the device-side RGB -> yuv420p conversion, the
  `media` hand-off event
- `mp4_read`: mp4 in (`read_mp4`, `read_audio`, `probe_mp4`)
- `x264_segments`: segment-parallel x264 runs joined by the muxer (one-shot and streamed)
- `mp4_stream`: the encoder's side of a streamed hand-off (`Mp4Stream`: x264 runs started as frames arrive)

Used by the runners (the driver rank writes or hands off the video) and by the worker's encoder, which
encodes a handed-off video beside the next job. Import by module path; this package imports nothing.
"""
