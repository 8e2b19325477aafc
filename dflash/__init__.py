"""dflash: exact, faster prefill for llama.cpp models."""

__version__ = "0.1.0"
