"""LTX-2 prompt encoding on one rank: `GemmaPromptEncoder` (Gemma 3's hidden states through the LTX-2
embeddings processor, and prompt enhancement with Gemma), built from the loaders in `.gemma_loading`, resident
on the GPU or with Gemma's layers streamed from host memory (the `stream` placement tier).

`GemmaPromptEncoder` implements `ltx_mgpu.parallel.pipeline.text_encoder.LocalPromptEncoder`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..common.host_tier import stream_module
from ..common.loading import check_materialized
from .gemma_loading import DEFAULT_PROMPT_TOKENS, embeddings_processor_builder, gemma_builder, tie_output_head

__all__ = [
    "GemmaPromptEncoder",
    "build_gemma_prompt_encoder",
    "build_prompt_encoder",
    "weights_fingerprint",
]


def _clean_enhanced(text: str) -> str:
    """Straighten typographic quotes and dashes and drop leading non-letters (Gemma tends to add them)."""
    table = {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": "-", "\u2013": "-", "\u00a0": " "}
    text = text.translate(str.maketrans(table))
    for i, ch in enumerate(text):
        if ch.isalpha():
            return text[i:].strip()
    return text.strip()


class GemmaPromptEncoder:
    """Gemma hidden states -> LTX-2 embeddings. Encodings: {"video": (1, T, D), "audio": (1, T, Da) | None,
    "mask": (1, T) int64}.

    Several prompts (CFG's positive and negative) go through Gemma in ONE batched forward: every prompt is
    padded to the same `max_tokens` and Gemma masks the padding, so each row equals its own forward up to
    reduction order (tests/test_text_encoder.py bounds the difference). The embeddings processor then runs
    one prompt at a time, as before: its connectors substitute registers per sequence.

    `identity`: what the encoder's outputs depend on (the weight files, dtype, token count) plus a counter
    that `weights_changed()` bumps; cached embeddings keyed by it are dropped when it changes."""

    def __init__(
        self,
        text_encoder: Any,
        embeddings_processor: Any,
        *,
        enhance_max_new_tokens: int = 512,
        fingerprint: str | None = None,
        device: torch.device | None = None,
        streamed: Any = None,
    ) -> None:
        self.text_encoder = text_encoder
        self.device = device  #: where the inputs go (None: Gemma's first parameter's device)
        self.streamed = streamed  #: the `StreamedLayers` of a `stream`-placed encoder (None: resident)
        self.embeddings_processor = embeddings_processor
        self.enhance_max_new_tokens = int(enhance_max_new_tokens)
        self._fingerprint = fingerprint or f"object-{id(self)}"
        self._version = 0

    @property
    def identity(self) -> str:
        return f"{self._fingerprint}#{self._version}"

    def weights_changed(self) -> None:
        """Call after changing the encoder's weights in place: embeddings cached under the old identity go."""
        self._version += 1

    def encode(self, prompts: Sequence[str]) -> list[dict[str, torch.Tensor | None]]:
        prompts = list(prompts)
        if not prompts:
            return []
        te = self.text_encoder
        device = self.device or te.model.device
        pairs = [te.tokenizer.tokenize_with_weights(p)["gemma"] for p in prompts]
        input_ids = torch.tensor([[t[0] for t in row] for row in pairs], device=device)
        attention_mask = torch.tensor([[t[1] for t in row] for row in pairs], device=device)
        out = []
        with torch.inference_mode():
            hidden = te.model.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
            states = hidden.hidden_states
            del hidden
            for i in range(len(prompts)):
                row = tuple(h[i : i + 1] for h in states)
                video, audio, binary = self.embeddings_processor.process_hidden_states(row, attention_mask[i : i + 1])
                out.append({"video": video, "audio": audio, "mask": binary.to(torch.int64)})
        return out

    def enhance(self, prompt: str, *, image: Any = None, seed: int = 42) -> str:
        """Rewrite `prompt` with Gemma (sampling, seeded). `image`: uint8 (H, W, 3) tensor or None."""
        te = self.text_encoder
        if image is not None:
            if te.processor is None:
                raise ValueError(
                    "image-conditioned prompt enhancement needs the Gemma image processor, which is unavailable: "
                    f"{te.processor_error}"
                )
            return _clean_enhanced(te.enhance_i2v(prompt, image, max_new_tokens=self.enhance_max_new_tokens, seed=seed))
        tokenizer = te.tokenizer.tokenizer
        messages = [
            {"role": "system", "content": te.default_gemma_t2v_system_prompt},
            {"role": "user", "content": f"user prompt: {prompt}"},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        dev = self.device or te.model.device
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(dev)
        with torch.inference_mode(), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(int(seed))
            generated = te.model.generate(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                max_new_tokens=self.enhance_max_new_tokens,
                do_sample=True,
                temperature=0.7,
            )
        new_tokens = generated[0][inputs["input_ids"].shape[1] :]
        return _clean_enhanced(tokenizer.decode(new_tokens, skip_special_tokens=True))


def build_gemma_prompt_encoder(
    gemma_root: str | Path,
    checkpoint: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    max_tokens: int = DEFAULT_PROMPT_TOKENS,
    enhance_max_new_tokens: int = 512,
    registry: Any = None,
    stream: bool = False,
) -> GemmaPromptEncoder:
    """Load Gemma and the embeddings processor on `device` (the real loaders, meta-checked). `stream`: Gemma's
    decoder layers stay in pinned host memory and visit `device` one ahead of their use (`StreamedLayers`, the
    `stream` placement tier): Gemma loads into host memory and only the rest of it moves to `device`, so the
    device never holds the whole encoder, not even while loading."""
    device = torch.device(device)
    load_on = torch.device("cpu") if stream else device
    builder = gemma_builder(gemma_root, max_tokens=max_tokens, registry=registry)
    text_encoder = builder.build(device=load_on, dtype=dtype)
    text_encoder = check_materialized(text_encoder, f"Gemma at {gemma_root}")
    tie_output_head(text_encoder.model)
    streamed = stream_module(text_encoder.model, device, _host_parts(text_encoder.model)) if stream else None
    processor = embeddings_processor_builder(checkpoint, registry=registry).build(device=device, dtype=dtype)
    processor = check_materialized(processor, f"embeddings processor in {checkpoint}")
    fingerprint = weights_fingerprint(
        [*sorted(Path(gemma_root).rglob("*.safetensors")), Path(checkpoint)],
        dtype=str(dtype),
        max_tokens=int(max_tokens),
    )
    return GemmaPromptEncoder(
        text_encoder,
        processor,
        enhance_max_new_tokens=enhance_max_new_tokens,
        fingerprint=fingerprint,
        device=device,
        streamed=streamed,
    )


def _host_parts(gemma: Any) -> list[torch.nn.Module]:
    """What a streamed Gemma keeps in host memory and runs there (`compute_on_host`): the token embeddings (a
    gather of a prompt's rows; its 1.9 GiB table on the card would cost more than the lookup costs the CPU), the
    output head tied to them, and the vision tower and its projector (only enhancement runs those two, and a
    streaming fleet refuses it). Left on the GPU, they were 2.6 of the 3.5 GiB the tier kept there."""
    inner = getattr(gemma, "model", gemma)
    parts = [gemma.get_input_embeddings(), gemma.get_output_embeddings()]
    parts += [getattr(inner, name, None) for name in ("vision_tower", "multi_modal_projector")]
    return [part for part in parts if part is not None]


def weights_fingerprint(files: Sequence[Path], **options: Any) -> str:
    """A short digest of the weight files (path, size, mtime) and `options`: two encoders with the same
    fingerprint produce the same embeddings, so cached ones stay valid (hashing 24 GB would not pay)."""
    import hashlib

    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(json.dumps(options, sort_keys=True).encode())
    return h.hexdigest()[:16]


def build_prompt_encoder(
    runner: Any,
    mode: str,
    source_rank: int | None,
    *,
    gemma_root: str | Path,
    checkpoint: str,
    dtype: torch.dtype,
    max_tokens: int,
    enhance_max_new_tokens: int,
    stream: bool = False,
) -> Any:
    """The fleet's prompt encoder for `runner`: "source" (Gemma on `source_rank`, embeddings broadcast) or
    "batch-parallel" (Gemma on every rank, prompts split). Checks the options before loading anything.
    `stream`: Gemma's layers streamed from pinned host memory (`build_gemma_prompt_encoder`).

    `source_rank` None: the last rank. The driver (rank 0) already holds the VAE encoder, the upsampler and
    the audio decoder and does the mux; Gemma (24 GB at real size) elsewhere balances both memory and the
    weight load of a cold start (measured on two H200s: rank 0 took 26 s to load with Gemma, rank 1 10 s
    without)."""
    from ...parallel.pipeline.text_encoder import BatchParallelPromptEncoder, DistributedPromptEncoder

    if mode not in ("source", "batch-parallel"):
        raise ValueError(f"text_encoder must be 'source' or 'batch-parallel', got {mode!r}")
    src = runner.world_size - 1 if source_rank is None else int(source_rank)
    if mode == "source" and not 0 <= src < runner.world_size:
        raise ValueError(f"text_encoder_rank {src} is outside the fleet (size {runner.world_size})")

    def local() -> GemmaPromptEncoder:
        return build_gemma_prompt_encoder(
            gemma_root,
            checkpoint,
            device=runner.device,
            dtype=dtype,
            max_tokens=max_tokens,
            enhance_max_new_tokens=enhance_max_new_tokens,
            stream=stream,
        )

    group = runner.groups.gemma_group
    if mode == "batch-parallel":
        return BatchParallelPromptEncoder(local(), group=group, device=runner.device)
    encoder = local() if runner.rank == src else None
    return DistributedPromptEncoder(encoder, group=group, device=runner.device, src_rank=src)
