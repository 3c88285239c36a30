"""Weight files as PyTorch, diffusers and transformers write them, read and written as numpy without torch.

`torch_pickle`: torch files (`torch.save`'s `.pt`/`.pth`/`.bin`) read without running anything they name;
`torch_save`: a state_dict written as `torch.save` writes one; `tensor_readers`: a `{name: array}` dict (or a
torch file) behind safetensors' reader interface; `weight_files`: which safetensors files of a model folder
hold its weights (variants, index shards); `model_folder`: one model folder written as `save_pretrained` writes
it. Loading these into Equinox modules by name is eqxdiff.nn.torch_weights (it needs nn's layer layouts).
"""
