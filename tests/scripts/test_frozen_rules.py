"""train/main.py's SHARDING_RULES lay out every module a run places, not only the trained state: the
frozen text tower by its path in the step's frozen argument (`text_encoder.`) and a latent run's VAE by
`autoencoder.`, each checked by the `.sharding` of its leaves. main runs up to the step's construction
(its own setup, no compile), where the test takes what it was handed."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode  # train/encode.py
import main as train_main
from eqxdiff.sharding import check_rules_match, fsdp_spec, leaf_names
from eqxdiff.data import load_tokenizer
from runs import ROOT, random_clip_folder, train_here

TOKENIZER = ROOT / "tests" / "data" / "clip_tokenizer" / "sd1"
SD_LIKE = ROOT / "tests" / "data" / "autoencoder_kl" / "sd_like"
MIN_SIZE = 64  # small: the size rule shards most leaves of these tiny towers over fsdp
LAYOUT = [
    "--model",
    "unet_tiny",
    "--batch_size",
    8,
    "--steps",
    1,
    "--wandb",
    "disabled",
    "--fsdp_size",
    2,
    "--fsdp_min_param_size",
    MIN_SIZE,
]


class Built(Exception):
    pass


def built_step(monkeypatch, rules: list, *flags) -> dict:
    """The keyword arguments main hands `make_train_step` for `flags`, with SHARDING_RULES = `rules`."""
    built = {}

    def capture(**kwargs):
        built.update(kwargs)
        raise Built

    monkeypatch.setattr(train_main, "make_train_step", capture)
    monkeypatch.setattr(train_main, "SHARDING_RULES", rules)
    with pytest.raises(Built):
        train_here(*flags, *LAYOUT)
    return built


def shard_anyway(shape, fsdp_size, min_size):
    """A spec function that shards a leaf however small: the size rule's with no threshold."""
    return fsdp_spec(shape, fsdp_size, 0)


def test_one_rule_list_lays_out_the_frozen_text_tower(tmp_path, monkeypatch):
    tokenizer = load_tokenizer(TOKENIZER)
    config = dict(
        vocab_size=tokenizer.tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=16,
        eos_token_id=int(tokenizer([""])[0][0, 1]),
    )
    tower = random_clip_folder(tmp_path / "text_encoder", config)
    flags = [
        "--run_dir",
        tmp_path / "run",
        "--dataset",
        "captioned_digits",
        "--text_encoder",
        tower,
        "--tokenizer",
        TOKENIZER,
    ]
    rules = [
        (r"^text_encoder\.embeddings\.token_embedding\.weight$", P()),  # big: the size rule shards it
        (r"^text_encoder\.final_layer_norm\.weight$", shard_anyway),  # 32 elements: the size rule replicates it
    ]
    built = built_step(monkeypatch, rules, *flags)
    frozen = built["frozen_shardings"]["text_encoder"]  # the step's frozen argument
    loaded = built["prepare"].keywords["condition"].text.encoder  # the tower as run_condition read it
    for name, want in (("embeddings.token_embedding.weight", P()), ("final_layer_norm.weight", P("fsdp"))):
        leaf, sharding = loaded, frozen
        for part in name.split("."):
            leaf, sharding = getattr(leaf, part), getattr(sharding, part)
        assert fsdp_spec(leaf.shape, 2, MIN_SIZE) != want  # what the size rule alone would do
        assert sharding.spec == want, name
        assert leaf.sharding == sharding, name  # read into it at load: the frozen placement moves nothing
    other = loaded.encoder.layers[0].mlp.fc1.weight  # a leaf no rule names keeps the size rule's layout
    assert other.sharding.spec == fsdp_spec(other.shape, 2, MIN_SIZE) != P()
    # The state's parameters matched no rule (each rule names the tower): laid out by size, no error.
    assert any("fsdp" in s.spec for s in jax.tree.leaves(built["state_shardings"].model))

    # A rule that matches no leaf of any module the run placed is a typo: one line, with the names there are.
    with pytest.raises(
        SystemExit,
        match=r"SHARDING_RULES in train/main.py: Sharding rule '\^text_encodr\S*' "
        r"matches no leaf .*'text_encoder\.",
    ):
        built_step(monkeypatch, [(r"^text_encodr\.", P())], *flags)
    # A spec that does not fit the tower's leaf is one line naming the rules, not the tower's folder.
    with pytest.raises(
        SystemExit,
        match=r"^SHARDING_RULES in train/main.py: leaf text_encoder\.final_layer_norm"
        r"\.weight of shape \(32,\).* names 2 dimensions",
    ):
        built_step(monkeypatch, [(r"^text_encoder\.final_layer_norm\.weight$", P(None, "fsdp"))], *flags)


def test_one_rule_list_lays_out_a_latent_runs_vae(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "rgb.npz", images=rng.integers(0, 256, (8, 16, 16, 3), dtype=np.uint8), labels=np.arange(8) % 2)
    encode.main(
        encode.parse_config(
            [
                "--dataset",
                f"npz:{tmp_path / 'rgb.npz'}",
                "--vae",
                str(SD_LIKE),
                "--out",
                str(tmp_path / "latents"),
                "--batch_size",
                "8",
            ]
        )
    )
    rule = (r"^autoencoder\.decoder\.conv_out\.weight$", P())
    built = built_step(
        monkeypatch, [rule], "--run_dir", tmp_path / "run", "--dataset", f"latents:{tmp_path / 'latents'}"
    )
    vae = built["prepare"].keywords["codec"].autoencoder
    conv_out = vae.decoder.conv_out.weight
    assert fsdp_spec(conv_out.shape, 2, MIN_SIZE) != P()  # the size rule alone would shard it
    assert conv_out.sharding.spec == P()
    conv_in = vae.decoder.conv_in.weight  # a leaf no rule names keeps the size rule's layout
    assert conv_in.sharding.spec == fsdp_spec(conv_in.shape, 2, MIN_SIZE) != P()

    # A spec that does not fit its leaf is one line naming the rules, the VAE's leaf or the model's alike.
    flags = ["--run_dir", tmp_path / "run", "--dataset", f"latents:{tmp_path / 'latents'}"]
    for regex in (r"^autoencoder\.decoder\.conv_out\.weight$", r"^conv_out\.weight$"):
        with pytest.raises(
            SystemExit,
            match=r"^SHARDING_RULES in train/main.py: leaf (autoencoder\.decoder\.)?"
            r"conv_out\.weight of shape .* does not divide it",
        ):
            built_step(monkeypatch, [(regex, P("fsdp"))], *flags)  # a 3×3 kernel's 3 rows into 2


def test_a_rule_counts_as_matched_in_any_module_the_run_placed():
    state = {"conv_out": np.zeros((3, 3))}
    modules = {"text_encoder": None, "autoencoder": {"decoder": {"conv_out": np.zeros(2)}}}
    check_rules_match([(r"^autoencoder\.decoder\.conv_out$", P()), ("^conv_out$", P())], [state, None, modules])
    assert "autoencoder.decoder.conv_out" in jax.tree.leaves(leaf_names(modules))
    with pytest.raises(ValueError, match=r"Sharding rule '\^decoder' matches no leaf"):
        check_rules_match([("^decoder", P())], [state, None, modules])
