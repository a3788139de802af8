"""Training: corpus and tokenizer, per-head Muon, Quantile Balancing, checkpoints and the loop of `openk3 train`."""
