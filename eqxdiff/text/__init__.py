"""Text for eqxdiff: how a run's captions become its model's condition (`conditioning`), and SDXL's
prompts as its pipeline folder encodes them (`sdxl_prompts.SDXLPrompts`). The host
tokenizers run with the data pipeline: `eqxdiff.data.load_tokenizer`, `eqxdiff.data.word_tokenizer`."""
