"""A `TextTokenizer` written as a tokenizer folder (the inverse of `load_tokenizer` for one built in code, e.g.
`word_tokenizer`'s closed vocabulary): `tokenizer.json` (Hugging Face `tokenizers`' own serialisation: the model,
normalizer, pre-tokenizer, special tokens and bos/eos post-processor), `tokenizer_config.json` (model_max_length,
the special tokens, `tokenizer_class` "PreTrainedTokenizerFast") and `special_tokens_map.json`. transformers'
`AutoTokenizer` / `PreTrainedTokenizerFast.from_pretrained` and `load_tokenizer` read it back to the same ids.
"""

import json
from pathlib import Path

from eqxdiff.data.tokenizer import TextTokenizer

TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # transformers' tokenizer over any tokenizer.json


def save_tokenizer(
    tokenizer: TextTokenizer, folder: str | Path, *, bos_token: str, eos_token: str, unk_token: str
) -> Path:
    """`tokenizer` in `folder` (made if needed); bos/eos/unk name its special tokens (a TextTokenizer keeps only
    the padding one), each of which must be in its vocabulary. Returns `folder`."""
    specials = {
        "bos_token": bos_token,
        "eos_token": eos_token,
        "unk_token": unk_token,
        "pad_token": tokenizer.pad_token,
    }
    missing = {name: token for name, token in specials.items() if tokenizer.tokenizer.token_to_id(token) is None}
    if missing:
        raise ValueError(f"save_tokenizer: {missing} are not tokens of this tokenizer's vocabulary")
    if tokenizer.model_max_length is None:
        raise ValueError("save_tokenizer: the tokenizer has no model_max_length (the text model's positions)")
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer.tokenizer.to_str())
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "model_max_length": tokenizer.model_max_length,
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, sort_keys=True) + "\n")
    return folder
