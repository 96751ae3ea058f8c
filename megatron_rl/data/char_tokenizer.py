"""Character-level HF tokenizer for the built-in tasks: one token per character, bos/eos/pad/unk."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order
# Every character any built-in task writes. Appending characters keeps old ids stable; reordering
# would silently remap a saved model's embedding rows.
DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz:=+-, "


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> "PreTrainedTokenizerFast":
    """Build the tokenizer (tokenizers WordLevel over single characters, wrapped for the HF API).

    Encoding prepends bos (`tokenizer(text)["input_ids"][0] == bos_token_id`); eos is not added, so
    SFT targets append `eos_token_id` explicitly. Unknown characters map to `<unk>`. Decoding
    concatenates characters (no separator). Save with `save_pretrained(dir)`; load with
    `load_char_tokenizer(dir)` or `transformers.AutoTokenizer.from_pretrained(dir)`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet) or not alphabet:
        raise ValueError(f"alphabet must be non-empty with unique characters, got {alphabet!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(alphabet))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )


def load_char_tokenizer(path: str) -> "PreTrainedTokenizerFast":
    """Load a tokenizer saved by `build_char_tokenizer(...).save_pretrained(path)`."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)
