"""EAGLE-style feature-head drafting: the head, its checkpoints, and self-distillation training."""
