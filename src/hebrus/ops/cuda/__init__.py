"""Kernels for CUDA through flash-linear-attention (`pip install hebrus[cuda]`). Imported only
when a model on a CUDA device builds its op table; the CPU path never imports fla or triton."""
