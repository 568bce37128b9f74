"""A character-level tokenizer for the built-in synthetic tasks, built with the `tokenizers` library so that
it is the same kind of object (and the same `tokenizer.json` format) as a checkpoint's tokenizer.

Vocabulary (24 ids): `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3, then the characters of `CHARS`
(digits first). Encoding splits text into single characters and adds `<bos>` in front (post-processor);
decoding concatenates characters and drops special tokens. No chat template: prompts are plain text.
"""

from __future__ import annotations

from jaxrl_fp8.data.tokenizer import TextTokenizer

__all__ = ["SPECIAL_TOKENS", "CHARS", "builtin_tokenizer", "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
CHARS = "0123456789+-*=<>:|, "


def builtin_tokenizer() -> TextTokenizer:
    """The built-in tokenizer (deterministic: the same ids on every call and machine)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return TextTokenizer(
        tok,
        special_tokens={"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
        name="builtin",
    )
