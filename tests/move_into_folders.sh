#!/usr/bin/env bash
# Issue 54 §3: the tests move into folders that mirror the package (tests/README.md has the rule).
# Run from the repository root. Idempotent: a file already moved is skipped, a rewrite already made
# matches nothing, so the lead can rerun it after merging a branch that predates the move, with a
# `move FOLDER test_new.py` line added for each new root test file.
#
# What `move` does to a file besides `git mv`: its paths built from `Path(__file__)` gain one level
# (tests/data is now one folder up). After all moves, across the tree: `from test_x import` between
# test files becomes `from tests.FOLDER.test_x import` (tests/ and its folders are packages), and
# every text that names `tests/test_x.py` names its new place.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

declare -A FOLDER_OF=()

move() {  # move FOLDER FILE...: tests/FILE -> tests/FOLDER/FILE
  local folder=$1; shift
  mkdir -p "tests/$folder"
  [ -e "tests/$folder/__init__.py" ] || { : > "tests/$folder/__init__.py"; git add "tests/$folder/__init__.py"; }
  for name in "$@"; do
    FOLDER_OF[$name]=$folder
    if [ -e "tests/$name" ]; then
      git mv "tests/$name" "tests/$folder/$name"
      perl -0pi -e '
        s/Path\(__file__\)(\.resolve\(\))?\.parents\[1\]/Path(__file__)$1.parents[2]/g;
        s/Path\(__file__\)(\.resolve\(\))?\.parent\.parent\b(?!s)/Path(__file__)$1.parents[2]/g;
        s/Path\(__file__\)(\.resolve\(\))?\.parent\b(?!s)/Path(__file__)$1.parents[1]/g;
      ' "tests/$folder/$name"
    fi
  done
}

[ -e tests/__init__.py ] || { : > tests/__init__.py; git add tests/__init__.py; }

# σ-space core (eqxdiff/diffusion/) and the step (eqxdiff/training/step.py), sampling and decoding (generate.py, images.py)
move core test_schedules.py test_loss.py test_samplers.py test_denoiser_guidance.py test_guidance_interval.py \
  test_autoguidance.py test_train_step.py test_train_math.py test_text_step.py test_generate_images.py test_images.py
# networks and their layers (eqxdiff/nn/, autoencoders.py, xla_cpu.py)
move nn test_unet.py test_dit.py test_attention.py test_layers.py test_text_models.py test_model_contract.py \
  test_lora.py test_xla_cpu.py test_autoencoder_kl.py test_clip_text.py test_clip_model_folder.py test_edm2.py \
  test_vae_tiling.py test_vae_sizes.py
# Stable Diffusion (eqxdiff/sd/)
move sd test_sd_unet.py test_sd_unet_size.py test_sd_pipeline.py test_sd_pipeline_export.py test_sd_export.py \
  test_sd_scheduler.py test_sd_tiny_model.py test_sdxl_text.py
# published checkpoints (eqxdiff/pretrained/)
move pretrained test_pretrained_dit.py test_pretrained_sit.py test_pretrained_sharded_load.py test_dit_export.py \
  test_dit_sampling.py test_sit_sampling.py
# weight-file formats (eqxdiff/weights/)
move weights test_torch_pickle.py test_torch_save.py
# sources, pipelines, tokenizers, prefetch (eqxdiff/data/; tests/data/ holds the fixtures)
move datasets test_data.py test_captions.py test_tokenizer.py test_tokenizer_files.py test_prefetch.py \
  test_offline.py test_latents.py
# the engine (eqxdiff/training/ but the step, checkpoint.py, sharding.py)
move training test_checkpoint.py test_sharding.py test_logging.py test_metrics.py test_phema.py
# sample quality (eqxdiff/eval/)
move eval test_eval.py test_fid.py test_frechet.py test_inception.py test_evaluate_adm.py test_feature_stats.py \
  test_precision_recall.py test_sample_batches.py
# a run's description and rebuild (eqxdiff/run/)
move run test_codecs.py test_conditions.py test_rebuild.py test_model_args.py test_legacy_checkpoint.py \
  test_sampling.py test_finetune.py test_finetune_sdxl.py
# the train/ scripts as a user runs them (CLI, errors, resume, multi-host, buckets, recipes end to end)
move scripts test_cli.py test_train_main.py test_script_errors.py test_resume.py test_multihost.py test_bucket.py \
  test_latent_training.py test_text_training.py test_sample_guidance.py test_sample_pretrained.py \
  test_xla_cpu_auto.py test_evaluate_script.py test_frozen_rules.py
# merged after the move: issue 56's towers and metrics
move nn test_dinov2.py test_clip_vision.py
move eval test_fd_dinov2.py test_clip_score.py
move training test_repa.py
# issue 55's objective (eqxdiff/diffusion/meanflow.py)
move core test_meanflow.py
# Left at tests/: the house (test_import_cycles, test_docs, test_readme_examples, test_notebooks,
# test_typecheck_hook, test_bench_harness, test_hlo_ops, test_accelerator, test_tests_layout) and the helpers.

# Imports between test files: tests.FOLDER.test_x (tests/ on sys.path keeps the helpers' bare names).
# References by path: tests/test_x.py -> tests/FOLDER/test_x.py in every tracked text file.
for name in "${!FOLDER_OF[@]}"; do
  stem=${name%.py}
  folder=${FOLDER_OF[$name]}
  git ls-files -z 'tests/*.py' | xargs -0 perl -pi -e "s/^(\\s*)from $stem import/\\1from tests.$folder.$stem import/"
  { git grep -lz -I -F "tests/$name" -- . ':!tests/data' || true; } | xargs -0 -r perl -pi -e "s{\\btests/\Q$name\E}{tests/$folder/$name}g"
done
