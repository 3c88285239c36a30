"""Write tests/data/clip_vision/: CLIP's vision tower as transformers saves it, with transformers' outputs, for
tests/nn/test_clip_vision.py.

- `clip_model/`: a full `CLIPModel` (text tower 2 layers × 2 heads, width 24, eos pooling at id 3; vision tower 2
  layers × 4 heads, width 32, 16×16 images, patch 4, quick_gelu; both projections to 12, projection_dim in each
  sub-config as openai's folders write it; logit_scale 1.5) from `save_pretrained`. reference.npz: NHWC
  `pixels` [3, 16, 16, 3] and `pixels_other` [2, 24, 20, 3]; what `CLIPVisionModel.from_pretrained(folder)`
  gives (`last_hidden_state`, `pooler_output`; at 24×20 with `interpolate_pos_encoding=True`: `*_other`),
  `CLIPVisionModelWithProjection`'s `image_embeds`, and `CLIPModel`'s own `get_image_features`,
  `get_text_features` (of `input_ids`, `attention_mask`, right padded) and `logits_per_image`.
- `with_projection/`: a `CLIPVisionModelWithProjection` alone (width 24, 3 heads, exact gelu, layer_norm_eps
  1e-6, 8×8 images, patch 2, projection 10) from its own `save_pretrained`; reference.npz: `pixels`,
  `last_hidden_state`, `image_embeds`.

Every Linear bias and LayerNorm affine is moved off its init, and the class and position embeddings are
redrawn at unit scale.

    tools/.venv/bin/python tools/make_clip_vision_fixtures.py     # requirements-ports.txt
"""

from pathlib import Path

import numpy as np
import torch
from transformers import (
    CLIPConfig,
    CLIPModel,
    CLIPVisionConfig,
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
)

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "clip_vision"
PROJECTION = 12
TEXT = dict(
    vocab_size=50,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=20,
    hidden_act="quick_gelu",
    bos_token_id=1,
    eos_token_id=3,
    pad_token_id=0,
    projection_dim=PROJECTION,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=16,
    patch_size=4,
    hidden_act="quick_gelu",
    projection_dim=PROJECTION,
)
ALONE = dict(
    hidden_size=24,
    intermediate_size=36,
    num_hidden_layers=2,
    num_attention_heads=3,
    image_size=8,
    patch_size=2,
    hidden_act="gelu",
    layer_norm_eps=1e-6,
    projection_dim=10,
)


def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape, generator=gen))
                module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=gen))
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
        for name, p in model.named_parameters():
            if name.endswith(("class_embedding", "embeddings.position_embedding.weight")) and "vision" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
        if hasattr(model, "logit_scale"):
            model.logit_scale.fill_(1.5)


def clip_model(gen: torch.Generator) -> None:
    folder = OUT / "clip_model"
    model = CLIPModel(CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=PROJECTION)).eval()
    randomise(model, gen)
    model.save_pretrained(folder)
    pixels = torch.randn(3, 3, 16, 16, generator=gen)
    other = torch.randn(2, 3, 24, 20, generator=gen)
    ids = np.array([[1, 7, 30, 44, 3, 0, 0, 0], [1, 9, 3, 12, 3, 0, 0, 0], [1, 5, 6, 8, 49, 21, 17, 3]])
    mask = np.array([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1] * 8])
    refs = {
        "pixels": pixels.permute(0, 2, 3, 1).numpy(),
        "pixels_other": other.permute(0, 2, 3, 1).numpy(),
        "input_ids": ids.astype(np.int32),
        "attention_mask": mask.astype(np.int32),
    }
    tower, info = CLIPVisionModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"], info
    with_projection = CLIPVisionModelWithProjection.from_pretrained(folder)
    full = CLIPModel.from_pretrained(folder).eval()
    with torch.no_grad():
        out = tower.eval()(pixels)
        refs["last_hidden_state"], refs["pooler_output"] = out.last_hidden_state.numpy(), out.pooler_output.numpy()
        out = tower(other, interpolate_pos_encoding=True)
        refs["last_hidden_state_other"] = out.last_hidden_state.numpy()
        refs["pooler_output_other"] = out.pooler_output.numpy()
        refs["image_embeds"] = with_projection.eval()(pixels).image_embeds.numpy()
        features = full.get_image_features(pixels)
        refs["get_image_features"] = (features if torch.is_tensor(features) else features.pooler_output).numpy()
        t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        features = full.get_text_features(t_ids, attention_mask=t_mask)
        refs["get_text_features"] = (features if torch.is_tensor(features) else features.pooler_output).numpy()
        logits = full(input_ids=t_ids, attention_mask=t_mask, pixel_values=pixels).logits_per_image
        refs["logits_per_image"] = logits.numpy()
    np.testing.assert_allclose(refs["get_image_features"], refs["image_embeds"], rtol=0, atol=1e-6)
    np.savez_compressed(folder / "reference.npz", **refs)


def alone(gen: torch.Generator) -> None:
    folder = OUT / "with_projection"
    model = CLIPVisionModelWithProjection(CLIPVisionConfig(**ALONE)).eval()
    randomise(model, gen)
    model.save_pretrained(folder)
    loaded, info = CLIPVisionModelWithProjection.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    pixels = torch.randn(2, 3, 8, 8, generator=gen)
    with torch.no_grad():
        out = loaded.eval()(pixels)
    np.savez_compressed(
        folder / "reference.npz",
        pixels=pixels.permute(0, 2, 3, 1).numpy(),
        last_hidden_state=out.last_hidden_state.numpy(),
        image_embeds=out.image_embeds.numpy(),
    )


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    clip_model(gen)
    alone(gen)


if __name__ == "__main__":
    main()
