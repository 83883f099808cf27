"""Data for the reference model pair: a corpus of real Python source (``corpus``) and its BPE tokenizer (``bpe``)."""
