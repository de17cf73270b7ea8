"""The guard at run time: interception (``intercept``), which GEMMs are verified
(``sampling``), weight-side encodings (``cache``), per-step accounts (``ledger``,
``report``, ``stats``), ``protect()`` / ``Guard`` (``guard``) and the fault drills
(``inject``).

``sdc_guard.guard``, ``sdc_guard.sampling`` and ``sdc_guard.inject`` are these modules
under their former names (``sdc_guard/__init__.py``).
"""
