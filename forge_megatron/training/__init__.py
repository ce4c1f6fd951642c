"""Training: the train_forge.py command line (Megatron flags + forge flags), the RL loop on Megatron-Core,
checkpoints that commit the data pool, metrics, the supervised warm-start and the end-to-end CPU demo.
See docs/training.md."""
