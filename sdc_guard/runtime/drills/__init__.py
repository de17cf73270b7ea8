"""Fault drills: corrupt chosen GEMM outputs or parameters, reproducibly (``inject``), by
the fault models of ``GemmFault.kind`` (``fault_models``).
"""
