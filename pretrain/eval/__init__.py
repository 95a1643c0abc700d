"""Evaluation: held-out MLM loss/accuracy, downstream probes and fine-tuning, task files; ``python -m pretrain.evaluate``."""
