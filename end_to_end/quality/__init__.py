"""Video quality of faster settings, quantization, step caches and few-step samplers, against a reference."""
