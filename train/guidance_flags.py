"""train/sample.py's `--guide_run`: the weak model checked against the run it guides (autoguidance needs a weaker
model of the same task). `--guidance_interval LO,HI` is parsed by eqxdiff/run/sampling.py's parse_interval."""

from eqxdiff.run.open_condition import stored_condition


def check_same_task(run_dir: str, stored: dict, guide_run: str, guide_stored: dict) -> None:
    """Refuse (SystemExit, one line naming both runs) a --guide_run whose samples mean something else than
    --run_dir's: another codec (pixels, latents of another VAE), condition or sample shape."""
    codec = lambda s: s.get("codec") or s.get("autoencoder") or {"kind": "pixels"}  # noqa: E731 (older runs: a VAE)
    for what, read in (("codec", codec), ("condition", stored_condition), ("sample shape", lambda s: s["image_shape"])):
        mine, theirs = read(stored), read(guide_stored)
        if mine != theirs:
            raise SystemExit(f"--guide_run {guide_run} has {what} {theirs}, --run_dir {run_dir} has {mine}: "
                             "autoguidance needs a weaker model of the same task (same data, codec and condition).")  # fmt: skip
