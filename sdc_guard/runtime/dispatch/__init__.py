"""The eager route's interception: a ``TorchDispatchMode`` (``intercept``) and the op
registry it consults (``ops``: which aten op is a GEMM, an attention call, a collective, a
higher-order op), with the handlers of fused attention (``attention``), higher-order ops
(``hops``), collectives (``collective_ops``) and the module hooks that name each GEMM's
site (``site_hooks``). It decides nothing: it hands what it sees to the guard.
"""
