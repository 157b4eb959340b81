"""Log-linear attention: Fenwick-level states over the scalar-gate kinds (SSD, Gated DeltaNet).

``attention`` :func:`jattn.log_linear_attention` (validates, then dispatches), ``levels`` the Fenwick levels and
their merge, ``recurrent`` and ``chunk`` its two forms, ``sequence_parallel`` its sequence-parallel form.
"""
