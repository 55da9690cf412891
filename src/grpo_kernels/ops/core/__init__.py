"""What both loss ops (logits-level and fused LM head) and the sharding layer share.

- :mod:`.online_softmax`: the ``(m, S, Q)`` row statistics and their merge rules;
- :mod:`.dtypes`: dtype names, the CPU-friendly bfloat16 cast, operand dtypes;
- :mod:`.validate`: argument checks that name the bad argument, the choice of implementation;
- :mod:`.batch`: :class:`TokenBatch`, the per-token inputs every backend takes;
- :mod:`.vjp`: the one ``custom_vjp`` builder of every fast backend (gradient formed in the
  forward pass, the backward only scales it or runs a gradient kernel);
- :mod:`.options`: helpers the per-op option dataclasses validate themselves with;
- :mod:`.platform`: choices made for the platform a program is lowered for (:func:`by_platform`).

No module here imports an op.
"""
