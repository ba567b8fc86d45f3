"""The non-weight files of a synthetic Gemma 3 root: tokenizer, tokenizer/processor configs, config.json.

The tokenizer is built locally (no downloads): a byte-level BPE trained in-process on a small fixed corpus,
with Gemma's special tokens and a chat template, so prompt encoding and prompt enhancement both run. The
`tiny` profile keeps that vocabulary (~400 entries). The `full` profile stretches it to Gemma 3's real
vocabulary size, 262,208 entries, with the special tokens at their real ids (pad 0, eos 1, bos 2, unk 3,
<start_of_turn> 105, <end_of_turn> 106, <start_of_image> 255999, <end_of_image> 256000,
<image_soft_token> 262144) and placeholder tokens filling the rest, so the embedding matrix and the token
ids in config.json have their real sizes and values; the text it tokenizes is not Gemma's tokenization.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from ...common.weights import atomic_path, write_json
from .profiles import Profile

__all__ = ["GEMMA_VOCAB_SIZE", "build_tokenizer", "gemma_config", "write_side_files"]

GEMMA_VOCAB_SIZE = 262_208
_SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
_REAL_IDS = dict(zip(_SPECIAL_TOKENS, (0, 1, 2, 3, 105, 106, 255999, 256000, 262144), strict=True))
_CORPUS = [
    "a cat walks along the beach at sunset while waves roll in",
    "the camera slowly pans across a neon city street at night in the rain",
    "a red sports car drives fast on a mountain road, engine roaring",
    "close up of a woman smiling, soft window light, shallow depth of field",
    "an astronaut floats inside a space station, cables drifting",
    "birds fly over a misty lake in the early morning, quiet ambience",
    "a chef chops vegetables in a busy kitchen, steam rising from pans",
    "a dog runs through tall grass towards the camera, wind blowing",
]
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_tokenizer(full_vocab: bool) -> Any:
    """A `tokenizers.Tokenizer`: the trained ~400-entry BPE, or (full_vocab) the same merges in a
    262,208-entry vocabulary with the special tokens at Gemma's ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    def byte_level(tok: Any) -> Any:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok

    def with_bos(tok: Any) -> Any:
        bos = tok.token_to_id("<bos>")
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
        return tok

    tok = byte_level(Tokenizer(models.BPE(unk_token="<unk>")))
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    if not full_vocab:
        return with_bos(tok)
    trained = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    vocab = dict(_REAL_IDS)
    reserved = set(_REAL_IDS.values())
    free = (i for i in range(GEMMA_VOCAB_SIZE) if i not in reserved)
    for token, _ in trained:
        if token not in vocab:
            vocab[token] = next(free)
    for i in free:
        vocab[f"<unused{i}>"] = i
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in _merges(tok)]
    big = byte_level(Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>")))
    big.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    return with_bos(big)


def _merges(tok: Any) -> list[Any]:
    import json

    return json.loads(tok.to_str())["model"]["merges"]


def gemma_config(profile: Profile, tok: Any) -> dict[str, Any]:
    """The profile's Gemma 3 config.json with the tokenizer's vocabulary size and special-token ids."""
    ids = {t: tok.token_to_id(t) for t in _SPECIAL_TOKENS}
    cfg = copy.deepcopy(profile.gemma_config)
    cfg.update(
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
        pad_token_id=ids["<pad>"],
    )
    cfg["text_config"].update(
        vocab_size=tok.get_vocab_size(), bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"]
    )
    return cfg


def write_side_files(root: Path, profile: Profile, tok: Any, config: dict[str, Any]) -> None:
    """tokenizer.json, tokenizer_config.json, preprocessor_config.json and config.json under `root`."""
    atomic_path(root / "tokenizer.json", tok.save)
    write_json(
        root / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "extra_special_tokens": {
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
            "chat_template": _CHAT_TEMPLATE,
            "padding_side": "left",
            "model_max_length": 131072 if profile.full_vocab else 4096,
        },
    )
    size = profile.image_size
    write_json(
        root / "preprocessor_config.json",
        {
            "image_processor_type": "Gemma3ImageProcessor",
            "do_resize": True,
            "size": {"height": size, "width": size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": True,
            "resample": 2,
        },
    )
    write_json(root / "config.json", config)
