"""Write tests/data/clip_score/: a small random CLIPModel folder and what torchmetrics' `CLIPScore` makes of it, for
tests/eval/test_clip_score.py.

`model/`: a transformers `CLIPModel` (`save_pretrained`; text tower width 8, 2 layers, the 10,514 ids of
tests/data/clip_tokenizer/sd1/, eos_token_id 2 as openai's configs (pooling at the largest id); vision tower
width 16, 2 layers, 40×40 images, patch 8; projections to 8) and its `preprocessor_config.json` (CLIPImageProcessor:
shortest edge 40, centre crop 40, OpenAI's mean and std). The tokenizer files are sd1's: the test copies them in,
as this script does for torchmetrics.

`reference.npz`: uint8 images `image_<i>` (HWC, four shapes: wider, square at the crop size, smaller, taller),
`captions` (one longer than the 77 positions), what transformers' CLIPProcessor makes of them (its PIL backend,
which transformers 5 takes where torchvision is not installed, as here: torchvision's wheels on this index do not
load with the CPU torch) — `pixel_values` (NHWC float32), `input_ids`, `attention_mask` (padded to the longest, as
torchmetrics asks, then cut to 77) — the shortest-edge resize alone by torch's uint8 kernel (`torch_resized_<i>`,
what torchvision's backend runs) and by Pillow (`pil_resized_<i>`), the
per-pair `scores` (100·cos) of torchmetrics' `_clip_score_update`, and `clip_score`: `CLIPScore(...)` updated with
the four pairs in two batches, `compute()`d. torchmetrics 1.9 is given the model and processor as its callable
`model_name_or_path` (it accepts local paths only when they name an openai model), the model's
`get_image_features`/`get_text_features` returning the tensors (transformers 5 wraps them in an output object,
which torchmetrics 1.9 does not unwrap).

    tools/.venv/bin/pip install torchmetrics==1.9.0   # over requirements-ports.txt
    tools/.venv/bin/python tools/make_clip_score_fixture.py
"""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchmetrics.functional.multimodal.clip_score import _clip_score_update
from torchmetrics.multimodal.clip_score import CLIPScore
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

ROOT = Path(__file__).resolve().parent.parent / "tests" / "data"
OUT = ROOT / "clip_score"
TOKENIZER = ROOT / "clip_tokenizer" / "sd1"
SIZE = 40
TEXT = dict(
    vocab_size=10514,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
    projection_dim=8,
)
VISION = dict(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=SIZE,
    patch_size=8,
    hidden_act="quick_gelu",
    projection_dim=8,
)
CAPTIONS = [
    "a photo of a cat",
    "two dogs playing in the snow",
    "a red car",
    " ".join(["a very long caption about a house by the sea"] * 10),
]
SHAPES = [(50, 70), (SIZE, SIZE), (30, 36), (90, 44)]  # (h, w)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    folder = OUT / "model"
    model = CLIPModel(CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=8)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape, generator=gen))
                module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=gen))
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
    model.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}).save_pretrained(folder)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SHAPES]
    refs: dict[str, np.ndarray] = {f"image_{i}": im for i, im in enumerate(images)}
    refs["captions"] = np.array(CAPTIONS)
    with (
        tempfile.TemporaryDirectory() as tmp
    ):  # the folder torchmetrics reads: the model, its processor, sd1's tokenizer
        full = Path(tmp) / "clip"
        shutil.copytree(folder, full)
        for f in TOKENIZER.iterdir():
            shutil.copy(f, full / f.name)
        processor = CLIPProcessor.from_pretrained(full)
        # without torchvision, transformers 5 takes the PIL backend (torchvision's resizes by torch's uint8 kernel)
        assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil", processor.image_processor
        tensors = [torch.from_numpy(im).permute(2, 0, 1) for im in images]
        processed = processor(text=CAPTIONS, images=tensors, return_tensors="pt", padding=True)
        refs["pixel_values"] = processed["pixel_values"].permute(0, 2, 3, 1).numpy()
        refs["input_ids"] = processed["input_ids"][:, :77].numpy().astype(np.int32)
        refs["attention_mask"] = processed["attention_mask"][:, :77].numpy().astype(np.int32)
        for i, t in enumerate(tensors):  # the resize alone (shortest edge to SIZE): torch's uint8 kernel, Pillow's
            h, w = t.shape[1:]
            size = (SIZE, int(SIZE * w / h)) if h <= w else (int(SIZE * h / w), SIZE)
            resized = torch.nn.functional.interpolate(t[None].contiguous(), size=size, mode="bicubic", antialias=True)
            refs[f"torch_resized_{i}"] = resized[0].permute(1, 2, 0).numpy()
            pil = Image.fromarray(images[i]).resize((size[1], size[0]), Image.Resampling.BICUBIC)
            refs[f"pil_resized_{i}"] = np.asarray(pil)
        model = CLIPModel.from_pretrained(full).eval()
        image_features, text_features = model.get_image_features, model.get_text_features
        # transformers 5 returns the projected vectors as an output's pooler_output; torchmetrics 1.9 expects the tensor
        model.get_image_features = lambda *a, **k: image_features(*a, **k).pooler_output
        model.get_text_features = lambda *a, **k: text_features(*a, **k).pooler_output
        metric = CLIPScore(model_name_or_path=lambda: (model, CLIPProcessor.from_pretrained(full)))
        with torch.no_grad():
            scores, _ = _clip_score_update(tensors, CAPTIONS, metric.model, metric.processor)
            metric.update(tensors[:2], CAPTIONS[:2])
            metric.update(tensors[2:], CAPTIONS[2:])
            refs["clip_score"] = metric.compute().numpy()
    refs["scores"] = scores.numpy()
    np.savez_compressed(OUT / "reference.npz", **refs)
    print("scores", refs["scores"], "clip_score", refs["clip_score"])


if __name__ == "__main__":
    main()
