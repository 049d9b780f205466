"""Loading: a pipeline's components from a folder, single files or the Hub (loading.py,
single_file.py), where their weights live (placement.py) and LoRA adapters (lora_loading.py).
Imports nothing else of `pipelines.pipeline`."""
