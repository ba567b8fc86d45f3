"""The parallel parts of a pipeline beside the SP transformer: tiled data parallelism for the refinement stage (`tdp`,
its geometry `tiling`), the distributed VAE decode (`vae_decode`) and the distributed prompt encoding
(`text_encoder`)."""
