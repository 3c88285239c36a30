"""The released Stable Diffusion UNets' diffusers configs (`unet/config.json` of runwayml's / the
stable-diffusion-v1-5 and stabilityai/stable-diffusion-xl-base-1.0 pipelines), as dicts: the benchmarks
build these architectures with random weights (nothing is downloaded). tests/sd/test_sd_unet_size.py holds
them equal to the configs tools/make_sd_unet_fixtures.py took from diffusers (tests/data/sd_unet)."""

SD15_UNET = {
    "_class_name": "UNet2DConditionModel", "act_fn": "silu", "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False, "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}  # fmt: skip

SDXL_BASE_UNET = {
    "_class_name": "UNet2DConditionModel", "act_fn": "silu", "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64, "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280], "center_input_sample": False, "class_embed_type": None,
    "class_embeddings_concat": False, "conv_in_kernel": 3, "conv_out_kernel": 3, "cross_attention_dim": 2048,
    "cross_attention_norm": None, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1, "dual_cross_attention": False, "encoder_hid_dim": None, "encoder_hid_dim_type": None,
    "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_only_cross_attention": None, "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05, "norm_num_groups": 32, "num_attention_heads": None, "num_class_embeds": None,
    "only_cross_attention": False, "out_channels": 4, "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0, "resnet_skip_time_act": False, "resnet_time_scale_shift": "default",
    "sample_size": 128, "time_cond_proj_dim": None, "time_embedding_act_fn": None, "time_embedding_dim": None,
    "time_embedding_type": "positional", "timestep_post_act": None, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "upcast_attention": None,
    "use_linear_projection": True,
}  # fmt: skip
