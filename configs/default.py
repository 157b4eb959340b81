"""MQAR (multi-query associative recall), the default run: attention against a no-attention control.

Run:      python -m train                      (this file is the default config)
          make train                           (the same, setting up .venv first)
Expect:   attention >= 99% held-out per-token accuracy on the queries; the control
          (``model.mixer='none'``, trained on the same budget) stays at chance, 1/32.
Time:     84 s on the 2-core CPU for both runs (measured 2026-11-30): attention 100.0% token
          and sequence accuracy after 2000 steps, the control 3.4% token accuracy.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "mqar"  # run directory runs/<name> unless workdir is set
    c.workdir = ""
    # An existing run directory of this name: True resumes it (the config must match on every key
    # that shapes the run, README "Run directories"); False moves it aside to runs/<name>.old-<n>.
    c.resume = True
    c.seed = 0
    c.task = ml_collections.ConfigDict(dict(name="mqar", num_pairs=8, num_queries=8, num_keys=32, num_values=32))
    c.model = ml_collections.ConfigDict(
        dict(
            mixer="attention",  # 'attention' (softmax), 'linear', or 'none' (the token-local control)
            positions="learned",  # 'learned' (an absolute table) or 'alibi' (no table; softmax attention only)
            d_model=64,
            num_heads=2,
            num_kv_heads=0,  # 0: as many as num_heads; fewer: grouped-query attention
            num_layers=2,
            mlp_ratio=4,
            window=0,  # > 0: causal sliding window of this many past keys (+ the query itself)
            global_tokens=(),  # with a window: positions that see and are seen by all (causally)
            implementation="",  # jattn.attention's path: '' (chosen per call), 'dense', 'blockwise', 'xla', 'cudnn'
            block_size=0,  # blockwise tiles (one int for both sides); 0: chosen from the mask
        )
    )
    c.steps = 2000
    c.batch_size = 64
    c.learning_rate = 1e-3
    c.warmup_steps = 200
    c.weight_decay = 0.01
    c.grad_clip = 1.0
    c.log_every = 50  # steps per jitted call (one lax.scan) and per metrics line
    c.eval_every = 500
    c.eval_batches = 8
    c.checkpoint_every = 500
    c.control = True  # also train the control on the same budget; the verdict shows both
    c.control_model = ml_collections.ConfigDict(dict(mixer="none"))  # the model keys the control changes
    # After training, also evaluate on the task scaled to these multiples of its length (tasks that
    # have Task.scaled); the learned position table then has rows for the longest, untrained past L.
    c.extrapolate = ()
    # Devices: data parallel x sequence parallel (ring attention) x model parallel (heads, MLP);
    # data * seq * model devices are used (README "Scaling out").
    c.mesh = ml_collections.ConfigDict(dict(data=1, seq=1, model=1))
    # Multi-host: a coordinator address makes this one of num_processes processes (or set
    # JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; -1 and 0 mean "from the environment").
    c.distributed = ml_collections.ConfigDict(dict(coordinator_address="", num_processes=0, process_id=-1))
    return c
