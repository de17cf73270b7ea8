"""The collectives of a guarded step (docs/DISTRIBUTED.md): what each rank sent against what
each received (``collective_checks``), and their fault drills (``collective_faults``).
"""
