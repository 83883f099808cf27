"""Models alone: Hugging Face directory -> (config, weights, tokenizer) -> forward()."""
