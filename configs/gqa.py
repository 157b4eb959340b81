"""Grouped-query attention on MQAR: 2 query heads sharing 1 key/value head (multi-query, K = 1).

The cache of a decoder with this config holds one kv head per layer instead of two.
Run:      python -m train --config configs/gqa.py
Expect:   >= 99% held-out token accuracy on the queries (chance 1/32).
Time:     52 s on the 2-core CPU (measured 2026-11-30): 100.0% token and sequence accuracy.
"""

from configs import default


def get_config():
    c = default.get_config()
    c.name = "gqa"
    c.model.num_heads = 2
    c.model.num_kv_heads = 1
    c.control = False
    return c
