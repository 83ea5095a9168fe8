"""What no lesson changes: the Qwen3 model, its checkpoint and tokenizer, the HF reference and the smoke harness."""
