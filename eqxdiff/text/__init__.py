"""Text for eqxdiff: how a run's captions become its model's condition (`conditioning`). The host
tokenizers run with the data pipeline: `eqxdiff.data.load_tokenizer`, `eqxdiff.data.word_tokenizer`."""
