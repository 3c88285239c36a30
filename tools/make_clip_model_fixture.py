"""Write tests/data/clip_text/clip_model/: a full transformers `CLIPModel` folder (text and vision
towers, both projections, logit_scale) as `save_pretrained` writes it, with what transformers'
`CLIPTextModel.from_pretrained(folder)` and `CLIPTextModelWithProjection.from_pretrained(folder)`
make of it: the text tower read from `text_config` and the `text_model.*` keys, the vision keys left.

reference.npz: `input_ids`, `attention_mask` (int32 `[b, n]`, right padded) and, without and with the
mask (suffix `_masked`), CLIPTextModel's `last_hidden_state` and `pooler_output` and
CLIPTextModelWithProjection's `text_embeds` (float32). Also `get_text_features`, CLIPModel's own text
embedding (the projection of the pooled vector), unmasked: the three models agree on the folder.

    tools/.venv/bin/python tools/make_clip_model_fixture.py     # requirements-ports.txt
"""

import json
from pathlib import Path

import numpy as np
import torch
from transformers import CLIPConfig, CLIPModel, CLIPTextModel, CLIPTextModelWithProjection

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "clip_text" / "clip_model"
PROJECTION = 12
# The text config as openai's CLIP folders write it: projection_dim inside text_config too (transformers'
# CLIPTextModelWithProjection reads its head's size there, not from the top level).
TEXT = dict(
    vocab_size=50,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=20,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=3,
    pad_token_id=0,
    projection_dim=PROJECTION,
)
VISION = dict(
    hidden_size=16,
    intermediate_size=20,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=8,
    patch_size=4,
    projection_dim=PROJECTION,
)


def random_clip_model(seed: int) -> CLIPModel:
    """transformers' init, then every Linear bias 0.1·N(0,1), LayerNorm weight 1 + 0.2·N(0,1) and bias
    0.2·N(0,1), and logit_scale 1.5 (the defaults would leave them untested)."""
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=PROJECTION)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1 + 0.2 * torch.randn_like(module.weight))
                module.bias.copy_(0.2 * torch.randn_like(module.bias))
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn_like(module.bias))
        model.logit_scale.fill_(1.5)
    return model


def main() -> None:
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    full = random_clip_model(seed=7)
    full.save_pretrained(OUT)
    config = json.loads((OUT / "config.json").read_text())
    assert config["model_type"] == "clip" and "text_config" in config and "vision_config" in config, config.keys()
    text = CLIPTextModel.from_pretrained(OUT).eval()
    with_projection = CLIPTextModelWithProjection.from_pretrained(OUT).eval()
    input_ids = np.array([[1, 7, 30, 44, 3, 0, 0, 0], [1, 9, 3, 12, 3, 0, 0, 0], [1, 5, 6, 8, 49, 21, 17, 3]])
    mask = np.array([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1] * 8])  # row 1: two texts, two eos
    refs = {"input_ids": input_ids.astype(np.int32), "attention_mask": mask.astype(np.int32)}
    ids = torch.from_numpy(input_ids)
    with torch.no_grad():
        for suffix, attention_mask in (("", None), ("_masked", torch.from_numpy(mask.astype(np.int64)))):
            out = text(ids, attention_mask=attention_mask)
            refs[f"last_hidden_state{suffix}"] = out.last_hidden_state.numpy()
            refs[f"pooler_output{suffix}"] = out.pooler_output.numpy()
            refs[f"text_embeds{suffix}"] = with_projection(ids, attention_mask=attention_mask).text_embeds.numpy()
        features = full.get_text_features(ids)
        refs["get_text_features"] = (features if torch.is_tensor(features) else features.pooler_output).numpy()
    np.testing.assert_array_equal(refs["get_text_features"], refs["text_embeds"])
    np.savez_compressed(OUT / "reference.npz", **refs)
    print(OUT.name, full.num_parameters(), "params;", text.num_parameters(), "in the text tower")


if __name__ == "__main__":
    main()
