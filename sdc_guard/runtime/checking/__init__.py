"""Verify one GEMM: the screen's threshold for its dtype and device and the backend that
computes it (``checker``), and the weight-side encodings cached across steps (``cache``).
"""
