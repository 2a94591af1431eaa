"""What fxckpt knows of the frameworks around a model (Hugging Face transformers, diffusers)."""
