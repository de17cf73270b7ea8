"""The compiled route (docs/COMPILE.md): the graph pass that puts a check node after every
GEMM of the graphs a compiler is handed (``graph_pass``, ``graph_ops``, ``graph_install``,
``graph_checks``), the function mode that marks a ``protect()`` block for dynamo and checks
the eager frames around compiled code (``function_mode``, ``function_gemm``,
``function_attention``), and the module paths sites are named by (``module_names``).
"""
