"""Text for eqxdiff: tokenizers run on the host, in the data pipeline."""

from eqxdiff.text.tokenizer import TextTokenizer, TokenizeText, load_tokenizer, word_tokenizer

__all__ = ["TextTokenizer", "TokenizeText", "load_tokenizer", "word_tokenizer"]
