"""Write tests/data/clip_tokenizer/: a CLIP tokenizer cut from CLIP's real BPE merges, in the two forms
Stable Diffusion checkpoints ship it, with transformers' token ids for a prompt set.

The real merges come from open_clip's copy of OpenAI's `bpe_simple_vocab_16e6.txt.gz` (the full
49,408-token vocabulary would be ~3.6 MB in both forms, so the first NUM_MERGES merges are kept, in
order). Token ids below 512 + NUM_MERGES are the real CLIP ids; the two specials follow them.

- sd1/: vocab.json + merges.txt + tokenizer_config.json + special_tokens_map.json laid out like SD 1.x's
  tokenizer/ folder (pads with <|endoftext|>).
- sd2/: tokenizer.json (written by transformers' CLIPTokenizer.save_pretrained) + SD 2's two config files,
  whose pad tokens disagree the way SD 2's do: tokenizer_config.json says <|endoftext|>, special_tokens_map.json
  says "!" (id 0), and transformers lets the latter win.
- reference.json: the prompts and, per folder and max_length, transformers' input_ids and attention_mask.

Independent check: transformers 5 has no pure-Python CLIPTokenizer any more (its CLIPTokenizer is built on
`tokenizers`), so every prompt's ids without specials are also compared here with CLIP's original
pure-Python BPE (open_clip's SimpleTokenizer) fed the text cleanup of transformers 4's slow CLIPTokenizer
when ftfy is installed: whitespace_clean(ftfy.fix_text(text)).lower(). PROMPTS agree on both; SLOW_DIVERGENT
lists prompts where that slow cleanup gives other ids (asserted here: ftfy's repairs, Python's final-sigma
lowercasing), and the tests hold eqxdiff to transformers there too.

    tools/.venv/bin/pip install --no-deps open_clip_torch ftfy wcwidth
    tools/.venv/bin/python tools/make_tokenizer_fixtures.py
"""

import gzip
import importlib.metadata
import importlib.util
import json
import re
import shutil
import tempfile
from pathlib import Path

import ftfy
import transformers

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "clip_tokenizer"
NUM_MERGES = 10_000  # keeps the committed folder near 1 MB; "photo" (1125) and "cat" (2368) are in
MAX_LENGTHS = (77, 8)  # the model's length, and a short one that truncates most prompts
BOS, EOS = "<|startoftext|>", "<|endoftext|>"

LONG = (
    "A highly detailed oil painting of a lighthouse on a rocky cliff at sunset, waves crashing below, seagulls "
    "circling overhead, dramatic clouds lit in orange and purple, a small fishing boat returning to the harbor, "
    "warm light in the keeper's window, by a nineteenth century romantic landscape painter, trending on artstation, "
    "masterpiece, best quality, 8k resolution, intricate brushwork, volumetric lighting"
)
PROMPTS = [
    "a photo of a cat",
    "",
    "   \n\t  ",
    "A Photo Of A CAT, IN UPPER CASE",
    "it's a dog's life, isn't it? we'll see; they're here, I'm sure you've heard, he'd know",
    "IT'S LOUD, DON'T SHOUT",
    'Hello, World!!! (a test) -- [brackets] {braces} @#$%^&*_+=~`|\\/<>?;:"...',
    "wow!",
    "3 cats and 1024 dogs in 2024, pi = 3.14159, -7e-3",
    "a  cat\n\nsitting\t on   a\r\nmat ",
    "café crème brûlée, Ångström, naïve façade, Straße, Øresund",
    "cafe\u0301 (e + combining acute, NFC makes it é)",
    "一只猫坐在垫子上",
    "猫が好きです、ありがとう",
    "고양이 사진",
    "ΑΘΗΝΑ and МОСКВА",
    "a 🐱 and a 🐶 with a family 👨\u200d👩\u200d👧 under a 🏳\ufe0f\u200d🌈 flag",
    "astronaut riding a horse on mars, photorealistic, 4k",
    "a cat<|endoftext|>a dog",
    "a cat<|ENDOFTEXT|>a dog!<|startoftext|>",  # matched or not as the special tokens' `normalized` flags say
    LONG,
    "a " * 75,  # exactly 77 tokens with bos and eos: no padding, no truncation
    "a " * 76,  # one too many: the last "a" gives way to eos
]
SLOW_DIVERGENT = [
    "don\u2019t \u201cquote\u201d me",  # ftfy uncurls quotes: ’ becomes ' and "'t" a contraction token
    "\uff26\uff35\uff2c\uff2c\uff37\uff29\uff24\uff34\uff28 letters",  # ftfy folds full-width letters
    "\ufb01sh and \ufb02owers",  # ftfy splits the fi/fl ligatures
    "caf\u00c3\u00a9 au lait",  # ftfy repairs mojibake (UTF-8 read as Latin-1) to café
    "ΟΔΟΣ",  # Python's str.lower() gives a word-final ς, tokenizers' Lowercase (char by char) a σ
]


def token_flags(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}


def sd_configs(pad_token: str, name_or_path: str) -> tuple[dict, dict]:
    """SD's tokenizer/ tokenizer_config.json and special_tokens_map.json (SD 2: pad "!" in the map only)."""
    added = lambda content: {"__type": "AddedToken", **token_flags(content)}  # noqa: E731
    config = {
        "add_prefix_space": False,
        "bos_token": added(BOS),
        "do_lower_case": True,
        "eos_token": added(EOS),
        "errors": "replace",
        "model_max_length": 77,
        "name_or_path": name_or_path,
        "pad_token": EOS,
        "special_tokens_map_file": "./special_tokens_map.json",
        "tokenizer_class": "CLIPTokenizer",
        "unk_token": added(EOS),
    }
    special = {
        "bos_token": token_flags(BOS),
        "eos_token": token_flags(EOS),
        "pad_token": pad_token,
        "unk_token": token_flags(EOS),
    }
    return config, special


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_open_clip_tokenizer_module():
    """open_clip's tokenizer.py on its own: `import open_clip` would pull in torchvision and timm."""
    folder = Path(importlib.util.find_spec("open_clip").submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location("open_clip_tokenizer", folder / "tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, folder / "bpe_simple_vocab_16e6.txt.gz"


def write_vocab_and_merges(folder: Path, merges: list[str], byte_alphabet: list[str]) -> None:
    """CLIP's vocabulary order: 256 byte symbols, the same with </w>, one token per merge, then the specials."""
    tokens = byte_alphabet + [b + "</w>" for b in byte_alphabet] + ["".join(m.split()) for m in merges] + [BOS, EOS]
    assert len(set(tokens)) == len(tokens)
    (folder / "vocab.json").write_text(
        json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False), encoding="utf-8"
    )
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")


def reference_ids(folder: Path, prompts: list[str]) -> dict:
    tok = transformers.CLIPTokenizer.from_pretrained(str(folder))
    out = {}
    for n in MAX_LENGTHS:
        enc = tok(prompts, padding="max_length", max_length=n, truncation=True)
        out[str(n)] = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    return out


def compact(text: str) -> str:
    """One line per row of ids instead of one line per id (a raw newline is never inside a JSON string)."""
    return re.sub(r"\[\n[-\d,\s]+\]", lambda m: "".join(m.group(0).split()), text)


def make_tokenizer_fixtures(out: Path = OUT) -> None:
    open_clip_tok, bpe_gz = load_open_clip_tokenizer_module()
    lines = gzip.open(bpe_gz).read().decode("utf-8").split("\n")
    merges = lines[1 : 1 + NUM_MERGES]  # line 0 is the file's version header
    byte_alphabet = list(open_clip_tok.bytes_to_unicode().values())

    if out.exists():
        shutil.rmtree(out)
    sd1, sd2 = out / "sd1", out / "sd2"
    sd1.mkdir(parents=True)
    sd2.mkdir()
    write_vocab_and_merges(sd1, merges, byte_alphabet)
    for name, value in zip(
        ["tokenizer_config.json", "special_tokens_map.json"], sd_configs(EOS, "openai/clip-vit-large-patch14")
    ):
        write_json(sd1 / name, value)
    sd2_configs = sd_configs("!", "hf-models/clip-vit-large-patch14")

    with tempfile.TemporaryDirectory() as tmp:
        # SD 2 as vocab + merges, saved by transformers as tokenizer.json (before any call: a call's padding
        # and truncation would be saved into the file).
        sd2_vocab_merges = Path(tmp) / "sd2_vocab_merges"
        sd2_vocab_merges.mkdir()
        for name in ["vocab.json", "merges.txt"]:
            shutil.copy(sd1 / name, sd2_vocab_merges / name)
        for name, value in zip(["tokenizer_config.json", "special_tokens_map.json"], sd2_configs):
            write_json(sd2_vocab_merges / name, value)
        saved = Path(tmp) / "saved"
        transformers.CLIPTokenizer.from_pretrained(str(sd2_vocab_merges)).save_pretrained(str(saved))
        shutil.copy(saved / "tokenizer.json", sd2 / "tokenizer.json")
        for name, value in zip(["tokenizer_config.json", "special_tokens_map.json"], sd2_configs):
            write_json(sd2 / name, value)

        prompts = PROMPTS + SLOW_DIVERGENT
        references = {"sd1": reference_ids(sd1, prompts), "sd2": reference_ids(sd2, prompts)}
        assert reference_ids(sd2_vocab_merges, prompts) == references["sd2"], "SD 2's two forms disagree"
        assert references["sd1"] != references["sd2"], "the pad conventions should differ"

        # CLIP's original BPE with transformers 4's slow cleanup; vocabulary ids are the same by construction.
        gz = Path(tmp) / "bpe.txt.gz"
        gz.write_bytes(gzip.compress("\n".join(lines[: 1 + NUM_MERGES]).encode("utf-8")))  # no trailing "" merge
        original = open_clip_tok.SimpleTokenizer(str(gz))
        original.clean_fn = lambda text: open_clip_tok.whitespace_clean(ftfy.fix_text(text)).lower()
        vocab = json.loads((sd1 / "vocab.json").read_text(encoding="utf-8"))
        assert list(original.encoder)[:-2] == list(vocab)[:-2], "the original's vocabulary order differs"
        tok = transformers.CLIPTokenizer.from_pretrained(str(sd1))
        assert len(tok("a " * 75)["input_ids"]) == 77
        for prompt in prompts:
            fast = tok(prompt, add_special_tokens=False)["input_ids"]
            if BOS in prompt.lower() or EOS in prompt.lower():  # special tokens to transformers, not to the original
                continue
            agree = original.encode(prompt) == fast
            assert agree == (prompt not in SLOW_DIVERGENT), (prompt, original.encode(prompt), fast)
    print(
        "transformers' ids agree with CLIP's original BPE (slow cleanup, ftfy) on",
        len(PROMPTS) - 2,
        "prompts",
        "and differ on the",
        len(SLOW_DIVERGENT),
        "SLOW_DIVERGENT ones, as expected",
    )

    packages = ["transformers", "tokenizers", "open_clip_torch", "ftfy"]
    versions = {package: importlib.metadata.version(package) for package in packages}
    reference = {
        "about": (
            "input_ids and attention_mask of transformers.CLIPTokenizer (built on tokenizers: transformers 5 has no "
            "pure-Python one) with padding='max_length', truncation=True, per folder and max_length. Cross-checked "
            "without bos/eos against CLIP's original pure-Python BPE (open_clip SimpleTokenizer) after the cleanup "
            "transformers 4's slow CLIPTokenizer applies when ftfy is installed, "
            "whitespace_clean(ftfy.fix_text(text)).lower(): equal on every prompt but the two holding special "
            "tokens (plain text to the original); different on slow_divergent_prompts (ftfy's repairs of quotes, "
            "full-width letters, ligatures and mojibake; Python's word-final sigma), where the ids stored are "
            "transformers'. transformers 4 without ftfy (BasicTokenizer cleanup) was not run."
        ),
        "versions": versions,
        "num_merges": NUM_MERGES,
        "prompts": PROMPTS,
        "slow_divergent_prompts": SLOW_DIVERGENT,
        **references,
    }
    (out / "reference.json").write_text(
        compact(json.dumps(reference, indent=1, ensure_ascii=False)) + "\n", encoding="utf-8"
    )
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    print(json.dumps(sizes), "total", sum(sizes.values()))


def main() -> None:
    make_tokenizer_fixtures()


if __name__ == "__main__":
    main()
