"""A run's condition (eqxdiff/run/conditions.py) from its flags and its data, and back from a checkpoint's
config: which tower and tokenizer, the null the step and the sampler share, the sample grids' prompts.
`cfg` is train/main.py's Config, read by its field names; a flag or folder that does not fit is a
SystemExit naming the fix, as the scripts report it."""

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from jax.sharding import Mesh

from eqxdiff.data.captioned_digits import captioned_digits_tokenizer
from eqxdiff.data.latents import LatentSource
from eqxdiff.local_copies import canonical
from eqxdiff.run.conditions import EncodedText, FrozenText, Labels, NoCondition, ScratchText, TextCondition
from eqxdiff.run.models import SCRATCH_TEXT_CAUSAL, SCRATCH_TEXT_POOLED, SCRATCH_TEXT_TOWER
from eqxdiff.run.sdxl_condition import SDXLText, is_sdxl_folder, open_sdxl_text, vae_factor
from eqxdiff.sharding import RuleError
from eqxdiff.text.conditioning import (
    SCRATCH,
    TextConditioning,
    open_text_conditioning,
    tokenizer_folder,
    tokenizer_location,
)

# Tokenizers built into a dataset, by the name a dataset's `text_defaults` and checkpoints give them.
BUILTIN_TOKENIZERS = {"captioned_digits": captioned_digits_tokenizer}
TEXT_KINDS = {"scratch_text": ScratchText, "frozen_text": FrozenText, "encoded_text": EncodedText}
# A checkpoint's condition kind -> its class, for train/sample.py's rebuild; the config `to_config` gives
# is the class's keyword arguments (text kinds, above, open their tower and tokenizer first).
CONDITION_KINDS = {"none": NoCondition, "labels": Labels}


def run_condition(cfg, source, mesh: Mesh, rules: Sequence = ()):
    """The condition of a run of `cfg` (train/main.py's Config) on `source`: a frozen CLIP tower from
    --text_encoder (a folder), the one latents were encoded with (their meta.json), a tower trained with
    the model (--text_encoder scratch, or the dataset's own `text_defaults`), else its labels, else none.
    A pretrained tower is laid out over `mesh` by --fsdp_min_param_size and the run's sharding `rules`."""
    encoded = source.meta.get("text") if isinstance(source, LatentSource) else None
    if is_sdxl_folder(cfg.text_encoder):  # --init sd:SDXL_FOLDER: both towers of the pipeline
        return sdxl_condition(cfg, source, mesh, rules)
    defaults = getattr(source, "text_defaults", {})  # a dataset with its own tower and tokenizer
    if encoded is not None:  # train/encode.py --text_encoder: its tower and tokenizer
        if cfg.text_encoder and canonical(cfg.text_encoder) != encoded["text_encoder"]:
            raise SystemExit(
                f"--text_encoder {cfg.text_encoder}: {cfg.dataset} was encoded with "
                f"{encoded['text_encoder']}; drop the flag to use that one."
            )
        tower, tokenizer = encoded["text_encoder"], encoded["tokenizer"]
    else:
        tower = cfg.text_encoder or defaults.get("text_encoder", "")
        own = defaults and tower == defaults["text_encoder"]  # else a pretrained tower's own tokenizer
        tokenizer = cfg.tokenizer or (defaults["tokenizer"] if own else "")
    if not tower:
        return Labels(source.num_classes) if source.num_classes else NoCondition()
    if tower == SCRATCH and not tokenizer:
        raise SystemExit("--text_encoder scratch needs --tokenizer DIR (tokenizer.json, or vocab.json + merges.txt).")
    attend_padding = bool(cfg.init)  # a pipeline's UNet: captions encoded as its pipeline encodes them
    if encoded is not None and encoded["encoded"] and encoded.get("attend_padding", False) != attend_padding:
        raise SystemExit(padding_mismatch(cfg, encoded))
    try:
        text = open_text(
            tower,
            tokenizer,
            cfg.null_text,
            scratch_config=SCRATCH_TEXT_TOWER,
            mesh=mesh,
            min_size=cfg.fsdp_min_param_size,
            rules=rules,
            attend_padding=attend_padding,
        )
    except RuleError as e:  # the rules, not the folder
        raise SystemExit(f"SHARDING_RULES in train/main.py: {e}") from e
    except (FileNotFoundError, ValueError) as e:  # weights that do not fit their config, a tokenizer of another tower
        raise SystemExit(str(e)) from e
    if text.encoder is None:
        return ScratchText(text, causal=SCRATCH_TEXT_CAUSAL, pooled=SCRATCH_TEXT_POOLED)
    stored = source.text_null() if encoded is not None else None  # the null encoded with the latents
    same = encoded is not None and (encoded["null_text"], encoded.get("attend_padding", False)) == (
        text.null_text,
        attend_padding,
    )
    null = stored if stored is not None and same else text.encoded_null()
    return EncodedText(text, null) if encoded is not None and encoded["encoded"] else FrozenText(text, null)


def padding_mismatch(cfg, encoded: dict) -> str:
    """Why latents whose captions were encoded ahead of time do not fit the run: their padding tokens read otherwise."""
    if cfg.init:
        return (
            f"--init {cfg.init} encodes captions as the pipeline does, the tower reading the padding tokens too; "
            f"{cfg.dataset}'s were encoded with the padding masked: encode again with train/encode.py "
            "--attend_padding, or without --encode_text (the run then encodes its captions)."
        )
    return (
        f"{cfg.dataset}'s captions were encoded with --attend_padding, as Stable Diffusion's pipelines encode "
        "them, for a fine-tune (--init sd:FOLDER): pass --init, or encode again without --attend_padding."
    )


def sdxl_condition(cfg, source, mesh: Mesh, rules: Sequence = ()) -> SDXLText:
    """SDXL's condition (eqxdiff/run/sdxl_condition.py) for latents of its VAE that keep their raw captions (any
    tokens or encoded text stored beside them are not read): each caption tokenized twice on the host and read
    by both towers in the step, time_ids of the images' size."""
    folder = cfg.text_encoder
    if cfg.tokenizer:
        raise SystemExit(
            f"--tokenizer {cfg.tokenizer}: the SDXL folder {folder} tokenizes with its own tokenizer/ "
            "and tokenizer_2/; drop --tokenizer."
        )
    if not isinstance(source, LatentSource) or "caption" not in source.record_fields:
        encode = f"--vae {Path(folder) / 'vae'} --text_encoder {Path(folder) / 'text_encoder'}"
        raise SystemExit(
            f"--dataset {cfg.dataset}: SDXL fine-tuning reads latents that keep their raw captions "
            f"(tokenized for both towers in training): encode with train/encode.py {encode}."
        )
    size = [d * vae_factor(folder) for d in source.image_shape[:2]]  # pixels: latents × the VAE's factor
    try:
        return open_sdxl_text(
            canonical(folder), size, cfg.null_text, mesh=mesh, min_size=cfg.fsdp_min_param_size, rules=rules
        )
    except RuleError as e:
        raise SystemExit(f"SHARDING_RULES in train/main.py: {e}") from e
    except (FileNotFoundError, ValueError) as e:  # weights that do not fit their config, the refiner
        raise SystemExit(f"--init {cfg.init}: {e}") from e


def open_text(
    tower: str,
    tokenizer: str,
    null_text: str,
    *,
    scratch_config: dict,
    mesh: Mesh | None,
    min_size: int,
    rules: Sequence = (),
    attend_padding: bool = False,
) -> TextConditioning:
    """`tower` "scratch" (of `scratch_config`) or a folder; `tokenizer` a built-in one's name
    (BUILTIN_TOKENIZERS), a folder, or "" (the tokenizer/ beside `tower`). The result keeps both as
    absolute specs, for checkpoints. A folder that does not fit is a SystemExit naming it."""
    if tokenizer in BUILTIN_TOKENIZERS:
        tokenizer_spec, tokenizer = tokenizer, BUILTIN_TOKENIZERS[tokenizer]()
    else:
        tokenizer_spec, tokenizer = tokenizer_location(tower, tokenizer), str(tokenizer_folder(tower, tokenizer))
    text = open_text_conditioning(
        tower,
        tokenizer,
        null_text=null_text,
        scratch_config=scratch_config,
        mesh=mesh,
        min_size=min_size,
        rules=rules,
        attend_padding=attend_padding,
    )
    tower_spec = tower if tower == SCRATCH else canonical(tower)
    return dataclasses.replace(text, specs=(tower_spec, tokenizer_spec))


def stored_condition(stored: dict) -> dict:
    """A checkpoint's condition config; for one written before conditions were stored, what its `text`
    entry (scratch towers then had today's widths; before `causal` and `pooled` were stored, both on) or
    its `num_classes` meant."""
    if "condition" in stored:
        return stored["condition"]
    if "text" in stored:
        text = stored["text"]
        if text["text_encoder"] != SCRATCH:
            return {"kind": "frozen_text", **text}
        return {
            "kind": "scratch_text",
            **text,
            "tower": SCRATCH_TEXT_TOWER,
            "causal": text.get("causal", True),
            "pooled": text.get("pooled", True),
        }
    return {"kind": "labels", "num_classes": stored["num_classes"]} if stored["num_classes"] else {"kind": "none"}


def condition_from_config(config: dict, *, mesh: Mesh | None):
    """The condition `to_config` described, for sampling: a frozen or encoding tower replicated over `mesh`,
    its null the encoded "" (or zeros) of `null_text`. Raises FileNotFoundError or ValueError when a
    tower or tokenizer folder cannot be read, KeyError for a kind neither table names."""
    kind = config["kind"]
    if kind == SDXLText.kind:  # SDXL's two towers, replicated
        return open_sdxl_text(config["text_encoder"], config["size"], config["null_text"], mesh=mesh, min_size=2**62)
    if kind in CONDITION_KINDS:
        return CONDITION_KINDS[kind](**{name: value for name, value in config.items() if name != "kind"})
    if kind not in TEXT_KINDS:
        raise KeyError(
            f"a condition of kind {kind!r}, which CONDITION_KINDS in eqxdiff/run/open_condition.py does not "
            "name: add its class there"
        )
    text = open_text(
        config["text_encoder"],
        config["tokenizer"],
        config["null_text"],
        scratch_config=config.get("tower", SCRATCH_TEXT_TOWER),
        mesh=mesh,
        min_size=2**62,
        attend_padding=config.get("attend_padding", False),
    )
    if config["kind"] == "scratch_text":
        return ScratchText(text, causal=config["causal"], pooled=config["pooled"])
    return TEXT_KINDS[config["kind"]](text, text.encoded_null())


def sample_prompts(given: str, source) -> list[str]:
    """Sample-grid prompts: `given` ("|"-separated), else the dataset's own (`sample_prompts`), else ten of
    the source's captions spread evenly over it (a sorted folder's first ten are often all of one class)."""
    if given:
        return given.split("|")
    if hasattr(source, "sample_prompts"):
        return source.sample_prompts(10)
    if "caption" in source.fields:
        caption = lambda i: str(source[i]["caption"])  # noqa: E731
    elif isinstance(source, LatentSource) and "caption" in source.record_fields:
        caption = source.caption  # latents whose records are read as tokens or encoded text keep the raw caption too
    else:
        raise SystemExit(
            f"{source.spec} holds no captions to draw sample prompts from: pass --sample_prompts 'a|b|...'."
        )
    rows = np.unique(np.linspace(0, len(source) - 1, min(10, len(source))).round().astype(int))
    return [caption(int(i)) for i in rows]


def sample_grid_rows(cfg, condition, source) -> tuple[list, list[str] | None]:
    """(a label or prompt per row of train/main.py's sample grids, the rows' labels to print or None): a text
    run's --sample_prompts (or the data's own), else each class (named: a folder's sub-folders), else ten
    unconditional rows."""
    if isinstance(condition, TextCondition):
        return sample_prompts(cfg.sample_prompts, source), None
    if isinstance(condition, Labels):
        return list(range(condition.num_classes)), getattr(source, "class_names", None)
    return list(range(10)), None
