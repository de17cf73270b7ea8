"""The guard at run time, one folder per concern along the data path:

- ``sampling/``: which GEMMs are verified (``sampling`` is the samplers' public module) and
  the step clock (``schedule``);
- ``dispatch/``: the eager route's interception (the dispatch mode and the op registry);
- ``checking/``: verify one GEMM, with the weight-side encodings cached;
- ``compiled/``: the compiled route (check nodes in the compiled graphs, the function mode);
- ``collectives/``: the checks of the collectives and their drills;
- ``drills/``: the GEMM and parameter fault drills;
- ``lifecycle/``: ``protect()`` / ``Guard``, its configuration, interception switch,
  accounts and calibration.

The imports go one way: each folder imports only the folders listed before it, so nothing
imports ``lifecycle``, the guard that drives them (tests/unit/test_layout.py checks it).
The former flat paths (``sdc_guard.runtime.guard``, ``sdc_guard.guard``, ...) are the same
modules (``sdc_guard/__init__.py``).
"""
