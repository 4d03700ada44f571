"""A byte-level tokenizer: one token per UTF-8 byte plus three special tokens.

It needs no vocabulary file, never meets an unknown character, and saves as a
Hugging Face `tokenizer.json` (byte-level BPE with no merges) so the very same
checkpoint folder loads in transformers and vLLM with identical ids.
"""
from __future__ import annotations

import json
from pathlib import Path

BYTE_TOKENS = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
SPECIAL_TOKENS = {"<|bos|>": BOS_ID, "<|eos|>": EOS_ID, "<|pad|>": PAD_ID}
VOCAB_SIZE = 259


def _byte_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable character map used by byte-level BPE tokenizers.

    Printable Latin-1 bytes stand for themselves; the others (controls, space,
    ...) are shifted past 255 so that every byte has a visible character.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, shift = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


class ByteTokenizer:
    vocab_size = VOCAB_SIZE
    bos_id, eos_id, pad_id = BOS_ID, EOS_ID, PAD_ID

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if bos else ids

    # The plain episode format of the built-in policy: the prompt and a newline, each turn ended by
    # EOS, each observation as "\n= <text>\n" (see crucible.ml.envs.calls for how its calls are written).
    def episode_prompt(self, instructions: str) -> list[int]:
        return self.encode(instructions + "\n")

    def observation(self, text: str) -> list[int]:
        return self.encode(f"\n= {text}\n", bos=False)

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_TOKENS).decode("utf-8", errors="replace")

    def save(self, folder: Path) -> None:
        """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json in Hugging Face's format."""
        to_char = _byte_to_unicode()
        vocab = {to_char[b]: b for b in range(256)}
        added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for t, i in SPECIAL_TOKENS.items()]
        spec = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": False},
            "post_processor": {"type": "TemplateProcessing",
                               "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                                          {"Sequence": {"id": "A", "type_id": 0}}],
                               "pair": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}},
                                        {"Sequence": {"id": "B", "type_id": 1}}],
                               "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [BOS_ID],
                                                              "tokens": ["<|bos|>"]}}},
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": []},
        }
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
            "pad_token": "<|pad|>", "add_bos_token": True, "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
        }, indent=1))
        (folder / "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, indent=1))
