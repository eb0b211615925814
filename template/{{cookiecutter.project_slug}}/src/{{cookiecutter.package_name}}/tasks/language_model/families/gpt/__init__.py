"""The GPT-2-style family: model.py (the module), hf.py (its Hugging Face layout), sizing.py (its shape for plan)."""
