"""The guidance flags of train/main.py and train/sample.py: `--cfg_interval LO,HI` parsed, and `--guide_run`'s
weak model checked against the run it guides (autoguidance needs a weaker model of the same task)."""

from eqxdiff.run.open_condition import stored_condition


def parse_interval(text: str) -> tuple[float, float] | None:
    """"LO,HI" -> (LO, HI), the σ interval (LO, HI] where classifier-free guidance applies; "" -> None (every σ).
    Anything else raises ValueError naming the form."""
    if not text:
        return None
    try:
        lo, hi = (float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--cfg_interval must be LO,HI (two σ, e.g. 0.28,2.9), got {text!r}") from None
    if not 0 <= lo < hi:
        raise ValueError(f"--cfg_interval LO,HI needs 0 <= LO < HI, got {text!r}")
    return lo, hi


def check_same_task(run_dir: str, stored: dict, guide_run: str, guide_stored: dict) -> None:
    """Refuse (SystemExit, one line naming both runs) a --guide_run whose samples mean something else than
    --run_dir's: another codec (pixels, latents of another VAE), condition or sample shape."""
    codec = lambda s: s.get("codec") or s.get("autoencoder") or {"kind": "pixels"}  # noqa: E731 (older runs: a VAE)
    for what, read in (("codec", codec), ("condition", stored_condition), ("sample shape", lambda s: s["image_shape"])):
        mine, theirs = read(stored), read(guide_stored)
        if mine != theirs:
            raise SystemExit(f"--guide_run {guide_run} has {what} {theirs}, --run_dir {run_dir} has {mine}: "
                             "autoguidance needs a weaker model of the same task (same data, codec and condition).")  # fmt: skip
