"""Write tests/data/sdxl_text/: the text side of a Stable Diffusion XL pipeline folder as diffusers saves it
(`model_index.json`, `text_encoder/` a transformers CLIPTextModel, `text_encoder_2/` a
CLIPTextModelWithProjection, small random weights stored in fp16), and what diffusers' own pipelines make of
it: `reference.npz`.

The tokenizers are the committed tests/data/clip_tokenizer/ folders (cut from CLIP's real merges): `sd1/`
pads with <|endoftext|> as SDXL's `tokenizer/`, `sd2/` with "!" as SDXL's `tokenizer_2/`; the tests copy them
in as `tokenizer/` and `tokenizer_2/`, so they are not stored twice. Both tower configs say eos_token_id 2, as
SDXL's do (transformers then pools at the largest id, the end-of-text token under either padding).

The references come from `StableDiffusionXLPipeline.encode_prompt` (built from these towers and tokenizers;
no UNet, VAE or scheduler is needed to encode) and, for SD 1.x's `clip_skip`,
`StableDiffusionPipeline.encode_prompt` with tower 1 and tokenizer 1, all float32:

- `<case>_prompt_embeds` [b, 77, 8 + 16], `<case>_pooled` [b, 12] and, where guided, `<case>_negative_embeds`
  and `<case>_negative_pooled`, for the cases in CASES (prompts, prompt_2, negative prompts, clip_skip,
  force_zeros_for_empty_prompt; "refiner": without tower 1, as SDXL's refiner);
- `sd1_clip_skip_<k>` [b, 77, 8] for k in (none, 1, 2), and `sd1_negative` (diffusers' "" for SD 1.x);
- `input_ids`, `input_ids_2` int32 [b, 77]: the two tokenizers' ids for PROMPTS (transformers' tokenizers);
  `hidden_states` [4, b, 77, 8] and `hidden_states_2` [4, b, 77, 16] (embeddings, then each of the 3 layers),
  `last_hidden_state_2`, `pooler_output_2` and `text_embeds` of tower 2 on `input_ids_2`, from transformers.

    tools/.venv/bin/python tools/make_sdxl_text_fixture.py     # requirements-ports.txt
"""

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "sdxl_text"
TOKENIZERS = ROOT / "tests" / "data" / "clip_tokenizer"
VOCAB = 10514  # the committed tokenizer's ids (10,000 merges of CLIP's BPE, 512 symbols, 2 specials)
# SDXL's text_encoder (CLIP-L: quick_gelu) and text_encoder_2 (OpenCLIP bigG: gelu, a projection head) in small:
# 3 layers, so that hidden_states[-2], [-3] and [-4] (SDXL's clip_skip None, 1, 2) are all different layers.
TOWER = dict(
    vocab_size=VOCAB,
    num_hidden_layers=3,
    num_attention_heads=2,
    max_position_embeddings=77,
    layer_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)
TOWER_1 = dict(TOWER, hidden_size=8, intermediate_size=16, hidden_act="quick_gelu")
TOWER_2 = dict(TOWER, hidden_size=16, intermediate_size=24, hidden_act="gelu", projection_dim=12)
LONG = (
    "a highly detailed oil painting of a lighthouse on a rocky cliff at sunset, waves crashing below, seagulls "
    "circling overhead, dramatic clouds lit in orange and purple, a small fishing boat returning to the harbor, "
    "warm light in the keeper's window, masterpiece, best quality, intricate brushwork, 8k, trending"
)
PROMPTS = ["a photo of a cat", "wow! a dog!!", LONG]  # "!" is tokenizer_2's padding and a word here; LONG truncates
# name: encode_prompt's arguments (prompt is PROMPTS) and the pipeline's force_zeros_for_empty_prompt
CASES = {
    "zeros": dict(force_zeros=True),  # SDXL's default: no negative prompt -> zeros
    "empty": dict(force_zeros=False),  # no negative prompt, not forced -> "" encoded by both towers
    "explicit_empty": dict(force_zeros=True, negative_prompt=["", "", ""]),  # "" given: encoded, not zeros
    "negative": dict(force_zeros=True, negative_prompt=["", "blurry, ugly", "lowres"]),  # given: encoded
    "prompt_2": dict(
        force_zeros=True,
        prompt_2=["an oil painting", "", "a cat"],
        negative_prompt=["bad", "worse", "worst"],
        negative_prompt_2=["grey", "", "flat"],
    ),
    # diffusers encodes a given negative prompt at hidden_states[-2] whatever clip_skip says
    "clip_skip_1": dict(force_zeros=True, clip_skip=1, negative_prompt=["", "blurry, ugly", "lowres"]),
    "clip_skip_2": dict(force_zeros=True, clip_skip=2),
    "unguided": dict(force_zeros=True, do_classifier_free_guidance=False),
    "refiner": dict(force_zeros=False, refiner=True),  # SDXL's refiner: text_encoder_2 and tokenizer_2 only
}


def randomize(model: torch.nn.Module) -> None:
    """Every Linear bias 0.1·N(0,1), LayerNorm weight 1 + 0.2·N(0,1) and bias 0.2·N(0,1) (transformers'
    init leaves them 0 and 1, which would not test them), then all weights rounded to fp16."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1 + 0.2 * torch.randn_like(module.weight))
                module.bias.copy_(0.2 * torch.randn_like(module.bias))
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn_like(module.bias))
        for p in model.parameters():
            p.copy_(p.half().float())


def towers() -> tuple[CLIPTextModel, CLIPTextModelWithProjection]:
    """The two towers saved in fp16 under OUT, read back as float32 (as a pipeline loads them)."""
    torch.manual_seed(11)
    tower_1 = CLIPTextModel(CLIPTextConfig(**TOWER_1)).eval()
    tower_2 = CLIPTextModelWithProjection(CLIPTextConfig(**TOWER_2)).eval()
    for model, name in ((tower_1, "text_encoder"), (tower_2, "text_encoder_2")):
        randomize(model)
        model.to(torch.float16).save_pretrained(OUT / name)
    tower_1 = CLIPTextModel.from_pretrained(OUT / "text_encoder", dtype=torch.float32).eval()
    tower_2 = CLIPTextModelWithProjection.from_pretrained(OUT / "text_encoder_2", dtype=torch.float32).eval()
    return tower_1, tower_2


def main() -> None:
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    tower_1, tower_2 = towers()
    tokenizer_1 = CLIPTokenizer.from_pretrained(TOKENIZERS / "sd1")
    tokenizer_2 = CLIPTokenizer.from_pretrained(TOKENIZERS / "sd2")
    assert (tokenizer_1.pad_token, tokenizer_2.pad_token) == ("<|endoftext|>", "!"), "SDXL's two paddings"
    parts = dict(
        text_encoder=tower_1,
        text_encoder_2=tower_2,
        tokenizer=tokenizer_1,
        tokenizer_2=tokenizer_2,
        vae=None,
        unet=None,
        scheduler=None,
        add_watermarker=False,
    )
    refs: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for name, case in CASES.items():
            case = dict(case)
            only_2 = dict(text_encoder=None, tokenizer=None) if case.pop("refiner", False) else {}
            pipe = StableDiffusionXLPipeline(**parts | only_2, force_zeros_for_empty_prompt=case.pop("force_zeros"))
            guided = case.setdefault("do_classifier_free_guidance", True)
            embeds, negative, pooled, negative_pooled = pipe.encode_prompt(PROMPTS, device="cpu", **case)
            refs[f"{name}_prompt_embeds"], refs[f"{name}_pooled"] = embeds.numpy(), pooled.numpy()
            if guided:
                refs[f"{name}_negative_embeds"] = negative.numpy()
                refs[f"{name}_negative_pooled"] = negative_pooled.numpy()
        StableDiffusionXLPipeline(**parts).save_config(OUT)  # model_index.json: force_zeros_for_empty_prompt true
        sd1 = StableDiffusionPipeline(
            vae=None,
            text_encoder=tower_1,
            tokenizer=tokenizer_1,
            unet=None,
            scheduler=None,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        # diffusers 0.42's clip_skip line reads `text_encoder.text_model.final_layer_norm`, transformers 4's nesting;
        # transformers 5's CLIPTextModel holds final_layer_norm itself: an alias (not a submodule) lets that line run.
        object.__setattr__(tower_1, "text_model", tower_1)
        for clip_skip in (None, 1, 2):
            embeds, negative = sd1.encode_prompt(PROMPTS, "cpu", 1, True, clip_skip=clip_skip)
            refs[f"sd1_clip_skip_{clip_skip or 'none'}"] = embeds.numpy()
        refs["sd1_negative"] = negative.numpy()
        for suffix, tokenizer in (("", tokenizer_1), ("_2", tokenizer_2)):
            ids = tokenizer(PROMPTS, padding="max_length", max_length=77, truncation=True)["input_ids"]
            refs[f"input_ids{suffix}"] = np.asarray(ids, np.int32)
        out_1 = tower_1(torch.from_numpy(refs["input_ids"]).long(), output_hidden_states=True)
        out_2 = tower_2(torch.from_numpy(refs["input_ids_2"]).long(), output_hidden_states=True)
        refs["hidden_states"] = torch.stack(out_1.hidden_states).numpy()
        refs["hidden_states_2"] = torch.stack(out_2.hidden_states).numpy()
        refs["last_hidden_state_2"] = out_2.last_hidden_state.numpy()
        refs["text_embeds"] = out_2.text_embeds.numpy()
        refs["pooler_output_2"] = tower_2.text_model(torch.from_numpy(refs["input_ids_2"]).long()).pooler_output.numpy()
    np.savez_compressed(OUT / "reference.npz", **refs)
    config = json.loads((OUT / "model_index.json").read_text())
    assert config["force_zeros_for_empty_prompt"] is True and config["_class_name"] == "StableDiffusionXLPipeline"
    print({k: v.shape for k, v in refs.items()})


if __name__ == "__main__":
    main()
