"""CLIP score (Hessel et al. 2021) as torchmetrics' `CLIPScore` computes it: each image and its caption through a
full CLIP model (a transformers CLIPModel folder with its tokenizer and `preprocessor_config.json`, e.g.
openai/clip-vit-large-patch14), 100·cos(image embedding, text embedding) per pair, and the score
max(mean over pairs, 0) — torchmetrics clamps the mean, not each pair, whatever its docstring's formula says.

The inputs are made as transformers' CLIPProcessor makes them for torchmetrics: uint8 images resized so their
shortest edge is `size["shortest_edge"]` (the other int(s·long/short)) by antialiased bicubic in uint8 (the
torchvision backend's torch kernel, what transformers 5 takes where torchvision is installed, or Pillow's with
`kernel="pillow"`: the PIL backend it takes otherwise), centre-cropped to `crop_size` (top (h - c) // 2), scaled
by 1/255 and normalised by the config's mean and std; captions tokenized with bos/eos, padded to the longest and
cut to the text tower's positions (a caption beyond them loses its eos, as in torchmetrics).
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from eqxdiff.data.tokenizer import TextTokenizer, load_tokenizer
from eqxdiff.nn.bicubic import resize_uint8
from eqxdiff.nn.clip_model import CLIPModel

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIPImageProcessor's defaults (transformers' OPENAI_CLIP_*)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class CLIPImageProcessing:
    """CLIPImageProcessor's settings from a folder's `preprocessor_config.json`."""

    shortest_edge: int = 224
    crop: tuple[int, int] = (224, 224)
    mean: tuple[float, ...] = OPENAI_MEAN
    std: tuple[float, ...] = OPENAI_STD
    rescale_factor: float = 1 / 255
    kernel: str = "torch"

    @classmethod
    def from_folder(cls, folder: Path, kernel: str = "torch") -> "CLIPImageProcessing":
        path = folder / "preprocessor_config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} holds no preprocessor_config.json: pass a CLIP folder as transformers "
                "saves it (openai/clip-vit-large-patch14 holds one)"
            )
        config = json.loads(path.read_text())
        size, crop = config.get("size", {"shortest_edge": 224}), config.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if (
            not isinstance(size, dict)
            or set(size) != {"shortest_edge"}
            or config.get("resample", 3) != 3
            or not all(config.get(flag, True) for flag in ("do_resize", "do_center_crop", "do_rescale", "do_normalize"))
        ):
            raise ValueError(
                f"{path}: only CLIP's own processing (a shortest_edge resize, bicubic, centre crop, "
                "rescale, normalise) is implemented"
            )
        return cls(
            shortest_edge=size["shortest_edge"],
            crop=(crop["height"], crop["width"]),
            mean=tuple(config.get("image_mean", OPENAI_MEAN)),
            std=tuple(config.get("image_std", OPENAI_STD)),
            rescale_factor=config.get("rescale_factor", 1 / 255),
            kernel=kernel,
        )

    def __call__(self, image: np.ndarray) -> np.ndarray:
        """uint8 `[h, w, 3]` (grayscale `[h, w]` or `[h, w, 1]` repeated to RGB) -> float32 `[crop_h, crop_w, 3]`."""
        image = np.asarray(image)
        if image.dtype != np.uint8:
            raise ValueError(f"CLIP score takes uint8 images, got {image.dtype}")
        image = (
            np.repeat(image.reshape(*image.shape[:2], -1), 3, axis=-1)
            if image.ndim == 2 or image.shape[-1] == 1
            else image
        )
        h, w = image.shape[:2]
        s = self.shortest_edge
        size = (s, int(s * w / h)) if h <= w else (int(s * h / w), s)  # transformers' get_resize_output_image_size
        image = resize_uint8(image, size, kernel=self.kernel)
        ch, cw = self.crop
        if ch > size[0] or cw > size[1]:
            raise ValueError(f"crop {self.crop} is larger than the resized {size}: not CLIP's processing")
        top, left = (size[0] - ch) // 2, (size[1] - cw) // 2
        x = image[top : top + ch, left : left + cw].astype(np.float64) * self.rescale_factor
        return ((x.astype(np.float32) - np.float32(self.mean)) / np.float32(self.std)).astype(np.float32)


def caption_ids(tokenizer: TextTokenizer, captions: Sequence[str], positions: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) int32 `[b, n]`: bos + tokens + eos, padded to the longest, cut to `positions`."""
    encodings = tokenizer.tokenizer.encode_batch(list(captions), add_special_tokens=True)
    n = min(max(len(e.ids) for e in encodings), positions)
    ids = np.full((len(captions), n), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(captions), n), np.int32)
    for row, e in enumerate(encodings):
        ids[row, : min(len(e.ids), n)] = e.ids[:n]
        mask[row, : min(len(e.ids), n)] = 1
    return ids, mask


@eqx.filter_jit
def pair_scores(
    model: CLIPModel, pixels: Float[Array, "b h w 3"], input_ids: Int[Array, "b n"], attention_mask: Int[Array, "b n"]
) -> Float[Array, " b"]:
    """100·cos(image_i, caption_i) per pair (torchmetrics' `_clip_score_update`)."""
    images = model.get_image_features(pixels)
    texts = model.get_text_features(input_ids, attention_mask)
    images = images / jnp.linalg.norm(images, axis=-1, keepdims=True)
    texts = texts / jnp.linalg.norm(texts, axis=-1, keepdims=True)
    return 100 * (images * texts).sum(-1)


class CLIPScorer:
    """A CLIP folder's model, tokenizer and image processing: `scores(images, captions)` gives 100·cos per pair,
    `clip_score` of them torchmetrics' CLIPScore."""

    def __init__(self, model: CLIPModel, tokenizer: TextTokenizer, processing: CLIPImageProcessing):
        self.model, self.tokenizer, self.processing = model, tokenizer, processing

    @classmethod
    def from_transformers(cls, path: str | Path, *, kernel: str = "torch") -> "CLIPScorer":
        """A transformers CLIPModel folder with its tokenizer files and preprocessor_config.json (what
        `huggingface-cli download openai/clip-vit-large-patch14` leaves). `kernel`: the uint8 resize of
        transformers' torchvision backend ("torch") or of its PIL backend ("pillow")."""
        folder = Path(path).expanduser()
        processing = CLIPImageProcessing.from_folder(folder, kernel)
        return cls(CLIPModel.from_transformers(folder), load_tokenizer(folder), processing)

    def inputs(
        self, images: Sequence[np.ndarray], captions: Sequence[str]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pixel_values NHWC float32, input_ids, attention_mask) as CLIPProcessor gives them to torchmetrics."""
        if len(images) != len(captions):
            raise ValueError(f"CLIP score pairs images with captions: {len(images)} images, {len(captions)} captions")
        pixels = np.stack([self.processing(image) for image in images])
        positions = self.model.text_model.embeddings.position_embedding.weight.shape[0]
        return (pixels, *caption_ids(self.tokenizer, captions, positions))

    def scores(self, images: Sequence[np.ndarray], captions: Sequence[str]) -> np.ndarray:
        """100·cos(image, caption) per pair, float32 `[n]`."""
        return np.asarray(pair_scores(self.model, *self.inputs(images, captions)))


def clip_score(scores: Sequence[float] | np.ndarray) -> float:
    """torchmetrics' CLIPScore of per-pair scores (every pair of every batch): max(their mean, 0)."""
    return max(float(np.mean(np.asarray(scores, np.float64))), 0.0)
