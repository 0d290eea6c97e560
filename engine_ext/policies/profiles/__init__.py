"""Profiles measured on devices this project has run on (``BUILTIN_PROFILES`` names them).

``h200-llama-3-8b.json``: the native engine on one NVIDIA H200 (2026-11-28, the
``profile`` phase of ``scripts/gpu_first_run.sh``; docs/benchmarks.md, "The third
GPU run"), the Llama-3-8B shape with random bfloat16 weights.  Decodes of up to 16
rows replay CUDA graphs (4.7-4.9 ms a step, the weights' read at ~3.4 TB/s);
larger steps run eagerly and are host-bound up to ~1k tokens (22-24 ms), so this
is the engine as it is, not the GPU's bound (the derived ``h100-*`` rooflines).
"""
