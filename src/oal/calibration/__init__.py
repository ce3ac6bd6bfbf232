"""Kernel calibration by output matching (paper Eq. 20, App. B): settings and data (`data`), the batched fit
(`fit`), per-layer resume and one-pass capture for a run directory (`resume`), calibration straight from a model
(`model`), and the kernel files it writes (`kernels`: kernels.safetensors + kernels.json)."""
