"""Small model assets built locally (tiny HF checkpoints and tokenizer for tests and the demo)."""
