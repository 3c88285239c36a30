"""Text for eqxdiff: how a run's captions become its model's condition (`conditioning`; SDXL's:
`sdxl_condition`; SDXL's prompts as its pipeline folder encodes them are `eqxdiff.sd.sdxl_prompts`). The host
tokenizers run with the data pipeline: `eqxdiff.data.load_tokenizer`, `eqxdiff.data.word_tokenizer`."""
