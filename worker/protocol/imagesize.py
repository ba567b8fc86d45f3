"""The image size check of the request schema: `ltx_mgpu.imagesize` (stdlib only), where the runner's
decoder reads it too, so both sides refuse the same files before any decoder runs."""

from __future__ import annotations

from ltx_mgpu.imagesize import IMAGE_FORMATS, MAX_DECLARED_PIXELS, MAX_IMAGE_SIDE, ImageRefused, image_size

__all__ = ["IMAGE_FORMATS", "MAX_DECLARED_PIXELS", "MAX_IMAGE_SIDE", "ImageRefused", "image_size"]
