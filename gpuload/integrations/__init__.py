"""Where training code already lives: HF Accelerate (``gpuload.integrations.accelerate``) and
HF Transformers' Trainer (``gpuload.integrations.transformers``).

Each module imports its framework, so nothing here is imported by ``import gpuload``: import
the one you use.
"""
